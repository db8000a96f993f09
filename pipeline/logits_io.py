"""Logits in long format on Parquet: one row group per position, streamed.

Layout: `position` int32, `token_id` int32, `logit` float32 (every bf16 and fp16 value is
exact in float32), sorted by (position, token_id), zstd, BYTE_STREAM_SPLIT on `logit`
(floats compress far better split by byte plane). One row group per position means a
reader filtering on one position touches one row group, and the writer never holds more
than one row of [T, V] as an extra float32 copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.artifacts import read_parquet, test_pause
from pipeline.errors import UserError

LOGITS_SCHEMA = pa.schema([("position", pa.int32()), ("token_id", pa.int32()), ("logit", pa.float32())])


def writer_options() -> dict:
    return {"compression": "zstd", "use_dictionary": ["position"], "column_encoding": {"token_id": "DELTA_BINARY_PACKED",
            "logit": "BYTE_STREAM_SPLIT"}, "write_statistics": ["position", "token_id"]}


def _row_table(position: int, row: torch.Tensor, schema: pa.Schema, extra: dict | None = None) -> pa.Table:
    values = row.detach().to("cpu", torch.float32).numpy()
    n = values.shape[0]
    cols = {name: pa.array(np.full(n, v), schema.field(name).type) for name, v in (extra or {}).items()}
    cols.update({"position": pa.array(np.full(n, position, np.int32)),
                 "token_id": pa.array(np.arange(n, dtype=np.int32)),
                 "logit": pa.array(values)})
    return pa.table(cols, schema=schema)


def write_logits(path: Path, rows: Iterable[tuple[int, torch.Tensor]], metadata: dict[bytes, bytes],
                 extra_schema: list[tuple[str, pa.DataType]] | None = None,
                 extra_values: Iterable[dict] | None = None) -> int:
    """Stream (position, logits row [V]) pairs to `path`; returns the number of rows written.

    `extra_schema`/`extra_values` add leading constant columns per row group (e.g. branch,
    kv_cache, step for trajectory logits).
    """
    schema = pa.schema([*(extra_schema or []), *LOGITS_SCHEMA]).with_metadata(metadata)
    extras = iter(extra_values) if extra_values is not None else None
    total = 0
    with pq.ParquetWriter(path, schema, **writer_options()) as writer:
        for position, row in rows:
            extra = next(extras) if extras is not None else None
            table = _row_table(position, row, schema, extra)
            writer.write_table(table, row_group_size=table.num_rows)
            total += table.num_rows
            test_pause("logits.rows")
    return total


def logit_encodings(path: Path) -> set[str]:
    """The encodings the `logit` column chunks actually use (read from the file metadata)."""
    md = pq.ParquetFile(path).metadata
    idx = md.schema.names.index("logit")
    return {enc for rg in range(md.num_row_groups) for enc in md.row_group(rg).column(idx).encodings}


def read_position(path: Path, position: int) -> np.ndarray:
    """The float32 logits of one position, ordered by token id."""
    table = read_parquet(path, columns=["token_id", "logit"], filters=[("position", "==", position)])
    if table.num_rows == 0:
        raise UserError(f"{path} has no rows for position {position}")
    ids = table["token_id"].to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise UserError(f"{path}: position {position} does not hold every token id in order")
    return table["logit"].to_numpy()


def positions_in(path: Path) -> list[int]:
    """Positions present in a logits file (from row-group statistics: no data read)."""
    md = pq.ParquetFile(path).metadata
    idx = md.schema.names.index("position")
    out = []
    for rg in range(md.num_row_groups):
        stats = md.row_group(rg).column(idx).statistics
        out.append(int(stats.min))
    return out
