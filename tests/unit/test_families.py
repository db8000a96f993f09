"""Every family of `families.TINY_FAMILIES` on its seeded toy: golden capture names, every
recompute exact in bf16, and each check failing where a piece of the family's arithmetic is
left out (Granite's multipliers, GPT-NeoX's parallel sum, GPT-2's position embeddings, OLMo 2's
norm placement). `support` decides from config.json alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.checks import recompute
from pipeline.errors import UserError
from pipeline.model import capture, families, tiny
from pipeline.model.families import FAMILIES, TINY_FAMILIES, support

ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, lm_head_std=0.5)
EOS = 151643
SPEC = capture.CaptureSpec((0, -1), "all")

def _n(text: str) -> list[str]:
    return text.split()


GOLDEN = {
    "llama": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "mistral": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "qwen2": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "qwen3": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_norm_out blocks.0.attn.k_norm_out blocks.0.attn.q_rot blocks.0.attn.k_rot "
        "blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z blocks.0.attn_out blocks.0.resid_mid "
        "blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre blocks.1.attn_weights blocks.1.attn_out "
        "blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post final_norm_out logits"
    ),
    "mixtral": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "qwen3_moe": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_norm_out blocks.0.attn.k_norm_out blocks.0.attn.q_rot blocks.0.attn.k_rot "
        "blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z blocks.0.attn_out blocks.0.resid_mid "
        "blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre blocks.1.attn_weights blocks.1.attn_out "
        "blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post final_norm_out logits"
    ),
    "gemma": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "gemma2": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "gemma3_text": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_norm_out blocks.0.attn.k_norm_out blocks.0.attn.q_rot blocks.0.attn.k_rot "
        "blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z blocks.0.attn_out blocks.0.resid_mid "
        "blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre blocks.1.attn_weights blocks.1.attn_out "
        "blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post final_norm_out logits"
    ),
    "phi3": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.qkv blocks.0.attn.q_rot blocks.0.attn.k_rot "
        "blocks.0.attn.value blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z blocks.0.attn_out "
        "blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre blocks.1.attn_weights "
        "blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post final_norm_out logits"
    ),
    "gpt2": _n(
        "embed pos_embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.qkv blocks.0.attn.q_rot "
        "blocks.0.attn.k_rot blocks.0.attn.value blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "gpt_neox": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.qkv blocks.0.attn.q_rot blocks.0.attn.k_rot "
        "blocks.0.attn.value blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z blocks.0.attn_out "
        "blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre blocks.1.attn_weights blocks.1.attn_out "
        "blocks.1.mlp_out blocks.1.resid_post final_norm_out logits"
    ),
    "olmo2": _n(
        "embed blocks.0.resid_pre blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v blocks.0.attn.q_norm_out "
        "blocks.0.attn.k_norm_out blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask "
        "blocks.0.attn_weights blocks.0.attn.z blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out "
        "blocks.0.resid_post blocks.1.resid_pre blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid "
        "blocks.1.mlp_out blocks.1.resid_post final_norm_out logits"
    ),
    "granite": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "smollm3": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    "starcoder2": _n(
        "embed blocks.0.resid_pre blocks.0.ln1_out blocks.0.attn.q blocks.0.attn.k blocks.0.attn.v "
        "blocks.0.attn.q_rot blocks.0.attn.k_rot blocks.0.attn.mask blocks.0.attn_weights blocks.0.attn.z "
        "blocks.0.attn_out blocks.0.resid_mid blocks.0.mlp_out blocks.0.resid_post blocks.1.resid_pre "
        "blocks.1.attn_weights blocks.1.attn_out blocks.1.resid_mid blocks.1.mlp_out blocks.1.resid_post "
        "final_norm_out logits"
    ),
    **{generic: _n(
        "embed blocks.0.resid_pre blocks.0.resid_post blocks.1.resid_pre blocks.1.resid_post final_norm_out "
        "logits"
    ) for generic in families.GENERIC_TESTED},
}


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def run(request):
    """(family, bf16 model with non-trivial norms, its capture of a 12-token prompt)."""
    model = tiny.build_family(request.param, ARCH, 20261002, EOS).to(torch.bfloat16)
    for cfg in capture._configs(model):
        cfg._attn_implementation = "eager"
    with torch.no_grad():       # norms init at 1 (or 0 for Gemma's 1 + w): make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(7))
    ids = torch.randint(0, 150000, (1, 12), generator=torch.Generator().manual_seed(0))
    return request.param, model, capture.run_capture(model, ids, SPEC), ids


def test_at_least_16_families():
    assert len(TINY_FAMILIES) >= 16 and set(GOLDEN) == set(TINY_FAMILIES)


def test_golden_names(run):
    family, model, c, _ = run
    assert list(c) == GOLDEN[family] == capture.capture_names(model, SPEC)


def _corrupt(c: dict, name: str) -> dict:
    bad = dict(c)
    bad[name] = c[name].clone()
    bad[name].view(-1)[3] += 1.0
    return bad


def test_every_recompute_exact_and_sensitive(run):
    family, model, c, ids = run
    assert torch.equal(c["logits"], capture.plain_forward_logits(model, ids, "all"))     # capture is transparent
    assert recompute.lm_head_recompute(model, c["final_norm_out"], c["logits"]) == 0.0
    assert recompute.final_norm_recompute(model, c) == 0.0
    assert recompute.lm_head_recompute(model, _corrupt(c, "final_norm_out")["final_norm_out"], c["logits"]) > 0
    last = model.config.get_text_config().num_hidden_layers - 1
    assert recompute.final_norm_recompute(model, _corrupt(c, f"blocks.{last}.resid_post")) > 0
    attn = recompute.layer0_attention_recompute(model, c)
    adds = [recompute.residual_adds_recompute(model, c, i) for i in range(last + 1)]
    if family in families.GENERIC_TESTED:
        assert attn == {} and adds == [{}, {}]
        return
    assert attn and set(attn.values()) == {0.0}, attn
    assert all(set(d.values()) == {0.0} for d in adds), adds
    assert recompute.layer0_attention_recompute(model, _corrupt(c, "blocks.0.attn.z"))["z"] > 0
    assert recompute.layer0_attention_recompute(model, _corrupt(c, "blocks.0.attn_out"))["attn_out"] > 0
    assert recompute.residual_adds_recompute(model, _corrupt(c, "blocks.0.mlp_out"), 0)["resid_post"] > 0
    assert recompute.residual_adds_recompute(model, _corrupt(c, "embed"), 0)["resid_pre"] > 0


@pytest.mark.parametrize(("family", "piece"), [("granite", "residual_multiplier"), ("granite", "embedding_multiplier"),
                                               ("granite", "logits_scaling"), ("gpt_neox", "parallel_residual"),
                                               ("gpt2", "pos_embed"), ("gemma2", "attn_softcap"),
                                               ("gemma2", "final_softcap")])
def test_leaving_a_piece_out_fails_a_check(family, piece, monkeypatch):
    """A family entry without one of its pieces is a wrong computation: some recompute sees it."""
    model = tiny.build_family(family, ARCH, 20261002, EOS).to(torch.bfloat16)
    for cfg in capture._configs(model):
        cfg._attn_implementation = "eager"
    if piece == "attn_softcap":     # a toy's scores are too small for a cap of 2 to round differently in bf16
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(100.0)
    ids = torch.randint(0, 150000, (1, 12), generator=torch.Generator().manual_seed(0))
    c = capture.run_capture(model, ids, SPEC)
    # (GPT-2's softmax in the compute dtype is not here: the CPU's bf16 softmax computes in float32
    # and rounds once, the same bits as float32-then-cast, so that flag cannot be shown to matter.)
    wrong = replace(FAMILIES[family], **{piece: None})
    if piece == "parallel_residual":
        c = {k: v for k, v in c.items()}        # the serial formula needs resid_mid: compare by hand
        wrong_sum = c["blocks.0.resid_pre"] + c["blocks.0.attn_out"] + c["blocks.0.mlp_out"]
        assert not torch.equal(wrong_sum, c["blocks.0.resid_post"])
        return
    monkeypatch.setitem(FAMILIES, family, wrong)
    figures = [recompute.lm_head_recompute(model, c["final_norm_out"], c["logits"]),
               *recompute.layer0_attention_recompute(model, {k: v for k, v in c.items() if k != "pos_embed"}
                                                     if piece == "pos_embed" else c).values(),
               *(v for i in range(2) for v in recompute.residual_adds_recompute(model, c, i).values())]
    assert max(figures) > 0


@pytest.mark.parametrize(("model_type", "formula", "eps_attr", "scale"), [
    ("cohere", "layer", "layer_norm_eps", "logit_scale"),      # LayerNorm without a bias; logits * logit_scale
    ("stablelm", "layer", "layer_norm_eps", None),             # torch's LayerNorm, with a bias
    ("falcon", "layer", "layer_norm_epsilon", None),
    ("qwen3_5_text", "rms_plus_one", "rms_norm_eps", None),
])
def test_generic_head_read_off_the_model(model_type, formula, eps_attr, scale):
    """A decoder outside the table: the final norm's form and eps, and the head's scale, found on the model
    (no config name listed for it), and the LM-head recompute exact with them and not without the scale."""
    model = tiny.build_family(model_type, ARCH, 20261002, EOS).to(torch.bfloat16)
    for cfg in capture._configs(model):
        cfg._attn_implementation = "eager"
    with torch.no_grad():
        model.get_submodule(capture.find_generic(model).final_norm).weight.normal_(
            0.0, 0.5, generator=torch.Generator().manual_seed(3))
    names = capture.find_generic(model)
    assert (names.norm_formula, names.norm_eps_value, names.logit_scale) == (
        formula, getattr(model.config, eps_attr), scale)
    ids = torch.randint(0, 150000, (1, 12), generator=torch.Generator().manual_seed(0))
    c = capture.run_capture(model, ids, SPEC)
    assert recompute.lm_head_recompute(model, c["final_norm_out"], c["logits"]) == 0.0
    if scale:       # a head that forgets the model's logit scale is a wrong computation the recompute sees
        object.__setattr__(model, "_nexttoken_generic", replace(names, logit_scale=None))
        assert recompute.lm_head_recompute(model, c["final_norm_out"], c["logits"]) > 0


def test_final_norm_form_tells_the_formulas_apart():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    gen = torch.Generator().manual_seed(5)
    rms, plus_one, layer = Qwen2RMSNorm(64, eps=1e-6), GemmaRMSNorm(64, eps=1e-6), torch.nn.LayerNorm(64, eps=1e-5)
    for norm in (rms, plus_one, layer):
        with torch.no_grad():
            for p in norm.parameters():
                p.normal_(0.0, 0.5, generator=gen)
    assert capture.final_norm_form(rms, "t") == ("rms", 1e-6)
    assert capture.final_norm_form(plus_one, "t") == ("rms_plus_one", 1e-6)
    assert capture.final_norm_form(layer, "t") == ("layer", 1e-5)

    class Doubled(Qwen2RMSNorm):        # a norm of no known form is refused, not taken as the nearest
        def forward(self, x):
            return 2 * super().forward(x)
    doubled = Doubled(64)       # (with w = 1 it would be rms_plus_one's 2 * rms: random weights tell them apart)
    with torch.no_grad():
        doubled.weight.normal_(0.0, 0.5, generator=gen)
    with pytest.raises(UserError, match="Doubled matches neither"):
        capture.final_norm_form(doubled, "t")


def test_per_layer_sizes_refused_in_one_line():
    """gemma4_text's config sets head_dim per layer: refused by `support` (the validate stage), before any
    stage runs, instead of a traceback from the forward stage."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("gemma4_text").to_dict()
    with pytest.raises(UserError, match=r"^model_type='gemma4_text' \(g/config.json\) cannot be captured yet: its "
                                        r"config sets head_dim and other sizes per layer"):
        support(cfg, "g/config.json")


def test_support_from_config_json():
    assert support({"model_type": "qwen3"}, "x/config.json").level == "full"
    assert support({"model_type": "llava", "text_config": {"model_type": "llama"}}, "c").model_type == "llama"
    other = support({"model_type": "brand_new_lm", "num_attention_heads": 8, "num_hidden_layers": 4}, "c")
    assert (other.level, other.names.generic) == ("residual", True)
    with pytest.raises(UserError, match=r"^model_type='mamba' \(m/config.json\) cannot be captured: it has no "
                                        r"attention layers"):
        support({"model_type": "mamba", "num_hidden_layers": 4}, "m/config.json")
    with pytest.raises(UserError, match="has no model_type"):
        support({}, "e/config.json")


def test_docs_models_holds_the_family_table():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs/models.md").read_text(encoding="utf-8")
    assert families.markdown_table() in doc, "docs/models.md: paste families.markdown_table() into it"
