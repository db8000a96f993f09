"""Progress bars for the long steps: drawn on a terminal, silent in CI logs and under DVC.

`disable=None` is tqdm's "only when stderr is a terminal"; `stage_main` also sets
TQDM_DISABLE off a terminal, which tqdm reads as the default for every bar.
"""

from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def bar(items: Iterable[T], total: int | None, desc: str, unit: str = "it") -> Iterable[T]:
    """`items`, with a bar on a terminal (none for fewer than 2 items: nothing to watch)."""
    from tqdm.auto import tqdm
    if total is not None and total < 2:
        return items
    return tqdm(items, total=total, desc=desc, unit=unit, disable=None, leave=False, dynamic_ncols=True)
