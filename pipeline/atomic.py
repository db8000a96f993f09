"""Write a file atomically: a temporary name beside it, then a rename.

Shared by every layer that writes a single file outside a stage folder (params.yaml, the
sweep's tables, the bench's results); a stage's whole folder is swapped into place by
`pipeline.store.artifacts` instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def write_atomic(path: Path, write: Callable[[Path], T]) -> T:
    """`write(tmp)` to a temporary name beside `path`, then rename it into place: an interrupted
    writer leaves the old file or the new one, never half of one. Returns what `write` returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")   # same suffix: writers pick formats by it
    try:
        result = write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return result
