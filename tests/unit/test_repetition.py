"""pipeline.numerics.repetition: the loop a sequence ends in, its verifier, distinct n-gram ratios.

The finder is compared with a brute-force reference written here from the definitions (every
(period, start) pair tried, element by element) on many random and structured sequences, and
its every answer is checked by `is_loop` (or `has_no_loop`), the library's independent verifier.
"""

from __future__ import annotations

import random

import pytest

from pipeline.numerics.repetition import Loop, distinct_ratio, find_loop, has_no_loop, is_loop

A, B, C, X, Y = 11, 12, 13, 21, 22


def brute_force(ids: list[int]) -> tuple[int, int] | None:
    """(start, period) by the definitions: the smallest p with a tail of >= 2 full periods that is
    p-periodic element by element, then the earliest start of a p-periodic tail."""
    n = len(ids)

    def periodic(s: int, p: int) -> bool:
        return all(ids[i] == ids[i + p] for i in range(s - 1, n - p))
    for p in range(1, n + 1):
        starts = [s for s in range(1, n + 1) if n - (s - 1) >= 2 * p and periodic(s, p)]
        if starts:
            return min(starts), p
    return None


def sequences(seed: int = 20261201, count: int = 3000):
    """Random sequences over small alphabets (repeats are common), and structured ones: a random
    head, then a random block repeated a random (possibly fractional) number of times."""
    rng = random.Random(seed)
    for _ in range(count):
        yield [rng.randrange(rng.choice((2, 3, 5))) for _ in range(rng.randrange(0, 14))]
        block = [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
        head = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        yield head + (block * 5)[:rng.randrange(0, 5 * len(block) + 1)]


def test_the_gemma_list_loop_has_period_2_from_step_4():
    # "\n1. 1. 1." as ids: a, b, c, then "1", "." alternating
    assert find_loop([A, B, C, X, Y, X, Y, X, Y]) == Loop(start=4, period=2)
    assert is_loop([A, B, C, X, Y, X, Y, X, Y], 4, 2)


@pytest.mark.parametrize(("ids", "want"), [
    ([], None),
    ([A], None),
    ([A, B], None),
    ([A, B, C], None),                                   # no loop
    ([A, A], Loop(1, 1)),                                # one token twice: two full periods of 1
    ([A, B, X, X], Loop(3, 1)),                          # ... judged by the same rule at the end
    ([A, B, A, B], Loop(1, 2)),                          # the whole sequence periodic
    ([A, B, C, A, B, C, A], Loop(1, 3)),                 # whole, with a partial last period
    ([X, A, B, C, A, B], None),                          # period 3 > half of the tail: one period and a bit
    ([A, B, C, A, B, C, C], Loop(6, 1)),                 # the smallest period wins, at the very end
    ([X, A, B, A, B, A], Loop(2, 2)),                    # the loop starts where the tail becomes periodic
    ([B, A, B, A, B, A], Loop(1, 2)),
])
def test_loops_and_edge_cases(ids, want):
    got = find_loop(ids)
    assert got == want
    assert (is_loop(ids, got.start, got.period) if got else has_no_loop(ids))
    assert (brute_force(ids) == (got.start, got.period)) if got else brute_force(ids) is None


def test_the_finder_agrees_with_brute_force_and_the_verifier_on_many_sequences():
    n_loops = 0
    for ids in sequences():
        got, want = find_loop(ids), brute_force(ids)
        assert (None if got is None else (got.start, got.period)) == want, ids
        assert is_loop(ids, got.start, got.period) if got else has_no_loop(ids), ids
        n_loops += got is not None
    assert 1000 < n_loops < 5000          # both outcomes are well represented among the 6000


@pytest.mark.parametrize(("start", "period", "why"), [
    (5, 2, "not from the earliest start"),
    (3, 2, "not periodic from there"),
    (4, 4, "not the smallest period"),
    (4, 1, "not periodic with that period"),
    (8, 1, "fewer than two full periods"),
    (0, 2, "steps count from 1"),
    (4, 0, "no period 0"),
])
def test_the_verifier_refuses_wrong_claims(start, period, why):
    assert not is_loop([A, B, C, X, Y, X, Y, X, Y], start, period), why


def test_the_verifier_refuses_a_period_that_is_not_the_smallest():
    ids = [A, X, Y, X, Y, X, Y, X, Y]       # from step 2: periodic with 4 (two full periods), and with 2
    assert is_loop(ids, 2, 2) and not is_loop(ids, 2, 4)


def test_has_no_loop_refuses_a_sequence_with_a_loop():
    assert has_no_loop([A, B, C]) and not has_no_loop([A, B, C, C]) and not has_no_loop([A, B, A, B])


def test_distinct_ngram_ratios():
    ids = [A, B, C, X, Y, X, Y, X, Y]
    assert distinct_ratio(ids, 1) == 5 / 9
    assert distinct_ratio(ids, 2) == 5 / 8          # ab bc cX XY YX (XY YX XY YX repeat)
    assert distinct_ratio(ids, 3) == 5 / 7          # abc bcX cXY XYX YXY
    assert distinct_ratio([A, B, C], 2) == 1.0 and distinct_ratio([X] * 4, 1) == 0.25
    assert distinct_ratio([A], 2) is None and distinct_ratio([], 1) is None     # no n-gram: no ratio
    assert distinct_ratio([A, B], 2) == 1.0
    with pytest.raises(ValueError):
        distinct_ratio(ids, 0)
