"""The report's equivalence table: one row per variation, a variation that could not run says why."""

from __future__ import annotations

import math

from pipeline.numerics import compare
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
    gone = {**ROW, "variation": "kernels", "max_abs_diff": math.nan, "kept_recorded": -1,
            "note": "not applicable: no second kernel path here"}
    line = next(x for x in equivalence.markdown([gone], "q").splitlines() if x.startswith("| `kernels`"))
    assert "| not applicable: no second kernel path here |" in line
    assert equivalence.markdown(None, "q") == ""


def test_a_variation_that_ran_and_gave_nan_says_so_not_that_it_did_not_run():
    """Issue 50: float16 ran and its logits held NaN; the row said "not run: 105 of 105 captured tensors differ"."""
    import torch
    recorded = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, 4.0]])
    variant = recorded.clone()
    variant[1, 2] = math.nan
    ran = {**ROW, "variation": "float16", **compare.compare(recorded, variant, [0, 1]),
           "note": "105 of 105 captured tensors differ"}
    assert math.isnan(ran["max_abs_diff"]) and ran["kept_recorded"] >= 0
    line = next(x for x in equivalence.markdown([ran], "q").splitlines() if x.startswith("| `float16`"))
    assert "not run" not in line and "| NaN (the variant's logits hold NaN) |" in line
    assert "n/a" not in line and "| NaN |" in line        # the mean and KL are NaN too: computed, not missing


def test_the_explorer_embeds_each_variant_in_the_fewest_bytes_that_give_it_back():
    """explorer.variant_encoding: nothing for the record's bits, an earlier variation's bits or all NaN; otherwise
    the smallest of its plain bytes (2 per id for bf16 or float16 values, 4 otherwise) and its Rice-coded difference
    from the record or an earlier row; decoded by the reference decoder (tests/helpers/explorer_ref), every value
    comes back, bit for bit."""
    import numpy as np
    import torch

    from pipeline.report.explorer import equivalence_data, variant_encoding
    from tests.helpers.explorer_ref import decode_logits
    rng = np.random.default_rng(0)
    rec = torch.from_numpy(rng.normal(0, 4, 1000).astype(np.float32)).bfloat16().float().numpy()

    def bf16(x):
        return torch.from_numpy(np.asarray(x, dtype=np.float32)).bfloat16().float().numpy()

    near = rec.copy()                                    # one bf16 step off at a few ids (sdpa, kernels)
    near[::37] = np.nextafter(bf16(near[::37]), np.float32(np.inf))
    near = bf16(near + np.where(np.arange(rec.size) % 37 == 0, np.abs(rec) / 64, 0))
    near[5], near[6] = -0.0, -rec[6]                     # -0 and a sign flip (escaped) come back too
    far = bf16(rng.normal(0, 4, 1000))                   # unrelated to the record: its plain bf16 bytes
    f16 = (rec + 0.001).astype(np.float16).astype(np.float32)
    f16[3] = np.nan
    f32 = rec + np.float32(1e-3)
    earlier = {}
    sizes = {}
    for name, variant, plain in (("near", near, 2), ("far", far, 2), ("f16", f16, 2), ("f32", f32, 4)):
        encoding, data, params = variant_encoding(rec, variant, earlier)
        ref = earlier[params["ref"]] if params.get("ref") is not None else rec
        back = decode_logits(encoding, data, params, ref)
        assert np.array_equal(back.view("<u4"), variant.view("<u4")), name
        assert len(data) <= 4 * variant.size * plain / 3 + 4, name
        sizes[name] = (encoding, len(data))
        earlier[name] = variant
    assert sizes["near"][0] == "rice" and sizes["near"][1] < variant.size / 2     # a few bits an id, not 16
    assert sizes["far"][0] == "bf16"
    assert variant_encoding(rec, rec.copy()) == ("same", None, {})
    assert variant_encoding(rec, near.copy(), {"near": near}) == ("as", None, {"ref": "near"})
    assert variant_encoding(rec, np.full_like(rec, np.nan)) == ("nan", None, {})
    rows = [{**ROW, "kl_last": 1e-4}, {**ROW, "variation": "kv_cache_greedy", "compared": "step logits"},
            {**ROW, "variation": "kernels", "max_abs_diff": math.nan, "kept_recorded": -1, "note": "no AVX2"}]
    panel = equivalence_data(rec, 24, rows, {"sdpa": ("bfloat16", [23, 24], np.stack([rec, near]))}, {})
    sdpa, kv, kernels = panel["variations"]
    assert sdpa["shown"] and sdpa["encoding"] in ("bf16", "rice") and sdpa["row"]["kl_last"] == 1e-4
    assert not kv["shown"] and "step_logits.parquet" in kv["why"]
    assert not kernels["shown"] and kernels["why"] == "not run here: no AVX2" and kernels["row"]["max_abs_diff"] is None
    assert equivalence_data(rec, 24, None, None, {}) is None
