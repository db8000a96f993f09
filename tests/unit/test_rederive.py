"""pipeline.checks.rederive: the numpy second implementations, on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.checks import rederive
from pipeline.checks.rederive import TOP_P_BAND, kept_rule, ranks, relative_difference, softmax64

INF = np.inf


def test_softmax64_is_exact_to_rounding_and_masks_minus_inf():
    row = np.array([0.0, math.log(3.0), -INF, math.log(4.0)], np.float64)
    assert softmax64(row, 1.0).tolist() == pytest.approx([1 / 8, 3 / 8, 0.0, 4 / 8], rel=1e-15)
    assert softmax64(row, 0.5).tolist() == pytest.approx([1 / 26, 9 / 26, 0.0, 16 / 26], rel=1e-15)
    assert np.isnan(softmax64(np.array([0.0, np.nan]), 1.0)).all()


def test_relative_difference():
    d, at = relative_difference(np.array([1.0, 0.0, 2e-280]), np.array([1.0, 0.0, 1e-280]))
    assert d == pytest.approx(1.0) and at == 2
    # below TINY (1e-290) values compare absolutely: float64 has no relative precision left there
    assert relative_difference(np.array([2e-300]), np.array([1e-300]))[0] == pytest.approx(1e-10)
    assert relative_difference(np.array([1.0 + 1e-10, 0.5]), np.array([1.0, 0.5]))[0] == pytest.approx(1e-10)
    assert relative_difference(np.array([np.nan]), np.array([1.0]))[0] == math.inf
    assert relative_difference(np.array([1.0]), np.array([1.0, 2.0])) == (math.inf, -1)


def test_ranks_descending_ties_by_lower_id():
    assert ranks(np.array([1.0, 3.0, 3.0, 2.0, -INF], np.float32)).tolist() == [4, 1, 2, 3, 5]


def test_top_k_keeps_ties_and_never_a_masked_id():
    rule = kept_rule(np.array([1.0, 3.0, 3.0, 2.0, -INF], np.float32), 1.0, 1, 1.0)
    assert rule.violation(np.array([1, 2])) is None
    assert rule.violation(np.array([1])) is not None                  # a tie with the k-th score is kept
    assert rule.violation(np.array([1, 2, 4])) == "1 kept ids outside the filter"
    assert kept_rule(np.array([1.0, -INF], np.float32), 1.0, 5, 1.0).violation(np.array([0])) is None
    assert rule.violation(np.array([])) == "0 of the 2 tied ids [1, 2]... kept, 2-2 expected"   # nothing kept


def test_top_p_counts_a_tie_at_the_cut_not_its_members():
    # [1, 2, 2, 2, 0]: probabilities ~ [0.105, 0.285, 0.285, 0.285, 0.039]; p = 0.3 needs two of the tie
    rule = kept_rule(np.array([1.0, 2.0, 2.0, 2.0, 0.0], np.float32), 1.0, 0, 0.3)
    for ok in ([2, 3], [1, 2], [1, 3]):
        assert rule.violation(np.array(ok)) is None
    assert rule.violation(np.array([3])) == "1 of the 3 tied ids [1, 2, 3]... kept, 2-2 expected"
    assert rule.violation(np.array([1, 2, 3])) is not None
    assert rule.violation(np.array([2, 3, 0])) is not None


def test_top_p_cut_within_the_float32_band_may_go_either_way():
    # four equal ids: mass above the 2nd is exactly 0.25; p a hair above 0.25 needs two in exact
    # arithmetic, but float32 could decide it either way
    zeros = np.zeros(4, np.float32)
    near = kept_rule(zeros, 1.0, 0, 0.25 + TOP_P_BAND / 2)
    assert near.violation(np.array([3])) is None and near.violation(np.array([2, 3])) is None
    far = kept_rule(zeros, 1.0, 0, 0.25 + 4 * TOP_P_BAND)
    assert far.violation(np.array([3])) is not None and far.violation(np.array([2, 3])) is None


def test_temperature_then_top_p_and_greedy():
    row = np.array([4.0, 3.0, 2.0, 1.0, 0.0], np.float32)
    assert kept_rule(row, 2.0, 0, 0.5).violation(np.array([0, 1])) is None   # [2, 1.5, ...]: 0.429 + 0.260
    assert kept_rule(row, 1.0, 0, 0.5).violation(np.array([0])) is None      # 0.636
    greedy = kept_rule(np.array([3.0, 5.0, 5.0], np.float32), 0.0, 3, 0.9)
    assert greedy.violation(np.array([1])) is None and greedy.violation(np.array([2])) is not None


def test_memoised_derivations_follow_the_rows_content_and_are_read_only():
    """softmax64 and kept_rule remember a row by its bytes: the same content gives the same (shared, read-only)
    result; a row changed in place, or another dtype of the same values, is derived anew."""
    rng = np.random.default_rng(3)
    row = rng.normal(size=1000).astype(np.float32)
    p = rederive.softmax64(row, 0.7)
    assert rederive.softmax64(row.copy(), 0.7) is p and not p.flags.writeable
    with pytest.raises(ValueError):
        p[0] = 1.0                                         # a caller cannot change what others share
    assert rederive.softmax64(row, 1.0) is not p
    row[0] += 5.0                                          # in place: the memo must not serve the old result
    q = rederive.softmax64(row, 0.7)
    x = row.astype(np.float64) / 0.7
    e = np.exp(x - x.max())
    assert np.array_equal(q, e / math.fsum(e.tolist())) and not np.array_equal(q, p)
    assert rederive.softmax64(row.astype(np.float64), 0.7) is not q
    rule = rederive.kept_rule(row, 0.7, 50, 0.9)
    assert rederive.kept_rule(row.copy(), 0.7, 50, 0.9) is rule and not rule.allowed.flags.writeable
    assert rederive.kept_rule(row, 0.7, 40, 0.9) is not rule


def test_a_vocabulary_sized_rule_is_judged_group_by_group_at_once():
    """152k ids, nearly all of them groups of one: each still judged (one id dropped from a top-p set, one id
    repeated, one id outside it), as on a hand-sized row."""
    row = np.random.default_rng(8).normal(0, 3, 152_064).astype(np.float32)
    for top_p in (1.0, 0.9):
        rule = kept_rule(row, 1.0, 0, top_p)
        kept = np.concatenate([ids[:lo] for ids, lo, _ in rule.groups])       # what the filter keeps
        assert rule.violation(kept) is None and len(rule.groups) == np.unique(row).size
        assert (kept.size == row.size) == (top_p == 1.0)
        assert rule.violation(kept[1:]) is not None
        assert rule.violation(np.concatenate([kept, kept[:1]])) == "an id kept twice"
    assert rule.violation(np.concatenate([kept, [-1]])) == "1 kept ids outside the filter"
