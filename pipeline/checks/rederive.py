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
        value.allowed.flags.writeable = False
        for ids, _, _ in value.groups:
            ids.flags.writeable = False
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
    """What a filter must keep: `allowed` ids may be kept at all; of each tie `group` (ids with
    equal scores) between `lo` and `hi` must be kept (lo == hi unless the float32 cut is
    within TOP_P_BAND); which members of a partly kept group is the sort's choice."""

    allowed: np.ndarray                             # bool [vocab]
    groups: list[tuple[np.ndarray, int, int]]       # (ids, lo, hi)

    def violation(self, kept: np.ndarray) -> str | None:
        """Why `kept` (ids) breaks the rule, or None."""
        if np.unique(kept).size != kept.size:
            return "an id kept twice"
        if kept.size and (kept.min() < 0 or kept.max() >= self.allowed.size or not self.allowed[kept].all()):
            return f"{int((~self.allowed[kept.clip(0, self.allowed.size - 1)]).sum())} kept ids outside the filter"
        member = np.isin(np.concatenate([g for g, _, _ in self.groups]), kept)
        at = 0
        for ids, lo, hi in self.groups:
            n = int(member[at:at + ids.size].sum())
            at += ids.size
            if not lo <= n <= hi:
                return f"{n} of the {ids.size} tied ids {ids[:3].tolist()}... kept, {lo}-{hi} expected"
        return None


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
        return KeptRule(allowed, [(np.flatnonzero(allowed), 1, 1)])
    scores = row / np.float32(temperature) if temperature != 1.0 else row
    allowed = finite.copy()
    if top_k:
        kth = np.sort(scores)[::-1][min(top_k, scores.size) - 1]
        allowed &= scores >= kth
    ids = np.flatnonzero(allowed)
    values, inverse, counts = np.unique(scores[ids], return_inverse=True, return_counts=True)  # ascending
    members = np.split(ids[np.argsort(inverse, kind="stable")], np.cumsum(counts)[:-1])       # one tie group each
    if top_p >= 1.0:
        return KeptRule(allowed, [(m, m.size, m.size) for m in members])
    q = softmax64(np.where(allowed, scores, -np.inf), 1.0)[[m[0] for m in members]]   # per-member mass
    below = np.concatenate([[0.0], np.cumsum(q * counts)[:-1]])                         # mass of lower groups
    groups = []
    for g, m in enumerate(members):
        cum = below[g] + q[g] * np.arange(1, m.size + 1)         # cumulative at each position of the group
        lo, hi = int((cum > 1 - top_p + TOP_P_BAND).sum()), int((cum > 1 - top_p - TOP_P_BAND).sum())
        if g == values.size - 1:                                 # min_tokens_to_keep = 1
            lo, hi = max(lo, 1), max(hi, 1)
        groups.append((m, lo, hi))
    return KeptRule(allowed, groups)
