"""pipeline.model.capture and pipeline.checks.recompute on tiny seeded random models (Qwen2, Gemma 3, Llama)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pipeline.checks.recompute import (
    future_attention_max,
    layer0_attention_recompute,
    lm_head_recompute,
    residual_adds_recompute,
)
from pipeline.checks.verdicts import max_abs
from pipeline.errors import UserError
from pipeline.model import capture as cap
from pipeline.model.capture import CaptureSpec, act_name, capture_names, model_facts, plain_forward_logits, run_capture

T = 9          # longer than the Gemma sliding window, so the window really masks something
WINDOW = 4
VOCAB = 1000
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _qwen2():
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager"))


def _gemma3():
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        # Final softcapping on (Gemma 2 style) so the LM-head recompute must include it;
        # attention softcapping set but NOT passed by Gemma3Attention, so it must be left out.
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, attn_implementation="eager"))


def _llama():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, attn_implementation="eager"))


BUILDERS = {"qwen2": _qwen2, "gemma3": _gemma3, "llama": _llama}


def _build(kind: str, dtype: torch.dtype):
    torch.manual_seed(1234)
    model = BUILDERS[kind]()
    with torch.no_grad():  # Gemma inits its norms at 0 (weight 1 + 0): make them non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module", params=[(k, d) for k in BUILDERS for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def run(request, input_ids):
    """(model, captured with attention_layers=(0, -1), positions='all'); read-only."""
    kind, dtype = request.param
    model = _build(kind, DTYPES[dtype])
    return model, run_capture(model, input_ids, CaptureSpec((0, -1), "all"))


@pytest.fixture(scope="module")
def qwen2_bf16():
    return _build("qwen2", torch.bfloat16)


def test_act_name():
    assert act_name("resid_pre", 3) == "blocks.3.resid_pre"
    assert act_name("attn.q_rot", 0) == "blocks.0.attn.q_rot"
    assert act_name("logits") == "logits"
    with pytest.raises(ValueError):
        act_name("resid_pre")
    with pytest.raises(ValueError):
        act_name("nonsense", 1)


def test_golden_names_qwen2(qwen2_bf16, input_ids):
    expected = [
        "embed",
        "blocks.0.resid_pre", "blocks.0.ln1_out",
        "blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v",
        "blocks.0.attn.q_rot", "blocks.0.attn.k_rot", "blocks.0.attn.mask",
        "blocks.0.attn_weights", "blocks.0.attn.z",
        "blocks.0.attn_out", "blocks.0.resid_mid", "blocks.0.mlp_out", "blocks.0.resid_post",
        "blocks.1.resid_pre", "blocks.1.attn_weights",
        "blocks.1.attn_out", "blocks.1.resid_mid", "blocks.1.mlp_out", "blocks.1.resid_post",
        "final_norm_out", "logits",
    ]
    spec = CaptureSpec((0, -1), "all")
    assert capture_names(qwen2_bf16, spec) == expected
    assert list(run_capture(qwen2_bf16, input_ids, spec)) == expected


def test_names_follow_capture_names(run):
    model, captured = run
    assert list(captured) == capture_names(model, CaptureSpec((0, -1), "all"))
    has_qk_norm = any(name.endswith("q_norm_out") for name in captured)
    assert has_qk_norm == (model.config.model_type == "gemma3_text")


def test_shapes_dtype_device(run):
    model, c = run
    cfg = model.config
    L, H, n, kv, hd = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, model.model.layers[0].self_attn.head_dim)
    for kind in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
        for i in range(L):
            assert c[act_name(kind, i)].shape == (1, T, H)
    for i in (0, L - 1):
        assert c[act_name("attn_weights", i)].shape == (1, n, T, T)
    assert c["embed"].shape == c["final_norm_out"].shape == (1, T, H)
    assert c["logits"].shape == (1, T, model.lm_head.out_features)
    assert c["blocks.0.attn.q"].shape == (1, T, n * hd)
    assert c["blocks.0.attn.k"].shape == c["blocks.0.attn.v"].shape == (1, T, kv * hd)
    assert c["blocks.0.attn.q_rot"].shape == (1, n, T, hd)
    assert c["blocks.0.attn.k_rot"].shape == (1, kv, T, hd)
    assert c["blocks.0.attn.mask"].shape == (1, 1, T, T)
    assert c["blocks.0.attn.z"].shape == (1, T, n, hd)
    dtype = model.lm_head.weight.dtype
    for name, t in c.items():
        assert (t.dtype, t.device.type, t.is_contiguous(), t.requires_grad, t.is_inference()) == (
            dtype, "cpu", True, False, False), name


def test_capture_does_not_change_logits(run, input_ids):
    model, c = run
    plain = plain_forward_logits(model, input_ids, "all")
    assert torch.equal(plain, c["logits"])
    assert torch.equal(plain, plain_forward_logits(model, input_ids, "all"))


def test_capture_leaves_model_untouched(run, input_ids):
    model, _ = run
    run_capture(model, input_ids, CaptureSpec((1,), "last"))
    assert model.config._attn_implementation == "eager"
    assert all(m.config._attn_implementation == "eager" for m in model.modules() if hasattr(m, "config"))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert cap._ACTIVE.get() is None


def test_logits_are_kept_not_copied(qwen2_bf16, input_ids):
    # The logits [1, T, V] are the largest tensor by far: capture holds the model's own output,
    # not a second copy of it.
    seen = []
    handle = qwen2_bf16.register_forward_hook(lambda m, a, out: seen.append(out.logits.untyped_storage().data_ptr()))
    try:
        c = run_capture(qwen2_bf16, input_ids, CaptureSpec((0,), "all"))
    finally:
        handle.remove()
    assert seen == [c["logits"].untyped_storage().data_ptr()]


def test_every_tensor_owns_its_storage(run):
    # resid_post of layer i is the very tensor layer i+1 reads (resid_pre), and embed is layer 0's
    # input: kept once, copied for the second name, so no name aliases another or a weight.
    model, c = run
    storages = [t.untyped_storage().data_ptr() for t in c.values()]
    assert len(set(storages)) == len(storages)
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert not weights & set(storages)
    for i in range(1, model.config.num_hidden_layers):
        assert torch.equal(c[act_name("resid_pre", i)], c[act_name("resid_post", i - 1)])
    assert torch.equal(c["embed"], c["blocks.0.resid_pre"])
    from safetensors.torch import load, save
    assert all(torch.equal(v, c[k]) for k, v in load(save(c)).items())


def test_in_place_edit_after_recording_is_not_seen(input_ids):
    # A model that edits an activation in place after it was recorded: the capture still holds
    # the value at the recording point (it notices by the version counter and records again
    # copying), and still equals a plain forward of that same model.
    model = _build("qwen2", torch.float32)
    last = model.config.num_hidden_layers - 1
    handle = model.model.norm.register_forward_pre_hook(lambda m, args: args[0].mul_(2.0))
    try:
        c = run_capture(model, input_ids, CaptureSpec((0,), "all"))
        plain = plain_forward_logits(model, input_ids, "all")
    finally:
        handle.remove()
    assert residual_adds_recompute(model, c, last) == {"resid_mid": 0.0, "resid_post": 0.0}
    assert torch.equal(c["logits"], plain)
    assert not torch.equal(c["logits"], plain_forward_logits(model, input_ids, "all"))   # the edit mattered


def test_capture_inside_inference_mode(qwen2_bf16, input_ids):
    spec = CaptureSpec((0,), "all")
    with torch.inference_mode():
        inside = run_capture(qwen2_bf16, input_ids, spec)
    outside = run_capture(qwen2_bf16, input_ids, spec)
    assert list(inside) == list(outside)
    for name, t in inside.items():
        assert not t.is_inference() and torch.equal(t, outside[name]), name


def test_hooks_removed_on_error(qwen2_bf16):
    bad_ids = torch.tensor([[VOCAB + 5]])  # out of the embedding table: fails inside the forward
    with pytest.raises(IndexError):
        run_capture(qwen2_bf16, bad_ids, CaptureSpec((0,), "all"))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in qwen2_bf16.modules())
    assert qwen2_bf16.config._attn_implementation == "eager"
    assert cap._ACTIVE.get() is None


def test_recomputes_are_exact(run):
    model, c = run
    assert lm_head_recompute(model, c["final_norm_out"], c["logits"]) == 0.0
    attn = layer0_attention_recompute(model, c)
    expected = ["q", "k", "v", "q_rot", "k_rot", "attn_weights", "z", "attn_out"]
    if model.config.model_type == "gemma3_text":
        expected[3:3] = ["q_norm_out", "k_norm_out"]
    assert list(attn) == expected
    assert attn == dict.fromkeys(expected, 0.0)
    for i in range(model.config.num_hidden_layers):
        first = {"resid_pre": 0.0} if i == 0 else {}
        assert residual_adds_recompute(model, c, i) == {**first, "resid_mid": 0.0, "resid_post": 0.0}
    assert future_attention_max(c) == {0: 0.0, model.config.num_hidden_layers - 1: 0.0}


def _corrupt(captured, name, index):
    bad = dict(captured)
    t = captured[name].clone()
    t[index] += 1.0
    bad[name] = t
    return bad


def test_corruption_is_detected_where_it_happens(run):
    model, c = run
    bad = _corrupt(c, "blocks.0.attn_out", (0, 3, 5))
    attn = layer0_attention_recompute(model, bad)
    assert attn["attn_out"] > 0.0
    assert all(v == 0.0 for k, v in attn.items() if k != "attn_out")  # steps restart from captures
    assert residual_adds_recompute(model, bad, 0)["resid_mid"] > 0.0
    assert residual_adds_recompute(model, _corrupt(c, "embed", (0, 1, 1)), 0)["resid_pre"] > 0.0

    assert layer0_attention_recompute(model, _corrupt(c, "blocks.0.attn.q_rot", (0, 1, 2, 3)))["q_rot"] > 0.0
    assert layer0_attention_recompute(model, _corrupt(c, "blocks.0.attn.z", (0, 2, 1, 0)))["z"] > 0.0
    last = model.config.num_hidden_layers - 1
    assert residual_adds_recompute(model, _corrupt(c, f"blocks.{last}.mlp_out", (0, 0, 0)), last)["resid_post"] > 0.0
    assert lm_head_recompute(model, _corrupt(c, "final_norm_out", (0, T - 1, 0))["final_norm_out"],
                             c["logits"]) > 0.0
    future = future_attention_max(_corrupt(c, f"blocks.{last}.attn_weights", (0, 0, 2, 7)))
    assert future[last] == 1.0 and future[0] == 0.0


def test_max_abs_on_tensors():
    a = torch.tensor([1.0, float("-inf"), 3.0])
    assert max_abs(a, a.clone()) == 0.0
    assert max_abs(a, torch.tensor([1.0, float("-inf"), 3.5])) == 0.5
    assert max_abs(a, torch.tensor([1.0, float("nan"), 3.0])) == float("inf")
    assert max_abs(a, a[:2]) == float("inf")      # one behaviour for a shape mismatch: it counts inf


@pytest.mark.parametrize("bad", [2, -3, 99])
def test_out_of_range_attention_layer(qwen2_bf16, input_ids, bad):
    with pytest.raises(UserError, match=rf"capture\.attention_layers={bad}\b.*\[-2, 1\]"):
        run_capture(qwen2_bf16, input_ids, CaptureSpec((0, bad), "all"))


def test_non_eager_attention_refused(input_ids):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, attn_implementation="sdpa"))
    with pytest.raises(UserError, match="capture.attn_implementation='sdpa'"):
        run_capture(model, input_ids, CaptureSpec((0,), "all"))


def test_unknown_family_refused():
    class Fake(torch.nn.Module):
        config = type("C", (), {"model_type": "not_a_family"})()
    # Not in the family table and no decoder layers to be found: refused in one line naming it.
    with pytest.raises(UserError, match="model_type='not_a_family' is not allowed: a decoder whose decoder "
                                        "layers, input embeddings, final norm, LM head can be found"):
        cap.family(Fake())


def test_positions_last(run, input_ids):
    model, full = run
    c = run_capture(model, input_ids, CaptureSpec((0,), "last"))
    assert c["logits"].shape == (1, 1, model.lm_head.out_features)
    assert c["final_norm_out"].shape == (1, T, model.config.hidden_size)
    assert torch.equal(c["logits"], plain_forward_logits(model, input_ids, "last"))
    assert lm_head_recompute(model, c["final_norm_out"], c["logits"]) == 0.0
    # The LM head then runs on [1, 1, H] instead of [1, T, H]: a different matmul shape, so
    # in float32 the row can differ from the full run's last row by about an ulp (seen on
    # CPU); equal within the dtype's rounding, not promised bit for bit.
    torch.testing.assert_close(c["logits"], full["logits"][:, -1:])


def test_gemma_specifics(input_ids):
    model = _build("gemma3", torch.float32)
    c = run_capture(model, input_ids, CaptureSpec((0,), "all"))
    # `embed` is the embedding module's output, which already carries sqrt(hidden) = 8.
    assert torch.equal(c["embed"], model.model.embed_tokens.weight[input_ids] * 8.0)
    # Layer 0 is a sliding layer: the captured mask is the real sliding mask, and keys at
    # distance >= window get exactly zero weight.
    w = c["blocks.0.attn_weights"][0]
    far = torch.ones(T, T, dtype=torch.bool).tril(diagonal=-WINDOW)
    assert far.any() and torch.all(w[:, far] == 0.0)
    assert torch.all(c["blocks.0.attn.mask"][0, 0][far] < -1e30)
    # Final softcapping is really applied (the raw LM head differs from the logits).
    assert not torch.equal(model.lm_head(c["final_norm_out"]), c["logits"])
    assert float(c["logits"].abs().max()) < 30.0


def test_model_facts(qwen2_bf16):
    facts = model_facts(qwen2_bf16, tokenizer_len=990)
    assert {k: facts[k] for k in ("model_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                  "head_dim", "output_size", "tokenizer_len", "lm_head_weight_shape",
                                  "lm_head_has_bias", "tied_embeddings", "embed_scale")} == {
        "model_type": "qwen2", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 16, "output_size": VOCAB, "tokenizer_len": 990, "lm_head_weight_shape": [VOCAB, 64],
        "lm_head_has_bias": False, "tied_embeddings": False, "embed_scale": None}
    gemma = model_facts(_build("gemma3", torch.float32), tokenizer_len=VOCAB)
    assert gemma["tied_embeddings"] is True and gemma["embed_scale"] == 8.0
    assert gemma["final_logit_softcapping"] == 30.0 and "sqrt(hidden_size)" in gemma["embed_scale_note"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])
def test_exact_on_cuda(kind, input_ids):
    model = _build(kind, torch.bfloat16).to("cuda")
    c = run_capture(model, input_ids, CaptureSpec((0, -1), "all"))
    assert torch.equal(c["logits"], plain_forward_logits(model, input_ids, "all"))
    assert lm_head_recompute(model, c["final_norm_out"], c["logits"]) == 0.0
    assert set(layer0_attention_recompute(model, c).values()) == {0.0}
    assert residual_adds_recompute(model, c, 0) == {"resid_pre": 0.0, "resid_mid": 0.0, "resid_post": 0.0}
