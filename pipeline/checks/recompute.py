"""Exact recomputations of captured numbers, for the checks stage.

Each function takes captured tensors (see `pipeline.model.capture`) plus the model and returns
the max absolute difference (`verdicts.max_abs`) between what it recomputes and what was
recorded. Every step runs the same modules, dtype and op order as the model's eager code, so
on the device that made the capture a consistent record gives exactly 0.0. With the model
spread over several GPUs each step runs on its module's device.

Each attention step starts from the *captured* input of that step (not from the previous
recomputed step), so a corrupted tensor shows up in the step that produces it, not in
everything downstream. The captured input is first given the memory layout the model's
own tensor had (`_with_layout_of`): matmul kernels may accumulate differently for
different strides.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pipeline.checks.verdicts import max_abs
from pipeline.model.capture import act_name, decoder_layers, family, text_config
from pipeline.model.head import lm_head_rows
from pipeline.model.head import softcap as _softcap


def _with_layout_of(ref: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (same shape) copied into a tensor with `ref`'s strides, dtype and device."""
    out = torch.empty_strided(ref.size(), ref.stride(), dtype=ref.dtype, device=ref.device)
    return out.copy_(values)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def lm_head_recompute(model: nn.Module, final_norm_out: torch.Tensor, logits: torch.Tensor) -> float:
    """The model's own lm_head on the stored input vs the stored logits (all their rows)."""
    return max_abs(lm_head_rows(model, final_norm_out, logits.shape[1]), logits)


def final_norm_recompute(model: nn.Module, captured: dict[str, torch.Tensor]) -> float:
    """The model's own final norm on the stored output of the last layer vs the stored LM-head input."""
    norm = model.get_submodule(family(model).final_norm)
    last = captured[act_name("resid_post", len(decoder_layers(model)) - 1)].to(_device_of(norm))
    with torch.inference_mode():
        return max_abs(norm(last), captured[act_name("final_norm_out")])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # [B, kv_heads, T, hd] -> [B, kv_heads * n_rep, T, hd], as HF's repeat_kv.
    if n_rep == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, t, hd).reshape(b, kv * n_rep, t, hd)


def layer0_attention_recompute(model: nn.Module, captured: dict[str, torch.Tensor]) -> dict[str, float]:
    """Layer-0 attention, step by step from its input: max abs diff per captured tensor.

    Keys: q, k, v (or qkv), (q_norm_out, k_norm_out), q_rot, k_rot, attn_weights, z, attn_out;
    none for a family captured at the residual-stream level. The input is `blocks.0.ln1_out`, or
    `blocks.0.resid_pre` where attention reads the residual itself (OLMo 2). With a fused
    projection the split and RoPE are the family's own layout: `attn.qkv` is recomputed from the
    input, and the attention from the q_rot / k_rot / value it was given. Uses the HF attention
    attributes every supported family has: scaling, num_key_value_groups (1 when absent), and
    head_dim, use_rope, layer_type where the family has them.
    """
    names = family(model)
    if names.generic:
        return {}
    layer = decoder_layers(model)[0]
    attn = layer.get_submodule(names.attn)
    device = _device_of(attn)

    def cap(kind: str) -> torch.Tensor:
        return captured[act_name(kind, 0)].to(device)

    diffs: dict[str, float] = {}

    def check(kind: str, recomputed: torch.Tensor) -> torch.Tensor:
        """Record the diff; hand on the captured tensor, laid out like the recomputed one."""
        diffs[kind.removeprefix("attn.")] = max_abs(recomputed, captured[act_name(kind, 0)])
        return _with_layout_of(recomputed, cap(kind))

    x = cap("ln1_out") if names.ln1 is not None else cap("resid_pre")
    _, t, _ = x.shape
    with torch.inference_mode():
        if names.fused:
            check("attn.qkv", attn.get_submodule(names.qkv_proj)(x))
            q, k, v = cap("attn.q_rot"), cap("attn.k_rot"), cap("attn.value")
        else:
            q, k, v = _projections_and_rope(model, attn, x, captured, check)
        # Eager attention: scores * scaling, [softcap], + mask, softmax (float32, cast back), @ v.
        n_rep = getattr(attn, "num_key_value_groups", 1)
        scores = torch.matmul(q, _repeat_kv(k, n_rep).transpose(2, 3)) * attn.scaling
        scores = _softcap(scores, getattr(attn, names.attn_softcap) if names.attn_softcap else None)
        mask_name = act_name("attn.mask", 0)
        if mask_name in captured:
            scores = scores + captured[mask_name].to(device)
        if names.softmax_fp32:
            weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:                                   # GPT-2: in the compute dtype
            weights = nn.functional.softmax(scores, dim=-1).to(v.dtype)
        weights = check("attn_weights", weights)

        z = check("attn.z", torch.matmul(weights, _repeat_kv(v, n_rep)).transpose(1, 2).contiguous())
        out = attn.get_submodule(names.o_proj)(z.reshape(1, t, -1).contiguous())
        if names.post_attn_norm is not None:  # Gemma, OLMo 2: normed before the residual add
            out = layer.get_submodule(names.post_attn_norm)(out)
        check("attn_out", out)
    return {k: diffs[k] for k in _STEP_ORDER if k in diffs}


# The order of the steps' checks, whatever order a family computes them in.
_STEP_ORDER = ("q", "k", "v", "qkv", "q_norm_out", "k_norm_out", "q_rot", "k_rot", "attn_weights", "z", "attn_out")


def _projections_and_rope(model: nn.Module, attn: nn.Module, x: torch.Tensor, captured: dict, check):
    """q, k, v as [1, heads, T, hd] after the separate projections, the q/k norms where the
    family has them (at its own place, `ModuleNames.qk_norm_at`) and RoPE where the layer uses it."""
    names = family(model)
    _, t, _ = x.shape
    hd = attn.head_dim
    device = x.device
    out = {}
    for kind, proj, norm in (("attn.q", names.q_proj, names.q_norm), ("attn.k", names.k_proj, names.k_norm),
                             ("attn.v", names.v_proj, None)):
        y = check(kind, attn.get_submodule(proj)(x))
        norm_kind = f"{kind}_norm_out"
        if norm is not None and names.qk_norm_at == "flat":      # OLMo 2: over all heads at once
            y = check(norm_kind, attn.get_submodule(norm)(y))
        y = y.view(1, t, -1, hd)
        if norm is not None and names.qk_norm_at == "bthd":      # Qwen 3: per head, before the transpose
            y = check(norm_kind, attn.get_submodule(norm)(y))
        y = y.transpose(1, 2)
        if norm is not None and names.qk_norm_at == "bhtd":      # Gemma 3: per head, after it
            y = check(norm_kind, attn.get_submodule(norm)(y))
        out[kind] = y
    q, k, v = out["attn.q"], out["attn.k"], out["attn.v"]
    if names.rotary is not None and getattr(attn, "use_rope", True):    # SmolLM3's NoPE layers: no RoPE
        # RoPE tables from the model's own rotary module, as the model builds them: from the
        # embedding output (dtype/device only) and positions 0..T-1.
        rotary = model.get_submodule(names.rotary)
        embed = captured[act_name("embed")].to(device)
        position_ids = torch.arange(t, device=device).unsqueeze(0)
        extra = (attn.layer_type,) if names.rope_by_layer_type else ()
        cos, sin = rotary(embed, position_ids, *extra)
        # Spread over GPUs (device_map="auto"), the rotary module may sit on another device than
        # layer 0, and accelerate hands its output back there: the model moves it too (exact).
        cos, sin = cos.to(device).unsqueeze(1), sin.to(device).unsqueeze(1)
        # Back to the input dtype: a no-op where the tables already have it; OLMo 2 keeps them in
        # float32 and casts the rotated q / k back, as here.
        q, k = ((q * cos) + (_rotate_half(q) * sin)).to(q.dtype), ((k * cos) + (_rotate_half(k) * sin)).to(k.dtype)
    return check("attn.q_rot", q), check("attn.k_rot", k), v


def residual_adds_recompute(model: nn.Module, captured: dict[str, torch.Tensor], layer: int) -> dict[str, float]:
    """The residual adds of one layer, as the family writes them, vs the captured sums (same
    dtype, CPU): resid_pre + attn_out -> resid_mid, resid_mid + mlp_out -> resid_post, each
    output scaled by residual_multiplier first (Granite); a parallel layer (GPT-NeoX) sums
    mlp_out + attn_out + resid_pre, in that order. Layer 0 also rebuilds its input from `embed`
    (+ `pos_embed`, GPT-2; * embedding_multiplier, Granite). None for the residual-stream tier.

    An elementwise add rounds the same on every device, so CPU reproduces the GPU result.
    """
    names, cfg = family(model), text_config(model)
    if names.generic:
        return {}

    def get(kind: str) -> torch.Tensor:
        return captured[act_name(kind, layer)]

    m = getattr(cfg, names.residual_multiplier) if names.residual_multiplier else None

    def scaled(kind: str) -> torch.Tensor:
        return get(kind) if m is None else get(kind) * m

    out = {}
    with torch.inference_mode():
        if layer == 0:
            first = captured[act_name("embed")]
            if names.pos_embed:
                first = first + captured[act_name("pos_embed")]
            if names.embedding_multiplier:
                first = first * getattr(cfg, names.embedding_multiplier)
            out["resid_pre"] = max_abs(first, get("resid_pre"))
        if names.is_parallel(cfg):
            out["resid_post"] = max_abs(scaled("mlp_out") + scaled("attn_out") + get("resid_pre"), get("resid_post"))
        else:
            out["resid_mid"] = max_abs(get("resid_pre") + scaled("attn_out"), get("resid_mid"))
            out["resid_post"] = max_abs(get("resid_mid") + scaled("mlp_out"), get("resid_post"))
    return out


_ATTN_WEIGHTS = re.compile(r"^blocks\.(\d+)\.attn_weights$")


def future_attention_max(captured: dict[str, torch.Tensor]) -> dict[int, float]:
    """Per captured layer: the largest attention weight strictly above the diagonal (0.0 if causal)."""
    result = {}
    for name, w in captured.items():
        match = _ATTN_WEIGHTS.match(name)
        if match is None:
            continue
        q_len, k_len = w.shape[-2:]
        # Query i sits at absolute position k_len - q_len + i; "future" is any key after it.
        future = torch.ones(q_len, k_len, dtype=torch.bool).triu(diagonal=k_len - q_len + 1)
        values = w[..., future]
        result[int(match.group(1))] = float(values.max()) if values.numel() else 0.0   # exact in any dtype
    return result
