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
from pipeline.model.capture import act_name, decoder_layers, family


def _with_layout_of(ref: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (same shape) copied into a tensor with `ref`'s strides, dtype and device."""
    out = torch.empty_strided(ref.size(), ref.stride(), dtype=ref.dtype, device=ref.device)
    return out.copy_(values)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    # The same three ops, in the same order, as HF (Gemma final logits / Gemma 2 attention).
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def lm_head_rows(model: nn.Module, final_norm_out: torch.Tensor, rows: int) -> torch.Tensor:
    """The model's own lm_head (+ final softcapping, if the family has it) on the last `rows`
    positions of the stored LM-head input, sliced as HF slices it (`slice_logits_to_keep`), so
    the matmul has the shape it had in the pass that made the logits."""
    names = family(model)
    lm_head = model.get_submodule(names.lm_head)
    x = final_norm_out[:, -rows:, :].to(device=_device_of(lm_head))
    cap = getattr(model.config, names.final_softcap) if names.final_softcap else None
    with torch.inference_mode():
        return _softcap(lm_head(x), cap)


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
    """Layer-0 attention, step by step from `blocks.0.ln1_out`: max abs diff per captured tensor.

    Keys: q, k, v, (q_norm_out, k_norm_out), q_rot, k_rot, attn_weights, z, attn_out.
    Uses the HF attention attributes every supported family has: head_dim, scaling,
    num_key_value_groups (and layer_type for per-type RoPE).
    """
    names = family(model)
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

    x = cap("ln1_out")
    _, t, _ = x.shape
    hd = attn.head_dim
    with torch.inference_mode():
        # Projections, then [1, T, n*hd] -> [1, n, T, hd] as in the attention forward.
        heads = {}
        for kind, proj in (("attn.q", names.q_proj), ("attn.k", names.k_proj), ("attn.v", names.v_proj)):
            out = check(kind, attn.get_submodule(proj)(x))
            heads[kind] = out.view(1, t, -1, hd).transpose(1, 2)
        q, k, v = heads["attn.q"], heads["attn.k"], heads["attn.v"]
        if names.q_norm is not None:  # Gemma 3: RMSNorm per head, before RoPE
            q = check("attn.q_norm_out", attn.get_submodule(names.q_norm)(q))
            k = check("attn.k_norm_out", attn.get_submodule(names.k_norm)(k))

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
        q = check("attn.q_rot", (q * cos) + (_rotate_half(q) * sin))
        k = check("attn.k_rot", (k * cos) + (_rotate_half(k) * sin))

        # Eager attention: scores * scaling, [softcap], + mask, softmax in float32, cast back.
        n_rep = attn.num_key_value_groups
        scores = torch.matmul(q, _repeat_kv(k, n_rep).transpose(2, 3)) * attn.scaling
        scores = _softcap(scores, getattr(attn, names.attn_softcap) if names.attn_softcap else None)
        mask_name = act_name("attn.mask", 0)
        if mask_name in captured:
            scores = scores + captured[mask_name].to(device)
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        weights = check("attn_weights", weights)

        z = check("attn.z", torch.matmul(weights, _repeat_kv(v, n_rep)).transpose(1, 2).contiguous())
        out = attn.get_submodule(names.o_proj)(z.reshape(1, t, -1).contiguous())
        if names.post_attn_norm is not None:  # Gemma: normed before the residual add
            out = layer.get_submodule(names.post_attn_norm)(out)
        check("attn_out", out)
    return diffs


def residual_adds_recompute(captured: dict[str, torch.Tensor], layer: int) -> dict[str, float]:
    """resid_pre + attn_out vs resid_mid, resid_mid + mlp_out vs resid_post (same dtype, CPU).

    An elementwise add is correctly rounded on every device, so CPU reproduces the GPU result.
    """
    def get(kind: str) -> torch.Tensor:
        return captured[act_name(kind, layer)]

    with torch.inference_mode():
        mid = get("resid_pre") + get("attn_out")
        post = get("resid_mid") + get("mlp_out")
    return {"resid_mid": max_abs(mid, get("resid_mid")),
            "resid_post": max_abs(post, get("resid_post"))}


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
