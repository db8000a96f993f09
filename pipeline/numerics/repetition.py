"""Repetition in a generated id sequence: the loop its tail falls into, and distinct n-gram ratios.

A loop is what greedy decoding of a small model often ends in (gemma3_270m on the reference
prompt: "\\n1. 1. 1. ..."). Definitions, steps counted from 1 as in steps.parquet:

- `ids[s-1:]` is *periodic with period p* when `ids[i] == ids[i + p]` for every i >= s-1 with
  i + p < len(ids).
- The sequence *ends in a loop* when some periodic tail holds at least MIN_REPEATS = 2 full
  periods. Two is the least that shows a repetition at all (any block is "one period" of
  itself), and it is the rule the DVC metric `<branch>_loop` has always used (the last 2p ids
  are one block of p ids twice), so that column keeps its values. It follows that a sequence
  ending with one token twice (`[..., X, X]`) ends in a loop of period 1: a reader wanting a
  stricter rule has the loop's length, `len(ids) - start + 1`, i.e. `(len - start + 1) / period`
  repeats, to filter on.
- The loop's *period* is the smallest p for which such a tail exists; its *start* is the earliest
  step s from which the tail is periodic with that p.

`find_loop` finds the loop; `is_loop` checks a claimed (start, period) against the definitions
directly, by other code, so the checks stage and the tests can verify the finder's answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_REPEATS = 2      # full periods a periodic tail must hold to count as a loop


@dataclass(frozen=True)
class Loop:
    start: int       # 1-based step where the periodic tail begins
    period: int      # the smallest period with MIN_REPEATS full periods at the end


def find_loop(ids: Sequence[int]) -> Loop | None:
    """The loop the sequence ends in, None when it ends in none (empty and one-id sequences too)."""
    ids, n = list(ids), len(ids)
    period = next((p for p in range(1, n // MIN_REPEATS + 1) if ids[n - 2 * p:n - p] == ids[n - p:]), None)
    if period is None:
        return None
    first = n - MIN_REPEATS * period            # 0-based index where the last two periods begin
    while first > 0 and ids[first - 1] == ids[first - 1 + period]:
        first -= 1
    return Loop(first + 1, period)


def _periodic_from(ids: Sequence[int], index: int, period: int) -> bool:
    """ids[index:] is periodic with `period` (index 0-based), checked element by element."""
    return all(ids[i] == ids[i + period] for i in range(index, len(ids) - period))


def _is_loop_tail(ids: Sequence[int], index: int, period: int) -> bool:
    return len(ids) - index >= MIN_REPEATS * period and _periodic_from(ids, index, period)


def _any_loop_tail(ids: Sequence[int], period: int) -> bool:
    """Some tail holds MIN_REPEATS periods of `period`: a periodic tail's own tails are periodic, so
    the shortest such tail (the last MIN_REPEATS * period ids) decides."""
    index = len(ids) - MIN_REPEATS * period
    return index >= 0 and _periodic_from(ids, index, period)


def is_loop(ids: Sequence[int], start: int, period: int) -> bool:
    """Whether Loop(start, period) is the loop of `ids` by the definitions above: the tail from
    `start` is periodic with `period` and holds MIN_REPEATS periods, it is not periodic from
    `start - 1`, and no smaller period has a tail of MIN_REPEATS periods anywhere."""
    if period < 1 or start < 1 or not _is_loop_tail(ids, start - 1, period):
        return False
    if start > 1 and _periodic_from(ids, start - 2, period):
        return False
    return not any(_any_loop_tail(ids, q) for q in range(1, period))


def has_no_loop(ids: Sequence[int]) -> bool:
    """No tail of `ids` holds MIN_REPEATS full periods of any period (what `find_loop` -> None claims)."""
    return not any(_any_loop_tail(ids, q) for q in range(1, len(ids) // MIN_REPEATS + 1))


def distinct_ratio(ids: Sequence[int], n: int) -> float | None:
    """Distinct n-grams / n-grams (1.0: no n-gram repeats; 1/count: one n-gram throughout). None
    for a sequence shorter than n, which has no n-gram: 0/0 is no ratio, and a number there would
    read as "no repetition" or "all repetition" when nothing was observed."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None
