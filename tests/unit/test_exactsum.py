"""pipeline.numerics.exactsum.fsum is math.fsum, bit for bit: on rows where a plain float sum is wrong, on
ties to even, subnormals, cancellation to zero and non-finite values, on probability rows of a real
vocabulary's size, and on hypothesis' float64 arrays."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeline.numerics.exactsum import fsum


def same(a: float, b: float) -> bool:
    """Equal bits (so 0.0 vs -0.0 and NaN are told apart / matched)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def reference(values) -> float:
    return math.fsum(np.asarray(values, dtype=np.float64).ravel().tolist())


@pytest.mark.parametrize("values", [
    [1e16, 1.0, -1e16],                         # a left-to-right sum gives 0.0, numpy's pairwise 0.0
    [1.0, 2.0**-53],                            # exactly halfway: ties to even -> 1.0
    [1.0, 2.0**-53, 2.0**-106],                 # just over halfway -> the next float up
    [1.0 + 2.0**-52, 2.0**-53],                 # halfway from an odd mantissa -> rounds up
    [5e-324, 5e-324, -5e-324],                  # subnormals
    [2.2250738585072014e-308, -5e-324],         # across the normal / subnormal boundary
    [0.1] * 10,
    [1.7976931348623157e308, -1.7976931348623157e308, 1.0],
    [float(np.nextafter(2.0**972, 0))] * 5 + [1.0, -(2.0**971)],   # the largest values of the vectorised path
    [2.0**972, 2.0**972, 3.0],                  # the smallest that go to math.fsum
    [2.0**-1074] * 3 + [2.0**-1022 * 1.5],      # subnormals beside the smallest normals' group
    [0.0], [-0.0], [-0.0, -0.0], [0.0, -0.0], [3.0, -3.0], [],   # zero sums: math.fsum decides the sign
    [float("inf"), 1.0], [float("nan"), 1.0],
])
def test_matches_math_fsum_where_a_float_sum_would_not(values):
    got, want = fsum(np.array(values, dtype=np.float64)), reference(values)
    assert same(got, want) or (math.isnan(got) and math.isnan(want)), (values, got, want)


def test_the_first_case_is_one_a_plain_sum_gets_wrong():
    row = np.array([1e16, 1.0, -1e16])
    assert float(np.sum(row)) != 1.0 and fsum(row) == 1.0


def test_probability_rows_of_a_vocabulary():
    rng = np.random.default_rng(29)
    for scale in (0.5, 3.0, 40.0):
        logits = rng.standard_normal(152_064) * scale
        p = np.exp(logits - logits.max())
        p /= p.sum()
        for row in (p, p * np.log(p), p.astype(np.float32), np.delete(p, [0, 5, 17])):
            assert same(fsum(row), reference(row))


def test_a_binade_of_two_million_full_mantissas_adds_exactly():
    """Every value in one exponent group with all 52 fraction bits set, signs mixed: the group's high and low parts
    must each add without rounding over 2**21 values (a split that kept fewer bits in the low part would not)."""
    rng = np.random.default_rng(3)
    full = np.nextafter(np.float64(2.0), 0)                   # 1.111...1 (binary) x 2**0
    values = full * np.where(rng.random(1 << 21) < 0.7, 1.0, -1.0)
    values[::7] = np.nextafter(values[::7], 0)               # and a few other mantissas
    assert same(fsum(values), reference(values))


def test_overflow_is_refused_as_math_fsum_refuses_it():
    with pytest.raises(OverflowError):
        reference([1.7976931348623157e308, 1.7976931348623157e308])
    with pytest.raises(OverflowError):
        fsum(np.array([1.7976931348623157e308, 1.7976931348623157e308]))


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@hyp_settings(max_examples=400, deadline=None)
@given(hnp.arrays(np.float64, st.integers(0, 64), elements=finite))
def test_any_finite_array(values):
    try:
        want = reference(values)
    except OverflowError:
        with pytest.raises(OverflowError):
            fsum(values)
        return
    assert same(fsum(values), want)


@hyp_settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2**53) + 1, 2**53 - 1), st.integers(-1074, 900)), max_size=40))
def test_mantissas_at_many_scales(pairs):
    values = np.array([math.ldexp(m, e) for m, e in pairs if math.isfinite(math.ldexp(m, e))], dtype=np.float64)
    values = np.concatenate([values, -values[::2]])      # cancellation
    try:
        want = reference(values)
    except OverflowError:
        return
    assert same(fsum(values), want)
