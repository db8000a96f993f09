"""The logit lens's math and its checks on hand-built tensors (pipeline/model/lens.py, pipeline/checks/lens.py)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from pipeline.checks import lens as checks
from pipeline.errors import UserError
from pipeline.model import lens


def test_layer_0_is_the_residual_input_and_layer_i_the_output_of_block_i_minus_1():
    assert lens.residual_names(3) == ["blocks.0.resid_pre", "blocks.0.resid_post", "blocks.1.resid_post",
                                      "blocks.2.resid_post"]


def test_top_ids_rank_ties_by_lower_id():
    z = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 0.5], dtype=torch.float64)
    assert lens.top_ids(z, 4).tolist() == [1, 3, 2, 4]
    assert lens.top_ids(z, 1).tolist() == [1]
    assert [lens.rank_of(z, i) for i in range(6)] == [5, 1, 3, 2, 4, 6]


def test_position_lens_by_hand():
    row = torch.tensor([0.0, 1.0, 2.0, 2.0], dtype=torch.bfloat16)
    final = torch.tensor([3.0, 0.0, 0.0, 0.0], dtype=torch.bfloat16)
    one = lens.position_lens(row, final, 2)
    z = np.array([0.0, 1.0, 2.0, 2.0])
    q = np.exp(z) / np.exp(z).sum()
    p = np.exp([3.0, 0, 0, 0]) / np.exp([3.0, 0, 0, 0]).sum()
    assert one.ids == [2, 3] and one.logits == [2.0, 2.0]
    assert one.probs == pytest.approx(q[[2, 3]], rel=1e-15)
    assert one.entropy == pytest.approx(-(q * np.log(q)).sum(), rel=1e-14)
    assert one.final_top1_id == 0 and one.final_top1_rank == 4 and one.final_top1_prob == pytest.approx(q[0])
    assert one.kl_final == pytest.approx((p * (np.log(p) - np.log(q))).sum(), rel=1e-13)
    assert row.tolist() == [0.0, 1.0, 2.0, 2.0]                 # its input unchanged


def test_kl_is_exactly_zero_for_the_same_row_and_entropy_of_uniform_is_ln_v():
    row = torch.randn(1000, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert lens.position_lens(row, row.clone(), 5).kl_final == 0.0
    flat = lens.position_lens(torch.zeros(64, dtype=torch.bfloat16), row[:64], 3)
    assert flat.entropy == pytest.approx(math.log(64), rel=1e-15) and flat.ids == [0, 1, 2]


class _Toy(nn.Module):
    """A two-layer 'model' with the llama paths: model.norm (LayerNorm here) and lm_head."""

    def __init__(self, h: int = 8, v: int = 50):
        super().__init__()
        torch.manual_seed(0)
        self.config = type("C", (), {"model_type": "llama", "get_text_config": lambda self: self})()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Identity(), nn.Identity()])
        self.model.norm = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, v, bias=False)


def test_run_streams_every_layer_through_the_models_own_norm_and_head():
    model = _Toy()
    x = [torch.randn(1, 3, 8) * (i + 1) for i in range(3)]
    tensors = {"blocks.0.resid_pre": x[0], "blocks.0.resid_post": x[1], "blocks.1.resid_post": x[2]}
    with torch.no_grad():
        tensors["logits"] = model.lm_head(model.model.norm(x[2]))
    table, summary = lens.run(model, tensors, [0, 1, 2], top_k=4)
    assert table.num_rows == 3 * 3 * 4 and summary.num_rows == 9
    t = table.to_pandas()
    with torch.no_grad():
        own = model.lm_head(model.model.norm(x[1]))[0, 2]       # layer 1, position 2
    got = t[(t.layer == 1) & (t.position == 2)]
    assert got.token_id.tolist() == torch.argsort(own, descending=True, stable=True)[:4].tolist()
    assert got.logit.tolist() == own[got.token_id.tolist()].tolist()
    s = summary.to_pandas()
    assert (s[s.layer == 2].kl_final == 0).all() and (s[s.layer == 2].final_top1_rank == 1).all()
    assert (s[s.layer < 2].kl_final > 0).all()


def test_top_k_above_the_output_size_is_one_line():
    with pytest.raises(UserError, match=r"^lens.top_k=11 is not allowed: an integer in \[1, 10\]"):
        lens.check_top_k(11, 10)
    lens.check_top_k(10, 10)


# ---------------------------------------------------------------- the checks' numpy side
@pytest.mark.parametrize("formula", ["rms", "rms_plus_one", "layer"])
def test_numpy_norms_are_the_formulas(formula):
    x = np.random.default_rng(0).normal(size=(3, 16)) * 4
    w, b = np.linspace(0.5, 1.5, 16), np.linspace(-0.1, 0.1, 16)
    got = checks.normed64(x, formula, 1e-5, w, b if formula == "layer" else None)
    if formula == "layer":
        ln = nn.LayerNorm(16, eps=1e-5).double()
        with torch.no_grad():
            ln.weight.copy_(torch.from_numpy(w))
            ln.bias.copy_(torch.from_numpy(b))
            want = ln(torch.from_numpy(x)).numpy()
    else:
        scale = 1.0 / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5)
        want = x * scale * (w if formula == "rms" else 1 + w)
    np.testing.assert_allclose(got, want, rtol=1e-13)
    with pytest.raises(ValueError):
        checks.normed64(x, "rms2", 1e-5, w, None)


def test_sampled_points_hold_first_middle_last_and_layer_0_and_l():
    assert checks.sampled(2, list(range(25))) == ([0, 1, 2], [0, 12, 24])
    assert checks.sampled(18, [7]) == ([0, 6, 12, 18], [7])


class _Weights:
    def __init__(self, w):
        self.w = w

    def row_chunks(self, name):
        yield from ((i, self.w[i:i + 3]) for i in range(0, len(self.w), 3))


def test_numpy_logits_scale_then_softcap():
    h = np.array([[1.0, -2.0]])
    w = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, -3.0], [10.0, -10.0]])
    z_in, z, s = checks.numpy_logits(h, _Weights(w), "lm_head.weight", None, 2.0, 5.0)
    np.testing.assert_allclose(z_in, [[-0.5, 1.0, 3.0, 15.0]])
    np.testing.assert_allclose(z, 5.0 * np.tanh(z_in / 5.0))
    np.testing.assert_allclose(s, [[1.5, 1.0, 3.0, 15.0]])


def _lens_file(tmp_path, logits: torch.Tensor, change=None):
    """lens.parquet of a 1-layer toy whose every layer is the final logits (what the stage writes there)."""
    tensors = {"logits": logits}
    rows = {n: [] for n in lens.LENS_SCHEMA.names}
    for layer in (0, 1):
        for r in range(logits.shape[1]):
            one = lens.position_lens(logits[0, r], logits[0, r], 3)
            for k, v in (("layer", [layer] * 3), ("position", [r] * 3), ("rank", [1, 2, 3]), ("token_id", one.ids),
                         ("logit", one.logits), ("prob", one.probs)):
                rows[k].extend(v)
    if change:
        change(rows)
    import pyarrow as pa
    path = tmp_path / "lens.parquet"
    pq.write_table(pa.table(rows, schema=lens.LENS_SCHEMA), path)
    return path, tensors


def test_final_layer_check_passes_on_the_logits_and_fails_on_one_changed_logit_or_a_missing_pair(tmp_path):
    logits = torch.randn(1, 2, 40, generator=torch.Generator().manual_seed(1)).bfloat16()
    path, t = _lens_file(tmp_path, logits)
    assert checks.final_layer(path, t["logits"], [0, 1], 1).passed

    def bump(rows):
        rows["logit"][-1] += 2.0 ** -7
    path, t = _lens_file(tmp_path, logits, bump)
    c = checks.final_layer(path, t["logits"], [0, 1], 1)
    assert not c.passed and "position 1" in c.detail

    def drop(rows):
        for v in rows.values():
            del v[-3:]
    path, t = _lens_file(tmp_path, logits, drop)
    assert not checks.final_layer(path, t["logits"], [0, 1], 1).passed


def test_snapshot_weights_are_found_by_value_whatever_the_checkpoint_calls_them(tmp_path):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(2)
    head, embed, norm = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g), torch.rand(4, generator=g)
    save_file({"embed_out.weight": head, "gpt_neox.embed_in.weight": embed, "gpt_neox.final_layer_norm.weight": norm},
              str(tmp_path / "model.safetensors"))
    weights = checks.SnapshotWeights(tmp_path)
    assert weights.key_of("lm_head.weight", head.bfloat16()) == "embed_out.weight"       # GPT-NeoX's saved name
    assert weights.key_of("gpt_neox.embed_in.weight", embed.bfloat16()) == "gpt_neox.embed_in.weight"
    assert weights.key_of("lm_head.weight", torch.zeros(6, 4)) is None                    # nothing holds it
    np.testing.assert_array_equal(weights.read("embed_out.weight"), head.double().numpy())
    rows = np.concatenate([w for _, w in weights.row_chunks("embed_out.weight")])
    np.testing.assert_array_equal(rows, head.double().numpy())


def test_final_layer_kl_check_fails_on_a_nonzero_or_missing_kl(tmp_path):
    import pyarrow as pa

    def summary(kl: list[float], positions: list[int]):
        n = len(kl)
        t = pa.table({"layer": [1] * n, "position": positions, "entropy": [1.0] * n, "final_top1_id": [0] * n,
                      "final_top1_rank": [1] * n, "final_top1_prob": [0.5] * n, "kl_final": kl},
                     schema=lens.SUMMARY_SCHEMA)
        pq.write_table(t, tmp_path / "s.parquet")
        return checks.final_layer_kl(tmp_path / "s.parquet", [0, 1], 1)
    assert summary([0.0, 0.0], [0, 1]).passed
    assert summary([0.0, 1e-300], [0, 1]).measured == 1e-300
    assert not summary([0.0], [0]).passed


def test_a_stored_probability_that_underflowed_to_zero_is_judged_by_numpy_s_ln_p():
    """gemma3_270m's embeddings layer gives the final top-1 id p = exp(-900) = 0.0 in FP64: exact when numpy's
    ln p underflows too (was a math domain error that stopped the checks stage), infinitely off when not."""
    from pipeline.checks.lens import _ln_diff
    assert _ln_diff(np.array([0.0]), np.array([-900.0])).tolist() == [0.0]
    assert _ln_diff(np.array([0.0]), np.array([-20.0])).tolist() == [float("inf")]
    assert _ln_diff(np.array([np.exp(-2.0)]), np.array([-2.5])).tolist() == pytest.approx([0.5])


def test_numpy_kl_stays_finite_where_a_layer_s_probabilities_underflow():
    """A far layer can give the final top-1 id ln p = -900: p is 0.0 in FP64 but KL(final || layer) is finite;
    numpy's side takes ln p as a log-softmax (ln of the underflowed p gave inf and failed gemma3_270m)."""
    from pipeline.checks.lens import _log_softmax64
    row = np.array([0.0, -900.0, 5.0])
    ln = _log_softmax64(row)
    assert np.isfinite(ln).all() and ln[1] == pytest.approx(-905.0 - math.log1p(math.exp(-5.0)), rel=1e-12)
    assert math.fsum(np.exp(ln).tolist()) == pytest.approx(1.0, rel=1e-15)


def test_a_kept_final_row_gives_the_same_figures_bit_for_bit():
    """`run` computes a position's final-row softmax once for all its layers: the figures are those of
    computing it per layer (a dataclass equality of Python floats and ints: the same bits)."""
    g = torch.Generator().manual_seed(7)
    row, final = (torch.randn(4096, generator=g) * 3).to(torch.bfloat16), (torch.randn(4096, generator=g) * 3).to(
        torch.bfloat16)
    kept = lens.FinalRow.of(final)
    assert lens.position_lens(row, final, 5, kept) == lens.position_lens(row, final, 5)
    zf = final.to(torch.float64)                     # FinalRow itself against the computation it replaced
    logp = torch.log_softmax(zf, -1)
    assert torch.equal(kept.logp, logp) and torch.equal(kept.p, torch.exp(logp))
    assert kept.top1 == int(np.argmax(zf.numpy()))   # numpy's argmax: the first of the maxima
    other = lens.FinalRow.of(final.roll(1))
    assert lens.position_lens(row, final, 5, other) != lens.position_lens(row, final, 5)
