"""Progress bars for the long steps: drawn on a terminal, silent in CI logs and under DVC.

`disable=None` is tqdm's "only when stderr is a terminal"; `stage_main` also sets
TQDM_DISABLE off a terminal, which tqdm reads as the default for every bar.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def bar(items: Iterable[T], total: int | None, desc: str, unit: str = "it") -> Iterable[T]:
    """`items`, with a bar on a terminal (none for fewer than 2 items: nothing to watch)."""
    from tqdm.auto import tqdm
    if total is not None and total < 2:
        return items
    return tqdm(items, total=total, desc=desc, unit=unit, disable=None, leave=False, dynamic_ncols=True)


def quiet_off_terminal() -> None:
    """No progress bars when stderr is not a terminal (CI logs, DVC's captured output): they
    would be thousands of carriage-return lines there. tqdm, the hub and transformers each
    have their own switch."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:       # imported already: it read the variables at import
        sys.modules["transformers"].utils.logging.disable_progress_bar()
