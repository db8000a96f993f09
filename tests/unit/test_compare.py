"""The equivalence matrix's figures (pipeline.numerics.compare) on hand-built logits, with the answers
worked out by hand; each test also shows a plausible wrong computation giving another answer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.checks import equivalence as checks
from pipeline.numerics import compare


def test_jaccard_by_hand_and_not_the_overlap_coefficient():
    a, b = np.array([1, 2, 3, 4]), np.array([3, 4, 5])
    assert compare.jaccard(a, b) == pytest.approx(2 / 5)          # |{3,4}| / |{1,2,3,4,5}|
    overlap = 2 / min(a.size, b.size)                              # a wrong index: |a ∩ b| / min
    assert compare.jaccard(a, b) != pytest.approx(overlap)
    assert compare.jaccard(a, a) == 1.0 and compare.jaccard(a, np.array([9])) == 0.0


def test_kl_by_hand_and_its_direction():
    rec = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)        # p = (1/4, 3/4)
    var = torch.tensor([[0.0, 0.0]])                  # q = (1/2, 1/2)
    want = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert compare.kl_rows(rec, var).item() == pytest.approx(want, rel=1e-15)
    reverse = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)   # KL(variant || recorded): the wrong way round
    assert compare.kl_rows(rec, var).item() != pytest.approx(reverse)
    assert compare.kl_rows(var, rec).item() == pytest.approx(reverse, rel=1e-15)
    assert compare.kl_rows(rec, rec).item() == 0.0


def test_kl_is_computed_in_float64_from_a_bf16_record():
    """Two bf16 rows one ulp apart: their float64 KL is tiny but not zero, where a bf16 softmax rounds it away."""
    rec = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    var = torch.tensor([[1.0, 2.0, 3.0078125]], dtype=torch.float32)   # 3 + 1 bf16 ulp, in float32
    kl = compare.kl_rows(rec, var).item()
    assert 0 < kl < 1e-4
    in_bf16 = torch.softmax(rec, -1) * (torch.log_softmax(rec, -1) - torch.log_softmax(var.bfloat16(), -1))
    assert in_bf16.sum().item() == 0.0     # the wrong precision sees no difference at all


def test_top1_flips_name_the_positions():
    rec = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 5.0]])
    var = torch.tensor([[1.0, 3.0, 0.0], [0.0, 2.0, 1.5], [1.0, 0.0, 4.0]])
    assert compare.top1_changed(rec, var, [10, 11, 12]) == [10]        # position 10: id 0 -> 1
    assert compare.top1_changed(rec, var, [10, 11, 12]) != [0]         # not the row index


def test_top1_ties_go_to_the_lowest_id_on_both_sides():
    rec = torch.tensor([[2.0, 2.0, 0.0]])
    assert compare.top1_changed(rec, rec.clone(), [0]) == []


def test_kept_set_is_transformers_top_p():
    # softmax of (log 5, log 3, log 2) = (0.5, 0.3, 0.2): top-p 0.9 keeps 0.5 + 0.3 (0.8 < 0.9) and 0.2
    row = torch.tensor([[math.log(5.0), math.log(3.0), math.log(2.0)]])
    assert compare.kept_sets(row, 0.9)[0].tolist() == [0, 1, 2]
    assert compare.kept_sets(row, 0.7)[0].tolist() == [0, 1]     # 0.5 < 0.7 <= 0.8
    assert compare.kept_sets(row, 0.5)[0].tolist() == [0]        # the mass reaches p with the first id


def test_compare_figures_on_a_hand_built_pair():
    rec = torch.tensor([[math.log(5.0), math.log(3.0), math.log(2.0)], [2.0, 0.0, 0.0]])
    var = rec.clone()
    var[1, 1] = 2.5                                  # position 1: id 0 -> 1, |Δ| 2.5
    f = compare.compare(rec, var, [3, 4], top_p=0.9)
    assert f["max_abs_diff"] == 2.5 and f["mean_abs_diff"] == pytest.approx(2.5 / 6)
    assert f["top1_changed"] == [4]
    assert (f["kept_recorded"], f["kept_variant"]) == (3, 2)    # last row: (e2, 1, 1) vs (e2, e2.5, 1)
    assert f["kept_jaccard"] == pytest.approx(2 / 3)
    assert f["kl_max"] > 0 and f["kl_mean"] == pytest.approx(f["kl_max"] / 2)
    assert f["bit_identical"] is False
    assert compare.compare(rec, rec.clone(), [3, 4])["bit_identical"] is True


def test_bit_identical_needs_the_same_dtype():
    rec = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    f = compare.compare(rec, rec.float(), [0])
    assert f["max_abs_diff"] == 0.0 and f["bit_identical"] is False


def test_the_check_figures_agree_with_compare_and_catch_a_wrong_one():
    """The check's own numpy figures equal compare's on random logits; a row with one figure wrong fails."""
    g = torch.Generator().manual_seed(0)
    rec = torch.randn(4, 50, generator=g).bfloat16()
    var = rec.float() + 0.05 * torch.randn(4, 50, generator=g)
    stored = compare.compare(rec, var, [0, 1, 2, 3])
    mine = checks.figures(rec, var, [0, 1, 2, 3])
    assert checks.disagreement(stored, mine)[0] <= checks.TOLERANCE
    for key, wrong in (("kl_mean", stored["kl_mean"] * 1.001), ("kept_jaccard", 0.5),
                       ("top1_changed", [9]), ("kept_variant", stored["kept_variant"] + 1)):
        assert checks.disagreement({**stored, key: wrong}, mine)[0] > checks.TOLERANCE, key


def test_left_padding_as_generate_builds_it():
    from pipeline.equivalence.variations import left_padded
    ids, mask, pos = left_padded([[5, 6], [1, 2, 3, 4]], pad_id=0)
    assert ids.tolist() == [[0, 0, 5, 6], [1, 2, 3, 4]]                 # LEFT: the pads come first
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert pos.tolist() == [[1, 1, 0, 1], [0, 1, 2, 3]]                 # the prompt's own positions start at 0
