"""The step-1 logits check on hand-built rows: its detail states the value that decided the verdict (issue 50:
`step1_logits_greedy: 0.750732 > 0` read "max abs diff 0", the distance to another row)."""

from __future__ import annotations

import numpy as np

from pipeline.checks.trajectory import step1_logits

LM_HEAD = np.array([1.0, -2.0, 3.5, 0.25], np.float32)      # lm_head on the captured input, one row


def _check(step1: np.ndarray, forward: np.ndarray):
    (check,) = step1_logits({("greedy", False, 1): step1}, LM_HEAD, forward, "error")
    return check


def test_a_failed_verdict_reads_its_own_measured_difference_not_the_forward_rows():
    step1 = LM_HEAD.copy()
    step1[2] += 0.75                                   # the stored step 1 differs from lm_head at id 2
    check = _check(step1, forward=step1.copy())        # ... and equals the forward's row: that distance is 0
    assert check.name == "step1_logits_greedy" and not check.passed and check.measured == 0.75
    head, _, other = check.detail.partition("; ")
    assert head == "vs lm_head one row: max abs diff 0.75 at id 2 (step 1 4.25, lm_head 3.5)", check.detail
    assert other == "vs the forward's logits row: max abs diff 0"


def test_a_passing_check_says_0_and_the_forward_distance_apart():
    forward = LM_HEAD.copy()
    forward[0] += 0.5
    check = _check(LM_HEAD.copy(), forward)
    assert check.passed and check.measured == 0
    assert check.detail == "vs lm_head one row: max abs diff 0; vs the forward's logits row: max abs diff 0.5"


def test_a_missing_step_row_fails_and_says_why():
    check = _check(np.empty(0, np.float32), LM_HEAD.copy())
    assert not check.passed and check.measured == float("inf")
    assert check.detail.startswith("vs lm_head one row: max abs diff inf (step-1 row of 0 values, lm_head row of 4)")


def test_nan_on_one_side_is_the_worst_place():
    step1 = LM_HEAD.copy()
    step1[1], step1[3] = np.nan, LM_HEAD[3] + 0.1
    check = _check(step1, LM_HEAD.copy())
    assert not check.passed and "max abs diff inf at id 1 (step 1 nan, lm_head -2)" in check.detail
