"""pipeline.model.logit_parts and pipeline.numerics.logit_parts: each candidate's logit as a sum of
the residual stream's parts, on tiny_qwen2 (the conf's own architecture and seed) and the toys of
the other families.

tiny_qwen2's norms are initialised at 1, where forgetting the final norm's weight changes nothing:
the tests that need the gain to count set the norms to seeded values first (`_norms_count`).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from pipeline.model import logit_parts as parts
from pipeline.model import tiny
from pipeline.model.families import TINY_FAMILIES
from pipeline.numerics import logit_parts as lp
from pipeline.numerics import parts_table
from tests.helpers import conf

EOS = 151643
T, K = 10, 5


def _tiny_qwen2_source() -> dict:
    return conf.option("model", "tiny_qwen2")["source"]


def _arch() -> dict:
    return dict(_tiny_qwen2_source()["architecture"])


def _norms_count(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(p + torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(p.dtype) * 0.3)
    return model


@functools.cache
def _model(family: str, dtype: torch.dtype, norms: bool = True):
    """Built once per module run and only read after (the mutants patch the fold, never the model)."""
    src = _tiny_qwen2_source()
    model = tiny.build_family(family, _arch(), src["seed"], EOS).to(dtype).eval()
    return _norms_count(model) if norms else model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 150000, (1, T), generator=torch.Generator().manual_seed(3))


def _table(model, ids, positions=(T - 1,)):
    rec = parts.record_parts(model, ids, list(positions))
    return rec, parts.logit_parts(rec, {p: parts.top_candidates(rec, p, K) for p in positions})


# ---------------------------------------------------------------- an independent recomputation in numpy

def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _numpy_qwen2(model, ids: np.ndarray):
    """The Qwen2 forward written out in FP64 numpy from the weights alone: (parts {name: [T, H]}, stream)."""
    cfg = model.config
    W = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    nh, nkv, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    hd, eps = H // nh, cfg.rms_norm_eps
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(len(ids))[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):                                                    # [T, n, hd]
        half = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos[:, None] + half * sin[:, None]
    x = W["model.embed_tokens.weight"][ids]
    out = {"embed": x.copy()}
    causal = np.tril(np.ones((len(ids), len(ids)), bool))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, W[p + "input_layernorm.weight"], eps)
        proj = {n: h @ W[p + f"self_attn.{n}_proj.weight"].T + W[p + f"self_attn.{n}_proj.bias"] for n in "qkv"}
        q = rope(proj["q"].reshape(-1, nh, hd))
        k, v = rope(proj["k"].reshape(-1, nkv, hd)), proj["v"].reshape(-1, nkv, hd)
        attn = np.zeros_like(x)
        for head in range(nh):
            kv = head // (nh // nkv)
            s = np.where(causal, q[:, head] @ k[:, kv].T / np.sqrt(hd), -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            z = (a / a.sum(-1, keepdims=True)) @ v[:, kv]
            out[f"blocks.{i}.attn.head{head}"] = z @ W[p + "self_attn.o_proj.weight"][:, head * hd:(head + 1) * hd].T
            attn += out[f"blocks.{i}.attn.head{head}"]
        x = x + attn
        h = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        out[f"blocks.{i}.mlp"] = (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T
        x = x + out[f"blocks.{i}.mlp"]
    return out, x, W


def test_numpy_recomputation_gives_the_same_contributions(ids):
    """tiny_qwen2 in float32 against its forward written out in FP64 numpy: every part's contribution
    to each of the top-5 logits at the last position, through the norm frozen at numpy's own scale."""
    model = _model("qwen2", torch.float32)
    rec, table = _table(model, ids)
    ref, stream, W = _numpy_qwen2(model, ids[0].numpy())
    x = stream[T - 1]
    scale = np.sqrt((x * x).mean() + model.config.rms_norm_eps)
    tokens = table["token_id"].unique()
    expected = {name: (v[T - 1] / scale * W["model.norm.weight"]) @ W["lm_head.weight"][tokens].T
                for name, v in ref.items()}
    got = table.pivot(index="component", columns="token_id", values="contribution")[tokens]
    assert set(got.index) == set(expected)
    size = max(np.abs(e).max() for e in expected.values())
    # float32 forward vs FP64: agreement to a few thousand float32 ulps of the largest part; a part
    # put on the wrong head, layer or token is off by the size of a part
    for name, want in expected.items():
        np.testing.assert_allclose(got.loc[name].to_numpy(), want, rtol=0, atol=2 ** -12 * size, err_msg=name)
    # and the parts add up to the model's own logits
    total = table.groupby("token_id")["contribution"].sum()[tokens].to_numpy()
    np.testing.assert_allclose(total, rec.logits[0, tokens].double().numpy(), rtol=0, atol=2 ** -12 * size)


# ---------------------------------------------------------------- the checks, on every family the split applies to

APPLICABLE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
              "smollm3", "olmo2")


@pytest.mark.parametrize("family,dtype", [(f, torch.bfloat16) for f in APPLICABLE]
                         + [("qwen2", torch.float32), ("gemma3_text", torch.float32)],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_parts_add_up_within_the_dtype_bound(family, dtype, ids):
    model = _model(family, dtype)
    rec, table = _table(model, ids, positions=(3, T - 1))
    assert parts.residual_check(rec).passed, parts.residual_check(rec)
    check = lp.sum_check(table)
    assert check.passed, check
    assert check.bound < table["logit"].abs().max()      # not vacuous (the mutants below show it discriminates)
    n_heads, n_layers = model.config.num_attention_heads, model.config.num_hidden_layers
    last = table[table.position == T - 1]
    one = last[last.token_id == last.token_id.iloc[0]]
    assert one["component"].iloc[0] == "embed"
    assert (one["head"].notna()).sum() == n_heads * n_layers
    assert sorted(one["layer"].dropna().unique()) == list(range(n_layers))
    assert table["contribution"].dtype == np.float64
    # the top candidates are the model's own: highest recorded logit first
    firsts = table.groupby(["position", "token_id"], sort=False)["logit"].first()
    for _, logits in firsts.groupby(level=0, sort=False):
        assert list(logits) == sorted(logits, reverse=True)


def test_gemma2_softcap_is_a_part_of_its_own(ids):
    model = _model("gemma2", torch.float32)          # the toy's final softcap is 5.0 (pipeline/model/tiny.py)
    _, table = _table(model, ids)
    cap = table[table.component == "softcap"]
    assert len(cap) == K and (cap["contribution"] != 0).all()
    assert lp.sum_check(table).passed


@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if f in ("gpt2", "granite", "phi3", "gpt_neox",
                                                                      "starcoder2", "cohere")])
def test_other_families_are_refused_in_one_line(family, ids):
    model = _model(family, torch.float32, norms=False)
    reason = parts.applicability(model)
    assert reason.startswith("not applicable: ") and family in reason and "\n" not in reason
    with pytest.raises(parts.NotApplicable, match=f"^not applicable: model_type '{family}'"):
        parts.record_parts(model, ids, [T - 1])


def test_bad_positions_are_named(ids):
    model = _model("qwen2", torch.float32, norms=False)
    with pytest.raises(ValueError, match=rf"positions \[{T}\]: each must be in \[0, {T - 1}\]"):
        parts.record_parts(model, ids, [T])
    rec = parts.record_parts(model, ids, [T - 1])
    with pytest.raises(ValueError, match="position 2 was not recorded"):
        parts.logit_parts(rec, {2: [0]})


# ---------------------------------------------------------------- mutants of the fold fail the sum check

def _no_gain(parts_, scale, gain, rows):           # forgets the final norm's weight
    return parts_ / scale @ rows.double().T


def _unfrozen(parts_, scale, gain, rows):          # each part normalised by its own rms, not the stream's
    own = torch.sqrt((parts_ * parts_).mean(-1, keepdim=True) + 1e-6)
    return parts_ / own * gain @ rows.double().T


@pytest.mark.parametrize("mutant", [_no_gain, _unfrozen], ids=["no_weight", "unfrozen_scale"])
@pytest.mark.parametrize("family,dtype", [("qwen2", torch.float32), ("qwen2", torch.bfloat16),
                                          ("gemma3_text", torch.bfloat16)], ids=lambda v: str(v).removeprefix("torch."))
def test_mutants_fail_the_sum_check(mutant, family, dtype, ids, monkeypatch):
    model = _model(family, dtype)
    rec, table = _table(model, ids)
    assert lp.sum_check(table).passed
    monkeypatch.setattr(lp, "fold", mutant)
    check = lp.sum_check(parts.logit_parts(rec, {T - 1: table["token_id"].unique().tolist()}))
    assert not check.passed, check
    assert parts.residual_check(rec).passed          # the stream itself is right: the fold is what is wrong


# ---------------------------------------------------------------- what decides the pick

def test_top1_minus_other_differences_add_up_to_the_logit_gap(ids):
    model = _model("qwen2", torch.float32)
    rec, table = _table(model, ids, positions=(4, T - 1))
    diffs = parts_table.top1_differences(table)
    assert len(diffs) == 2 * (K - 1) * table["component"].nunique()
    for (position, token_id), d in diffs.groupby(["position", "token_id"]):
        logits = rec.logits[rec.positions.index(position)].double()
        top1 = int(d["top1_id"].iloc[0])
        assert top1 == int(torch.argmax(logits)) and token_id != top1
        bound = table[(table.position == position) & table.token_id.isin([top1, token_id])]["bound"].unique().sum()
        gap = float(logits[top1] - logits[token_id])
        assert abs(d["difference"].sum() - gap) <= bound + 2 * lp.unit_roundoff(torch.float32) * abs(gap)
        mine = table[(table.position == position) & (table.token_id == top1)].set_index("component")
        other = table[(table.position == position) & (table.token_id == token_id)].set_index("component")
        np.testing.assert_array_equal(d.set_index("component")["difference"],
                                      (mine["contribution"] - other["contribution"])[d["component"]])


# ---------------------------------------------------------------- the hooked pass is the recorded one

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_hooked_pass_reproduces_the_capture_bit_for_bit(dtype, ids):
    from pipeline.model import capture

    src = _tiny_qwen2_source()
    model = _norms_count(tiny.build(_arch(), src["seed"], EOS).to(dtype).eval())
    for cfg in capture._configs(model):
        cfg._attn_implementation = "eager"          # the capture's requirement
    for positions in ("all", "last"):
        tensors = capture.run_capture(model, ids, capture.CaptureSpec((0,), positions))
        rec = parts.record_parts(model, ids, [2, T - 1])
        gap = parts.capture_gap(rec, tensors)
        assert gap.passed and gap.measured == 0.0, gap
    # and it tells another pass apart: the capture of another prompt
    other = capture.run_capture(model, ids.flip(1), capture.CaptureSpec((0,), "all"))
    assert not parts.capture_gap(rec, other).passed


def test_sum_check_names_the_worst_candidate_relative_to_its_bound():
    """Hand-made table: candidate 7's gap is the largest, candidate 8's the worst against its bound."""
    import pandas as pd

    rows = [(7, 1.0, 1.4, 1.0), (7, 0.0, 1.4, 1.0), (8, 2.0, 2.1, 0.05)]
    table = pd.DataFrame(rows, columns=["token_id", "contribution", "logit_fp64", "bound"]).assign(position=3)
    check = lp.sum_check(table)
    assert (check.where, check.measured, check.bound) == ("position 3, token_id 8", pytest.approx(0.1), 0.05)
    assert check.largest == pytest.approx(0.4) and not check.passed
    assert lp.sum_check(table[table.token_id == 7]).passed
