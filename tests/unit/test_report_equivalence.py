"""The report's equivalence table: one row per variation, a variation that could not run says why."""

from __future__ import annotations

import math

from pipeline.report import equivalence

ROW = {"variation": "sdpa", "compared": "logits at the prompt positions", "n_positions": 25, "max_abs_diff": 0.125,
       "mean_abs_diff": 0.0144, "top1_changed": [3, 7], "kept_recorded": 438, "kept_variant": 439,
       "kept_jaccard": 0.9708, "kl_mean": 5.7e-4, "kl_max": 2.3e-3, "bit_identical": False,
       "first_differing_tensor": "blocks.1.resid_pre", "note": ""}


def test_the_table_shows_each_figure():
    text = equivalence.markdown([ROW], "q")
    line = next(x for x in text.splitlines() if x.startswith("| `sdpa`"))
    assert "| 0.125 |" in line and "| 3, 7 |" in line and "438 → 439" in line and "`blocks.1.resid_pre`" in line
    assert "**no**" in line
    assert "artifacts/equivalence/equivalence/prompt_id=q/equivalence.parquet" in text


def test_a_variation_not_run_says_why_and_no_matrix_no_section():
    gone = {**ROW, "variation": "kernels", "max_abs_diff": math.nan, "note": "capture.kernels=portable could not run"}
    line = next(x for x in equivalence.markdown([gone], "q").splitlines() if x.startswith("| `kernels`"))
    assert "not run: capture.kernels=portable could not run" in line
    assert equivalence.markdown(None, "q") == ""
