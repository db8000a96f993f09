"""`fsum`: the correctly rounded sum of a float64 array, the very float `math.fsum` returns, vectorised.

`math.fsum(a.tolist())` over a 152k-id vocabulary costs a list of 152k Python floats and Shewchuk's
partials one value at a time; the probs stage takes a few dozen such sums per prompt. Here every finite
float64 is split, exactly, into a high part (its sign, exponent and top 25 fraction bits: the value with
its low 27 bits cleared) and a low part (the value minus the high part, exact by Sterbenz: they share sign
and exponent). numpy adds each part per binary exponent (`bincount`): within an exponent group a high part
is a multiple of 2**(e - 1048) below 2**26 of them and a low part a multiple of 2**(e - 1075) below 2**27,
so up to 2**26 values add without a single rounding, in any order. The at most 2 x 2046 group sums are
then exact floats whose sum is the array's exact sum, and `math.fsum` of them rounds that sum once, ties to
even: the very float `math.fsum` of the whole array returns. Non-finite input, values of 2**972 and more
(a margin that keeps every group sum and the final `math.fsum` far from overflow; `math.fsum` itself raises on
an intermediate overflow even when the sum is finite), and sums that are exactly zero (whose sign `math.fsum`
decides) go to `math.fsum` itself. `tests/unit/test_exactsum.py` holds it to `math.fsum`, bit for bit.

The checks keep `math.fsum`: they recompute the stage's sums by another route.
"""

from __future__ import annotations

import math

import numpy as np

_HIGH = np.uint64(0xFFFF_FFFF_F800_0000)   # sign, exponent and the top 25 fraction bits
_HUGE = 0x7FF - 52              # |value| >= 2**972 (and inf, NaN): math.fsum's own rules (see `fsum`)
_MAX_COUNT = 1 << 26            # per exponent group, this many parts add exactly (see the module's note)


def fsum(values) -> float:
    """math.fsum(values) for a float64 array (any shape; other float dtypes are widened exactly)."""
    a = np.ascontiguousarray(values, dtype=np.float64).ravel()
    if a.size == 0:
        return 0.0
    if a.size > _MAX_COUNT:
        return math.fsum(a.tolist())
    bits = a.view(np.uint64)
    exponent = (bits >> np.uint64(52)).view(np.int64)
    exponent &= 0x7FF
    if int(exponent.max()) >= _HUGE:    # inf, NaN, or near overflow (where math.fsum raises on its partials)
        return math.fsum(a.tolist())
    high = (bits & _HIGH).view(np.float64)
    high_sums = np.bincount(exponent, weights=high)
    low_sums = np.bincount(exponent, weights=a - high)
    groups = np.flatnonzero((high_sums != 0) | (low_sums != 0))
    total = math.fsum(high_sums[groups].tolist() + low_sums[groups].tolist())
    return total if total != 0 else math.fsum(a.tolist())
