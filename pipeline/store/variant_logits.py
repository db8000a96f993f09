"""The equivalence stage's variant_logits.parquet: each forward variation's own logits at the recorded positions.

One file per prompt (`paths.VARIANT_LOGITS`, a Hive partition like the others), logits.parquet's long
layout (`logits_io.write_logits`: `position`, `token_id`, `logit` float32, zstd, BYTE_STREAM_SPLIT) after
two constant columns per row group, `variation` (equivalence.parquet's name) and `dtype` (the dtype the
variant computed in: bfloat16, float32 or float16; every value of each is exact in float32, so the file
is lossless); one row group per (variation, position), variations in the configured order, positions
ascending. A variation that could not run here (its row's note says why) and the kv_cache rows (their
step logits are the trajectories' step_logits.parquet) have no rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UserError
from pipeline.store import logits_io

KEYS = [("variation", pa.string()), ("dtype", pa.string())]
COLUMNS = ["variation", "dtype", "position", "token_id", "logit"]


def write(path: Path, variants: list[tuple[str, object]], positions: list[int], metadata: dict[bytes, bytes]) -> int:
    """Each variant's [len(positions), V] logits (torch tensors in their own dtype); the rows written."""
    def dtype(logits) -> str:
        return str(logits.dtype).removeprefix("torch.")

    rows = ((p, logits[i]) for _, logits in variants for i, p in enumerate(positions))
    keys = ({"variation": name, "dtype": dtype(logits)} for name, logits in variants for _ in positions)
    return logits_io.write_logits(path, rows, metadata, extra_schema=KEYS, extra_values=keys)


def read(path: Path, variation: str | None = None,
         positions: list[int] | None = None) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """variation -> (dtype, positions, float32 logits [len(positions), V]); only `variation` and only
    `positions` where given (row groups are skipped by their constant columns' statistics)."""
    def refuse(why: str) -> UserError:
        return UserError(f"{path} is not a variant_logits file written by the equivalence stage: {why}")

    if not Path(path).is_file():
        raise UserError(f"{path} is missing: run `dvc repro` (the equivalence stage) to make it")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise refuse(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if pf.schema_arrow.names != COLUMNS:
        raise refuse(f"columns {pf.schema_arrow.names}, expected {COLUMNS}")
    out: dict[str, tuple[str, list[int], list[np.ndarray]]] = {}
    size, md = None, pf.metadata
    for g in range(pf.num_row_groups):
        stats = md.row_group(g).column(COLUMNS.index("position")).statistics
        if stats is None or not stats.has_min_max or stats.min != stats.max:
            raise refuse(f"row group {g} does not hold one position")
        if positions is not None and int(stats.min) not in positions:
            continue                               # skipped unread
        t = pf.read_row_group(g, columns=COLUMNS)
        name, dtype, pos = t["variation"][0].as_py(), t["dtype"][0].as_py(), int(stats.min)
        if variation is not None and name != variation:
            continue
        for col in ("variation", "dtype"):
            if t[col].unique().to_pylist() != [t[col][0].as_py()]:
                raise refuse(f"row group {g} holds more than one {col}")
        ids = t["token_id"].to_numpy()
        if not np.array_equal(ids, np.arange(len(ids))) or (size is not None and len(ids) != size):
            raise refuse(f"row group {g} ({name}, position {pos}) does not hold every token id once, in order")
        size = len(ids)
        entry = out.setdefault(name, (dtype, [], []))
        if entry[0] != dtype:
            raise refuse(f"{name} has rows of dtype {entry[0]} and {dtype}")
        if pos in entry[1]:
            raise refuse(f"{name} holds position {pos} twice")
        entry[1].append(pos)
        entry[2].append(t["logit"].to_numpy())
    return {k: (d, pos, np.stack(rows)) for k, (d, pos, rows) in out.items()}
