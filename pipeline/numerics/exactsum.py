"""`fsum`: the correctly rounded sum of a float64 array, the very float `math.fsum` returns, vectorised.

`math.fsum(a.tolist())` over a 152k-id vocabulary costs a list of 152k Python floats and Shewchuk's
partials one value at a time; the probs stage takes a few dozen such sums per prompt. Here every finite
float64 is split, exactly, into an integer mantissa m (53 bits, signed) and its binary exponent e
(value = m * 2**(e - 1075), subnormals at e = 1); numpy adds the mantissas of each exponent in two
halves of 26 and 27 bits (each partial sum stays below 2**53 for up to 2**26 values, so float64
`bincount` adds them without rounding), and Python's integers add the at most 2046 exponent groups
exactly. The one rounding is the last: an exact integer (times a power of two) to the nearest float,
ties to even, as CPython's int true division and `float(int)` round, and as `math.fsum` rounds its
exact sum. Non-finite input, values of 2**1000 and more (where `math.fsum` raises on an intermediate
overflow even when the sum is finite), and sums that are exactly zero (whose sign `math.fsum`
decides) go to `math.fsum` itself. `tests/unit/test_exactsum.py` holds it to `math.fsum`, bit for bit.

The checks keep `math.fsum`: they recompute the stage's sums by another route.
"""

from __future__ import annotations

import math

import numpy as np

_FRACTION = np.uint64((1 << 52) - 1)
_LOW = (1 << 26) - 1
_HUGE = 0x7FF - 24              # |value| >= 2**1000: math.fsum's own rules (see `fsum`)
_MAX_COUNT = 1 << 26            # per exponent group, a 27-bit half summed this many times stays < 2**53


def fsum(values) -> float:
    """math.fsum(values) for a float64 array (any shape; other float dtypes are widened exactly)."""
    a = np.ascontiguousarray(values, dtype=np.float64).ravel()
    if a.size == 0:
        return 0.0
    if a.size > _MAX_COUNT:
        return math.fsum(a.tolist())
    bits = a.view(np.uint64)
    exponent = (bits >> np.uint64(52)).astype(np.int64)
    exponent &= 0x7FF
    if (exponent >= _HUGE).any():       # inf, NaN, or near overflow (where math.fsum raises on its partials)
        return math.fsum(a.tolist())
    mantissa = (bits & _FRACTION).view(np.int64)
    mantissa |= (exponent != 0).astype(np.int64) << 52   # the implicit bit of normal numbers
    np.negative(mantissa, out=mantissa, where=a < 0)
    np.maximum(exponent, 1, out=exponent)              # subnormals share exponent 1's scale
    high = np.bincount(exponent, weights=(mantissa >> 26).astype(np.float64), minlength=2047)
    low = np.bincount(exponent, weights=(mantissa & _LOW).astype(np.float64), minlength=2047)
    groups = np.flatnonzero((high != 0) | (low != 0))
    if groups.size == 0:
        return math.fsum(a.tolist())
    base = int(groups[0])
    total = 0
    for e, h, lo in zip(groups.tolist(), high[groups].tolist(), low[groups].tolist()):
        total += ((int(h) << 26) + int(lo)) << (e - base)
    if total == 0:
        return math.fsum(a.tolist())
    shift = base - 1075
    return float(total << shift) if shift >= 0 else total / (1 << -shift)
