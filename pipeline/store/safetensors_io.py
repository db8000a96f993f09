"""safetensors files read without torch: the header, one tensor, or a tensor row by row.

The stages after `forward` read capture.safetensors for a few tensors (the logits, the input
ids, a few coordinates); torch and its import time are not needed for that. Offsets come from
the header, every one checked against the file's size first, so a truncated or foreign file
is one clear error, not a short read later. Floating tensors come back as float32: bf16 is
the high half of a float32 and float16 widens exactly, so every value is kept.
Memory: `rows` holds one row at a time, whatever the tensor's size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import UserError

# safetensors dtype -> numpy dtype of the stored bytes (bf16: its bits, widened by `widen`)
STORED = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_MAX_HEADER = 100 << 20           # safetensors' own limit


@dataclass(frozen=True)
class Tensor:
    """Where one tensor's bytes are: absolute [start, end) offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last dimension)."""
        return (self.end - self.start) // max(1, self.rows)

    @property
    def rows(self) -> int:
        """Rows of the last dimension (every leading dimension flattened)."""
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if self.shape else 1


def _unreadable(path: Path, detail: str) -> UserError:
    return UserError(f"{path} is not a readable safetensors file (truncated or corrupt?): {detail}")


def header(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(name -> Tensor, __metadata__) of a safetensors file, offsets checked against its size."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _unreadable(path, f"{size} bytes, no header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise _unreadable(path, f"header length {n} past the file's {size} bytes")
        try:
            raw = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _unreadable(path, f"header is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise _unreadable(path, "header is not a JSON object")
    base, tensors, end = 8 + n, {}, 8 + n
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise _unreadable(path, f"tensor {name!r}: bad header entry ({e})") from None
        if dtype not in STORED:
            raise _unreadable(path, f"tensor {name!r}: dtype {dtype} is not one this reader knows")
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(STORED[dtype]).itemsize
        if not 0 <= a <= b or b - a != want:
            raise _unreadable(path, f"tensor {name!r}: offsets {[a, b]} do not hold shape {list(shape)} {dtype}")
        tensors[name] = Tensor(name, dtype, shape, base + a, base + b)
        end = max(end, base + b)
    if end != size:
        raise _unreadable(path, f"the tensors end at byte {end}, the file has {size}")
    meta = raw.get("__metadata__") or {}
    return tensors, meta if isinstance(meta, dict) else {}


def widen(values: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values as float32 (floating dtypes) or as stored (integers, bool); exact."""
    if dtype == "BF16":
        bits = values.astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    if dtype in ("F16", "F32"):
        return values.astype(np.float32, copy=False)
    return values


def _get(path: Path, name: str) -> Tensor:
    tensors, _ = header(path)
    if name not in tensors:
        raise UserError(f"{path} has no tensor {name!r}: re-run the forward stage")
    return tensors[name]


def read(path: Path, name: str) -> np.ndarray:
    """One whole tensor (for small ones: ids, a few activations), floats as float32."""
    t = _get(path, name)
    with open(path, "rb") as f:
        f.seek(t.start)
        values = np.frombuffer(f.read(t.end - t.start), STORED[t.dtype]).reshape(t.shape)
    return widen(values, t.dtype)


def rows(path: Path, name: str) -> Iterator[np.ndarray]:
    """The tensor's rows (last dimension) in order, each a fresh float32 array; one in memory at a time."""
    t = _get(path, name)
    with open(path, "rb") as f:
        f.seek(t.start)
        for _ in range(t.rows):
            yield widen(np.frombuffer(f.read(t.row_bytes), STORED[t.dtype]), t.dtype)


def sha256(path: Path, name: str, chunk: int = 1 << 20) -> str:
    """sha256 of one tensor's raw bytes (as stored: bf16 bits for bf16), read in chunks."""
    t, h = _get(path, name), hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(t.start)
        left = t.end - t.start
        while left:
            block = f.read(min(chunk, left))
            h.update(block)
            left -= len(block)
    return h.hexdigest()
