"""Every decoder the pinned transformers ships (issue 48), each a 2-layer toy of its own config class
(tests/helpers/zoo.py): the validate stage refuses it in one line from config.json, or the forward capture and
its recomputes pass; each refusal in `families.REFUSED` is shown to be needed (without it the type fails);
a fixed sample runs the whole chain through the stages; `make families` runs the whole chain for all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.model import families
from tests.helpers import zoo

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[2] / "docs/models.md"
# The whole chain in `make test`: decoders outside the family table that test_family_chains does not run, one per
# piece of the generic path they need (a softcap in float32; multi-head latent attention with experts).
SAMPLE = ("beam", "axk1")


def test_the_list_is_the_pinned_transformers_own():
    assert zoo.decoder_types() == zoo.DECODER_TYPES


@pytest.mark.parametrize("model_type", zoo.DECODER_TYPES)
def test_forward_and_checks(model_type):
    got, want = zoo.forward_and_checks(model_type), zoo.expected(model_type)
    assert got["outcome"] == want, got["detail"]
    if want == "refused":       # one line, naming the type and why
        assert "\n" not in got["detail"] and f"model_type={model_type!r}" in got["detail"]
        assert "cannot be captured" in got["detail"]


@pytest.mark.parametrize("model_type", sorted(families.REFUSED))
def test_each_refusal_is_needed(model_type, monkeypatch):
    """Without its entry in REFUSED, the type does not pass: a refusal is a measured fact, not a guess."""
    monkeypatch.setattr(families, "REFUSED", {k: v for k, v in families.REFUSED.items() if k != model_type})
    assert zoo.forward_and_checks(model_type)["outcome"] != "pass"


def test_refusal_names_the_model_type_and_stays_one_line():
    from pipeline.errors import UserError
    with pytest.raises(UserError, match=r"^model_type='openai-gpt' \(d/config.json\) cannot be captured: its layers "
                                        r"normalise after each residual add \(post-LN\)") as e:
        families.support({"model_type": "openai-gpt", "n_head": 12, "n_layer": 12}, "d/config.json")
    assert "\n" not in str(e.value)


def test_head_counts_under_other_names_are_attention():
    """GPT-Neo's num_heads / num_layers and TrOCR-style decoder_* names are read, not taken for 'no attention'."""
    other = families.support({"model_type": "gpt_neo", "num_heads": 16, "num_layers": 24}, "c")
    assert other.level == "residual"


@pytest.mark.parametrize("model_type", SAMPLE)
def test_whole_chain_sample(model_type, tmp_path):
    result = zoo.run_one(model_type, tmp_path)
    assert result["outcome"] == "pass", result


@pytest.mark.parametrize("model_type", ["bamba", "llama"])
def test_kv_cache_steps_equal_generate_s(model_type):
    """The trajectories' KV-cache loop (`decode.run_branch`) gives each step's logits bit for bit as
    `model.generate(use_cache=True)`, greedy and sampled. Bamba's forward does not take the new id's position
    from its cache (position_ids default to 0 there): before the loop passed it as generate does, its steps 2..4
    were up to 0.09 away (the whole chain's generate_logits_*_kv and what_if_generate_logits checks failed)."""
    import torch

    from pipeline.model import decode
    from pipeline.numerics.sampling import SamplingSettings

    model = zoo.build_toy(model_type).eval()
    ids = [1000, 2000, 3000, 4000, 5000, 6000, 7000]
    for settings in (SamplingSettings(temperature=0), SamplingSettings(temperature=1.0)):
        ours = decode.run_branch(model, ids, settings, 4, 0, True, set())
        ref = decode.generate_reference(model, ids, settings, 4, 0, True)
        assert [s.token_id for s in ours] == ref.ids and len(ref.ids) == 4
        assert all(torch.equal(s.logits, r) for s, r in zip(ours, ref.logits, strict=True)), settings


@pytest.mark.skipif(not os.environ.get("NEXTTOKEN_FAMILIES"), reason="make families: the whole chain for every type")
@pytest.mark.parametrize("model_type", zoo.DECODER_TYPES)
def test_whole_chain_every_type(model_type, tmp_path):
    want = zoo.expected(model_type)
    if want == "no toy":
        pytest.skip(f"{model_type}: no toy at these sizes (zoo.NO_TOY)")
    result = zoo.run_one(model_type, tmp_path)
    assert result["outcome"] == want, result


def test_docs_list_every_decoder():
    assert zoo.markdown_outcomes() in DOCS.read_text(encoding="utf-8"), \
        "docs/models.md: paste tests.helpers.zoo.markdown_outcomes() into it"


def test_head_arithmetic_in_float32_is_found_on_the_model():
    """BEAM softcaps its bf16 LM head's output in float32: found by a probe of the model (no config name for it),
    and the LM-head recompute is exact with it and not without it."""
    from dataclasses import replace

    import torch

    from pipeline.checks import recompute
    from pipeline.model import capture

    model = zoo.build_toy("beam").to(torch.bfloat16)
    for cfg in capture._configs(model):
        cfg._attn_implementation = "eager"
    names = capture.find_generic(model)
    assert names.head_fp32 and names.final_softcap == "final_logit_softcapping"
    ids = torch.randint(0, 150000, (1, 12), generator=torch.Generator().manual_seed(0))
    c = capture.run_capture(model, ids, capture.CaptureSpec((0,), "all"))
    assert recompute.lm_head_recompute(model, c["final_norm_out"], c["logits"]) == 0.0
    object.__setattr__(model, "_nexttoken_generic", replace(names, head_fp32=False))
    assert recompute.lm_head_recompute(model, c["final_norm_out"], c["logits"]) > 0


def test_lens_eps_skips_a_null_config_key():
    """Cohere 2 MoE's config.json has rms_norm_eps: null beside layer_norm_eps: the lens takes the norm's own eps."""
    from dataclasses import replace

    from pipeline.checks.lens import final_norm_eps
    names = replace(families.GENERIC, norm_eps_value=1e-5)
    assert final_norm_eps({"rms_norm_eps": None, "layer_norm_eps": 1e-5}, names) == 1e-5
    assert final_norm_eps({"rms_norm_eps": 1e-6}, families.LLAMA_LIKE) == 1e-6


def test_lens_takes_the_head_s_scaling_off_the_model_not_config_json(tmp_path):
    """MiniCPM3 divides its logits by `logits_scaling`, a property its config.json does not hold: the lens
    read config.json's dict and its checks stopped on a KeyError (`make families`); it now reads the model's own
    config, as the capture and the LM-head recompute do."""
    import json

    from transformers import AutoModelForCausalLM

    from pipeline.checks import lens
    from pipeline.model.capture import family
    folder = zoo.save_toy("minicpm3", tmp_path / "minicpm3")
    cfg = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert "logits_scaling" not in cfg and family(model).logits_scaling == "logits_scaling"
    head, problem = lens._head(model, folder, cfg)
    assert problem == "" and head["scaling"] == model.config.logits_scaling == 64 / 256   # hidden / dim_model_base


def test_a_type_whose_toy_does_not_build_is_refused_by_validate_from_its_config(tmp_path):
    """`make families` on a refused type: the validate stage refuses its config.json in one line before any
    stage runs (gemma4_text's toy cannot even be built: its sizes are per layer)."""
    result = zoo.run_one("gemma4_text", tmp_path)
    assert result["outcome"] == "refused" and "\n" not in result["detail"], result
    assert "cannot be captured yet: its config sets head_dim and other sizes per layer" in result["detail"]


def test_input_attribution_of_a_model_that_scales_its_input_in_place():
    """CTRL's forward does `inputs_embeds *= sqrt(d_model)`: the attribution hands it a copy, so Captum's leaf input
    is not written to and the logit at the input is the model's own logit for the ids."""
    import torch

    from pipeline.model import input_attribution

    model = zoo.build_toy("ctrl")
    ids = torch.randint(0, 150000, (1, 6), generator=torch.Generator().manual_seed(0))
    table = input_attribution.attribute(model, ids, [(5, 7)], torch.full_like(ids, 1), n_steps=4)
    with torch.no_grad():
        logit = float(model(input_ids=ids, use_cache=False).logits[0, 5, 7])
    assert table["logit_input"].iloc[0] == pytest.approx(logit, rel=1e-5, abs=1e-6)
    assert set(table["method"]) == set(input_attribution.METHODS) and table["attribution"].notna().all()
