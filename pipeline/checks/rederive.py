"""Second implementations, in numpy and pyarrow, of what the probs stage computes with torch
and transformers: FP64 probabilities, ranks, and the top-k / top-p kept sets.

The checks compare these with the stored tables. They share no code with
`pipeline.numerics`, so a bug there cannot hide in both: softmax is a max-subtracted `exp`
normalised by an exact sum (`math.fsum`), ranks come from `pyarrow.compute.rank`, and the
kept sets from numpy sorts with the warpers' rules written out (below).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# top-p membership is decided in float32 by the warper; its cumulative sums agree with FP64
# to ~1.2e-7 (measured on tiny_qwen2 and gemma3_270m logits, T = 0.7 and 1). Positions whose
# FP64 cumulative lies within this band of 1 - p may go either way.
TOP_P_BAND = 2.0**-18            # 3.8e-6: 32 float32 ulps at 1
TINY = 1e-290                    # probabilities below this are compared absolutely (no relative precision)


def _digest(row: np.ndarray) -> tuple:
    row = np.ascontiguousarray(row)
    return hashlib.blake2b(row.view(np.uint8), digest_size=16).digest(), row.dtype.str, row.shape


def _frozen(value):
    """value with its arrays read-only: a memoised result is shared, so no caller may change it in place."""
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    elif isinstance(value, KeptRule):
        for a in (value.allowed, value.ids, value.starts, value.lo, value.hi):
            a.flags.writeable = False
    return value


def memoised(fn):
    """fn(row, *args) remembered by the row's content (blake2b of its bytes, dtype, shape) and args, for the
    last 16 calls: the checks derive the same softmax and kept sets of one row for several checks (the
    prompt-metrics rows, the tables, the filtered sets), each derivation a full-vocabulary pass."""
    memo: OrderedDict = OrderedDict()

    @functools.wraps(fn)
    def wrapper(row: np.ndarray, *args):
        key = (_digest(row), args)
        if key in memo:
            memo.move_to_end(key)
            return memo[key]
        memo[key] = value = _frozen(fn(row, *args))
        if len(memo) > 16:
            memo.popitem(last=False)
        return value
    return wrapper


@memoised
def softmax64(row: np.ndarray, t: float) -> np.ndarray:
    """softmax(row / t) in float64; -inf (masked) ids get exactly 0; a NaN or +inf makes it all NaN.
    Read-only (memoised)."""
    x = row.astype(np.float64) / t
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        e = np.where(x == -np.inf, 0.0, np.exp(x - (x[finite].max() if finite.any() else 0.0)))
        return e / math.fsum(e.tolist())


def relative_difference(stored: np.ndarray, derived: np.ndarray) -> tuple[float, int]:
    """max |stored - derived| / max(|derived|, TINY) and where; equal values count 0; NaN, or
    a length mismatch (index -1), count inf."""
    if stored.shape != derived.shape:
        return math.inf, -1
    if not stored.size:
        return 0.0, -1
    a, b = stored.astype(np.float64), derived.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d = np.where(a == b, 0.0, np.abs(a - b) / np.maximum(np.abs(b), TINY))
    d = np.nan_to_num(d, nan=math.inf)
    i = int(np.argmax(d))
    return float(d[i]), i


def ranks(row: np.ndarray) -> np.ndarray:
    """1-based rank per id: logit descending, equal logits by lower id (pyarrow's "first" tiebreak)."""
    return pc.rank(pa.array(row.astype(np.float64)), sort_keys="descending", tiebreaker="first").to_numpy()


@dataclass(frozen=True)
class KeptRule:
    """What a filter must keep: `allowed` ids may be kept at all; of each tie group (ids with
    equal scores) between `lo` and `hi` must be kept (lo == hi unless the float32 cut is
    within TOP_P_BAND); which members of a partly kept group is the sort's choice. The groups are
    arrays (a vocabulary without ties is 152k groups of one): group g is ids[starts[g]:starts[g + 1]]."""

    allowed: np.ndarray     # bool [vocab]
    ids: np.ndarray         # int64: the allowed ids, group after group (ascending score)
    starts: np.ndarray      # int64 [groups]: where each group starts in `ids`
    lo: np.ndarray          # int64 [groups]
    hi: np.ndarray          # int64 [groups]

    @property
    def groups(self) -> list[tuple[np.ndarray, int, int]]:
        """(ids, lo, hi) per group."""
        ends = [*self.starts[1:].tolist(), self.ids.size]
        return [(self.ids[a:b], int(lo), int(hi)) for a, b, lo, hi in zip(self.starts.tolist(), ends, self.lo, self.hi)]

    def violation(self, kept: np.ndarray) -> str | None:
        """Why `kept` (ids) breaks the rule, or None."""
        if not kept.size:
            kept = kept.astype(np.int64)          # np.array([]) is float64, which cannot index
        if _repeats(kept):
            return "an id kept twice"
        if kept.size and (kept.min() < 0 or kept.max() >= self.allowed.size or not self.allowed[kept].all()):
            inside = (kept >= 0) & (kept < self.allowed.size)       # an id past the vocabulary is outside too
            return f"{int((~inside).sum()) + int((~self.allowed[kept[inside]]).sum())} kept ids outside the filter"
        if not self.starts.size:
            return None
        mask = np.zeros(self.allowed.size, bool)
        mask[kept] = True
        n = np.add.reduceat(mask[self.ids].astype(np.int64), self.starts)      # kept per group
        bad = np.flatnonzero((n < self.lo) | (n > self.hi))
        if not bad.size:
            return None
        g = int(bad[0])
        end = int(self.starts[g + 1]) if g + 1 < self.starts.size else self.ids.size
        ids = self.ids[int(self.starts[g]):end]
        return f"{int(n[g])} of the {ids.size} tied ids {ids[:3].tolist()}... kept, {self.lo[g]}-{self.hi[g]} expected"


def _repeats(ids: np.ndarray) -> bool:
    """Whether an id occurs twice (counted, for ids in a vocabulary's range; else by np.unique)."""
    if ids.size < 2:
        return False
    if ids.min() >= 0 and ids.max() < 1 << 24:
        return bool(np.bincount(ids.astype(np.int64)).max() > 1)
    return np.unique(ids).size != ids.size


@memoised
def kept_rule(row: np.ndarray, temperature: float, top_k: int, top_p: float) -> KeptRule:
    """The kept set of temperature -> top-k -> top-p (`generate`'s order and rules) on float32 logits.

    Greedy (T = 0): the lowest id among the maxima. Otherwise, as the warpers: scores =
    float32 logits / T (an IEEE float32 division, the warper's exactly); top-k keeps every id
    scoring >= the k-th highest score; top-p, on softmax of what top-k left, sorts ascending
    and removes a position when the cumulative mass up to it is <= 1 - p, never the last. In
    exact arithmetic that keeps a position iff the mass strictly above it is < p, so the
    count kept of a tie group is fixed while which of its ids is not.
    """
    row = row.astype(np.float32)
    finite = np.isfinite(row)
    if temperature == 0:
        allowed = np.zeros(row.size, bool)
        allowed[int(np.argmax(np.where(finite, row, -np.inf)))] = True
        one = np.ones(1, np.int64)
        return KeptRule(allowed, np.flatnonzero(allowed), np.zeros(1, np.int64), one, one.copy())
    scores = row / np.float32(temperature) if temperature != 1.0 else row
    allowed = finite.copy()
    if top_k:
        kth = np.sort(scores)[::-1][min(top_k, scores.size) - 1]
        allowed &= scores >= kth
    ids = np.flatnonzero(allowed)
    values, inverse, counts = np.unique(scores[ids], return_inverse=True, return_counts=True)  # ascending
    grouped = ids[np.argsort(inverse, kind="stable")]                  # one tie group after another
    counts = counts.astype(np.int64)
    starts = np.cumsum(counts) - counts
    if top_p >= 1.0:
        return KeptRule(allowed, grouped, starts, counts, counts.copy())
    q = softmax64(np.where(allowed, scores, -np.inf), 1.0)[grouped[starts]]    # per-member mass
    below = np.concatenate([[0.0], np.cumsum(q * counts)[:-1]])                 # mass of lower groups
    # the cumulative at each position j = 1..size of each group: below[g] + q[g] * j, every group at once
    j = np.arange(1, grouped.size + 1, dtype=np.int64) - np.repeat(starts, counts)
    cum = np.repeat(below, counts) + np.repeat(q, counts) * j.astype(np.float64)
    lo = np.add.reduceat((cum > 1 - top_p + TOP_P_BAND).astype(np.int64), starts)
    hi = np.add.reduceat((cum > 1 - top_p - TOP_P_BAND).astype(np.int64), starts)
    if values.size:                                                              # min_tokens_to_keep = 1
        lo[-1], hi[-1] = max(lo[-1], 1), max(hi[-1], 1)
    return KeptRule(allowed, grouped, starts, lo, hi)
