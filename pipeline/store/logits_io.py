"""Logits in long format on Parquet: one row group per position, streamed.

Layout: `position` int32, `token_id` int32, `logit` float32 (every bf16 and fp16 value is
exact in float32), sorted by (position, token_id), zstd, BYTE_STREAM_SPLIT on `logit`
(floats compress far better split by byte plane). One row group per position means a
reader filtering on one position touches one row group, and the writer never holds more
than one row of [T, V] as an extra float32 copy.

Where the time goes (gemma3_270m's [26, 262144], 2 cores; `nexttoken bench --only logits_io`):
the long format itself. `position` and `token_id` are two more int32 columns as large as the
logits, and every value passes through Arrow's page encoders, so the same layout written
uncompressed costs about as much as the zstd file (the bench records both). What is kept
off the hot path:
- the columns are NOT NULL (every row has all three): no definition levels to encode and
  decode, which cost as much as the values themselves;
- pages are bounded by `data_page_size` (1 MiB), not by Arrow's default 20,000-row cap:
  ~10x fewer pages and zstd frames, a smaller file, half the decompression time;
- `position` is PLAIN (zstd reduces a constant page to a few bytes; the dictionary and DELTA
  encoders hash or difference every value, 3-4x slower) and `token_id` BYTE_STREAM_SPLIT
  (Arrow's DELTA_BINARY_PACKED encoder is 3x slower);
- statistics only on `position` (row-group skipping, `positions_in`): every row group spans
  every token id, so token_id / logit min-max would never skip anything;
- one `token_id` array per file; bf16 rows widened in numpy (`_float32`).
`read_matrix` reads the whole matrix back: the logit column only, row groups decoded in
parallel into one preallocated array, positions from the statistics.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import progress
from pipeline.errors import UserError
from pipeline.store import safetensors_io
from pipeline.store.artifacts import read_parquet

LOGITS_SCHEMA = pa.schema([pa.field("position", pa.int32(), nullable=False),
                           pa.field("token_id", pa.int32(), nullable=False),
                           pa.field("logit", pa.float32(), nullable=False)])
# Arrow caps data pages at 20,000 rows by default; the byte limit (data_page_size, 1 MiB)
# is the one that should decide. Neither value is stored in the file.
_MAX_ROWS_PER_PAGE = 1 << 30
_WRITE_BATCH_SIZE = 1 << 16


def writer_options(compression: str | None = "zstd") -> dict:
    """ParquetWriter keyword arguments for logits files. `compression=None` is the same
    layout uncompressed (the bench's floor); the pipeline always writes zstd."""
    return {"compression": compression or "none", "use_dictionary": False,
            "column_encoding": {"position": "PLAIN", "token_id": "BYTE_STREAM_SPLIT",
                                "logit": "BYTE_STREAM_SPLIT"},
            "write_statistics": ["position"], "max_rows_per_page": _MAX_ROWS_PER_PAGE,
            "write_batch_size": _WRITE_BATCH_SIZE}


def _constant(value, n: int, type_: pa.DataType) -> pa.Array:
    return pa.array(np.full(n, value), type_) if not pa.types.is_string(type_) else \
        pa.repeat(pa.scalar(value, type_), n)


def _float32(row) -> np.ndarray:
    """A logits row (a torch tensor, or a numpy array already widened) as float32, exactly.
    bf16 is the high half of a float32, so widening is a 16-bit shift, done here in numpy:
    torch's `.to(float32)` of one row is a parallel region, and on a busy 2-core machine its
    waiting threads made it 40x slower (0.4 s per file). torch is imported only for torch rows
    (the logits stage reads numpy rows and never imports it)."""
    if isinstance(row, np.ndarray):
        return row.astype(np.float32, copy=False)
    import torch
    row = row.detach().cpu().contiguous()
    if row.dtype == torch.bfloat16:
        return safetensors_io.widen(row.view(torch.int16).numpy().view(np.uint16), "BF16")
    if row.dtype in (torch.float16, torch.float32):
        return row.numpy().astype(np.float32, copy=False)
    return row.to(torch.float32).numpy()


def _row_table(position: int, row, schema: pa.Schema, extra: dict | None = None,
               token_ids: pa.Array | None = None) -> pa.Table:
    values = _float32(row)
    n = values.shape[0]
    if token_ids is None or len(token_ids) != n:
        token_ids = pa.array(np.arange(n, dtype=np.int32))
    cols = [_constant(v, n, schema.field(name).type) for name, v in (extra or {}).items()]
    cols += [pa.array(np.full(n, position, np.int32)), token_ids, pa.array(values)]
    return pa.Table.from_arrays(cols, schema=schema)


def write_logits(path: Path, rows: Iterable[tuple[int, object]], metadata: dict[bytes, bytes],
                 extra_schema: list[tuple[str, pa.DataType]] | None = None,
                 extra_values: Iterable[dict] | None = None, compression: str | None = "zstd",
                 total: int | None = None) -> int:
    """Stream (position, logits row [V]) pairs to `path`; returns the number of rows written.

    `extra_schema`/`extra_values` add leading constant columns per row group (e.g. branch,
    kv_cache, step for trajectory logits); `total` (the number of rows) draws a progress bar on a
    terminal. Every column is NOT NULL. `compression=None` is
    for the bench's uncompressed floor only.
    """
    schema = pa.schema([*(pa.field(n, t, nullable=False) for n, t in extra_schema or []),
                        *LOGITS_SCHEMA]).with_metadata(metadata)
    extras = iter(extra_values) if extra_values is not None else None
    total, token_ids = 0, None
    with pq.ParquetWriter(path, schema, **writer_options(compression)) as writer:
        for position, row in progress.bar(rows, total, f"write {path.name}", "position"):
            extra = next(extras) if extras is not None else None
            table = _row_table(position, row, schema, extra, token_ids)
            token_ids = table["token_id"].chunk(0)
            writer.write_table(table, row_group_size=table.num_rows)
            total += table.num_rows
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


def read_matrix(path: Path, threads: int | None = None) -> tuple[list[int], np.ndarray]:
    """(positions, float32 logits [n_positions, V]) of a whole logits file, in file order.

    Relies on the layout `write_logits` guarantees: one row group per position, each holding
    every token id in order (`read_position` verifies the ids of one row; here the metadata
    is checked: one position per row group, equal row counts). Reads only the logit column;
    the positions come from the row-group statistics. Row groups decode in parallel, each
    thread with its own reader, straight into one preallocated array.
    """
    def unreadable(e: Exception) -> UserError:
        return UserError(f"{path} is not a readable logits file (truncated or corrupt?): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")

    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        md = pq.ParquetFile(path).metadata
        stats = [md.row_group(rg).column(md.schema.names.index("position")).statistics
                 for rg in range(md.num_row_groups)]
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        raise unreadable(e) from None
    if any(s is None or not s.has_min_max or s.min != s.max for s in stats):
        raise UserError(f"{path}: a row group without one position in its statistics: not a logits file "
                        "written by write_logits")
    sizes = sorted({md.row_group(rg).num_rows for rg in range(md.num_row_groups)})
    if len(sizes) > 1:
        raise UserError(f"{path}: row groups differ in length ({sizes}): not one full row per position")
    n = md.num_row_groups
    out = np.empty((n, sizes[0] if sizes else 0), np.float32)
    workers = max(1, min(threads or os.cpu_count() or 1, 8, n))

    def read(rgs: range) -> None:
        with pq.ParquetFile(path, memory_map=True) as pf:
            for rg in rgs:
                col, offset = pf.read_row_group(rg, columns=["logit"], use_threads=False).column(0), 0
                for chunk in col.chunks:
                    out[rg, offset:offset + len(chunk)] = chunk.to_numpy()
                    offset += len(chunk)

    try:
        if workers == 1:
            read(range(n))
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(read, [range(w, n, workers) for w in range(workers)]))
    except (pa.ArrowInvalid, OSError) as e:
        raise unreadable(e) from None
    return [int(s.min) for s in stats], out


def positions_in(path: Path) -> list[int]:
    """Positions present in a logits file (from row-group statistics: no data read)."""
    md = pq.ParquetFile(path).metadata
    idx = md.schema.names.index("position")
    out = []
    for rg in range(md.num_row_groups):
        stats = md.row_group(rg).column(idx).statistics
        out.append(int(stats.min))
    return out


# ---------------------------------------------------------------- step logits (trajectories)
# step_logits.parquet: one row (and row group) per decoding step, the whole logits row in the model's
# own dtype as one value. Columns: branch, kv_cache, step (the keys), position (the row's prompt + new-token
# position, prefix_len - 1), `base` (the file row this one is XORed with, -1 for none) and `bits`: the row's
# raw bits (bf16 / fp16: 2 bytes per id, float32: 4), XORed with the base row's raw bits, written byte
# plane by byte plane (every id's first byte, then every second byte, ...), zstd. A row bit-identical to
# its base (a KV-cache step equal to the full prefix's, a branch before it leaves the other) is all zero
# bytes, which zstd stores in a few hundred. Lossless: `read_step_logits` gives the float32 values the
# long layout of logits.parquet would hold (every bf16 and fp16 value is exact in float32).
STEP_META_KEY = b"nexttoken.step_logits"
STEP_KEY_SCHEMA = [("branch", pa.string()), ("kv_cache", pa.bool_()), ("step", pa.int32())]
_STEP_DTYPES = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}
STEP_ZSTD_LEVEL = 1        # level 9 is no smaller on bf16 logits, 3.5x slower: docs/cost_and_scale.md


def _raw_bits(row) -> tuple[str, np.ndarray]:
    """(dtype name, the row's raw bits as unsigned integers): a torch row in its own dtype, or a numpy one."""
    if isinstance(row, np.ndarray):
        kinds = {np.dtype(np.float32): ("F32", np.uint32), np.dtype(np.float16): ("F16", np.uint16)}
        if row.dtype not in kinds:
            raise TypeError(f"a step logits row of numpy dtype {row.dtype}: float32 or float16")
        name, bits = kinds[row.dtype]
        return name, np.ascontiguousarray(row).view(bits)
    import torch
    row = row.detach().cpu().contiguous()
    names = {torch.bfloat16: ("BF16", torch.int16), torch.float16: ("F16", torch.int16),
             torch.float32: ("F32", torch.int32)}
    if row.dtype not in names:
        raise TypeError(f"a step logits row of torch dtype {row.dtype}: bfloat16, float16 or float32")
    name, signed = names[row.dtype]
    return name, row.view(signed).numpy().view(_STEP_DTYPES[name])


def widened(row) -> np.ndarray:
    """A step logits row (torch in its own dtype, or numpy) as the float32 values `read_step_logits` gives for it,
    widened the same exact way (bf16: a 16-bit shift; fp16 and float32 exactly)."""
    name, bits = _raw_bits(row)
    return _widen(bits, name)


def _widen(bits: np.ndarray, name: str) -> np.ndarray:
    return safetensors_io.widen(bits, "BF16") if name == "BF16" else \
        bits.view(np.float16).astype(np.float32) if name == "F16" else bits.view(np.float32).copy()


def row_sha256(values: np.ndarray) -> str:
    """sha256 (hex) of a step logits row as float32 little-endian bytes (`widened`, or a row `read_step_logits`
    gave): what trajectories.json records per step, so a row re-derived instead of stored is proven bit for bit
    (the widening is exact and one to one, so the float32 bytes pin the model dtype's bits)."""
    return hashlib.sha256(np.ascontiguousarray(values, dtype="<f4").tobytes()).hexdigest()


def _planes(bits: np.ndarray) -> bytes:
    """The bytes of `bits`, plane by plane: byte 0 of every value, then byte 1, ..."""
    return bits.view(np.uint8).reshape(bits.size, bits.itemsize).T.tobytes()


def _unplanes(data: bytes, dtype, n: int) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    return np.frombuffer(data, np.uint8).reshape(width, n).T.copy().view(dtype).reshape(n)


def choose_base(bits: np.ndarray, candidates: list[tuple[int, np.ndarray]]) -> int:
    """The earlier row (file index) to XOR `bits` with: the candidate sharing the most values, when it
    shares at least half of them; -1 (stored as it is) otherwise."""
    best, best_same = -1, bits.size // 2
    for index, other in candidates:
        same = int(np.count_nonzero(bits == other))
        if same > best_same:
            best, best_same = index, same
    return best


def write_step_logits(path: Path, rows: Iterable[tuple[int, object]], keys: Iterable[dict],
                      metadata: dict[bytes, bytes], compression_level: int = STEP_ZSTD_LEVEL) -> int:
    """Stream (position, logits row [V]) pairs with their {branch, kv_cache, step} keys to `path` in the
    step layout above; returns the number of rows. Each row's base is an earlier row of the same
    position (`choose_base`): the KV-cache and full-prefix runs of a step, and the branches while they
    share a prefix, are the same computation on the same ids."""
    keys, written, by_position, writer, dtype, size = iter(keys), 0, {}, None, None, None
    try:
        for position, row in rows:
            name, bits = _raw_bits(row)
            if writer is None:
                dtype, size = name, bits.size
                schema = pa.schema([*(pa.field(n, t, nullable=False) for n, t in STEP_KEY_SCHEMA),
                                    pa.field("position", pa.int32(), nullable=False),
                                    pa.field("base", pa.int32(), nullable=False),
                                    pa.field("bits", pa.binary(bits.nbytes), nullable=False)])
                meta = {**metadata, STEP_META_KEY: json.dumps({"dtype": name, "size": size}).encode()}
                schema = schema.with_metadata(meta)
                writer = pq.ParquetWriter(path, schema, compression="zstd", compression_level=compression_level,
                                          use_dictionary=False, write_statistics=["branch", "kv_cache", "step"])
            if (name, bits.size) != (dtype, size):
                raise ValueError(f"step logits rows differ in dtype or size: {name}[{bits.size}] after {dtype}[{size}]")
            same_position = by_position.setdefault(int(position), [])
            base = choose_base(bits, same_position)
            stored = bits if base < 0 else bits ^ next(b for i, b in same_position if i == base)
            key = next(keys)
            table = pa.Table.from_pydict(
                {"branch": [key["branch"]], "kv_cache": [key["kv_cache"]], "step": [key["step"]],
                 "position": [int(position)], "base": [base],
                 "bits": pa.array([_planes(stored)], pa.binary(bits.nbytes))}, schema=writer.schema)
            writer.write_table(table, row_group_size=1)
            same_position.append((written, bits))
            written += 1
    finally:
        if writer is not None:
            writer.close()
    if writer is None:      # no step at all (max_new_tokens=0): an empty file of the layout, bf16 by default
        schema = pa.schema([*(pa.field(n, t, nullable=False) for n, t in STEP_KEY_SCHEMA),
                            pa.field("position", pa.int32(), nullable=False),
                            pa.field("base", pa.int32(), nullable=False),
                            pa.field("bits", pa.binary(2), nullable=False)])     # Parquet has no width 0
        meta = {**metadata, STEP_META_KEY: json.dumps({"dtype": "BF16", "size": 0}).encode()}
        pq.write_table(schema.empty_table().replace_schema_metadata(meta), path, compression="zstd")
    return written


def step_layout(path: Path) -> dict:
    """{"dtype", "size"} of a step logits file (its schema metadata); refused when it is not one."""
    try:
        meta = pq.read_schema(path).metadata or {}
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path} is not a readable step logits file (truncated or corrupt?): {e}") from None
    if STEP_META_KEY not in meta:
        raise UserError(f"{path} is not a step logits file written by write_step_logits (no "
                        f"{STEP_META_KEY.decode()} metadata)")
    return json.loads(meta[STEP_META_KEY])


def read_step_logits(path: Path) -> list[tuple[dict, int, np.ndarray]]:
    """Every row of a step logits file in file order: ({branch, kv_cache, step}, position, float32 logits
    [V]), each row XOR-decoded against its base and widened exactly (bf16: a 16-bit shift)."""
    layout = step_layout(path)
    dtype, size = _STEP_DTYPES[layout["dtype"]], int(layout["size"])
    table = read_parquet(path)
    raw: list[np.ndarray] = []
    out = []
    for i, rec in enumerate(table.to_pylist()):
        bits = _unplanes(rec["bits"], dtype, size)
        base = rec["base"]
        if base >= 0:
            if base >= i:
                raise UserError(f"{path}: row {i} is XORed with row {base}, not an earlier one: corrupt")
            bits ^= raw[base]
        raw.append(bits)
        values = _widen(bits, layout["dtype"])
        out.append(({"branch": rec["branch"], "kv_cache": rec["kv_cache"], "step": rec["step"]},
                    rec["position"], values))
    return out
