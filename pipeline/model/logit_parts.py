"""Each candidate's logit split into the residual stream's parts, from one hooked forward pass.

In pipeline/model, not pipeline/numerics: the per-head split needs what the capture does not
keep (every layer's o_proj input, the per-head context z, and its output), so a forward pass
with hooks on module paths (`families.FAMILIES`) records them at the model's own dtype. The
arithmetic is `pipeline.numerics.logit_parts`.

Parts of the stream entering the final norm, each [P, H] in FP64 at the requested positions:

    embed                    the embedding module's output (Gemma: already * sqrt(hidden_size))
    blocks.{i}.attn.head{h}  o_proj's columns of head h applied to head h's context z_h
    blocks.{i}.attn.bias     o_proj's bias, where it has one
    blocks.{i}.mlp           what the MLP adds (Gemma 2/3, OLMo 2: after its post-feedforward norm)

Where a norm follows o_proj before the add (Gemma 2/3, OLMo 2: post_attention_layernorm) its
scale is frozen at the value of the recorded o_proj output, as the final norm's is, so the heads
still add up. Then, per candidate: `bias` (the LM head's, where it has one) and `softcap` (a final
logit softcap's change, Gemma 2/3 where set) are parts of their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipeline.model.capture import act_name, decoder_layers, family, text_config
from pipeline.numerics import logit_parts as lp
from pipeline.numerics import parts_table

_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")


class NotApplicable(Exception):
    """The split does not apply to this model: the message starts "not applicable: " and says why."""


def applicability(model: nn.Module) -> str | None:
    """None where the split applies, else one line "not applicable: ..." naming what stands in the way."""
    names, cfg = family(model), text_config(model)
    why = [what for what, stands in (
        ("no layer internals in the family table (residual stream only)", names.generic),
        ("fused q/k/v projection", names.fused),
        ("learned position embeddings", names.pos_embed is not None),
        ("attention and MLP in parallel", names.is_parallel(cfg)),
        ("embedding / residual multipliers", names.embedding_multiplier or names.residual_multiplier),
        ("logit scaling", names.logits_scaling or names.logit_scale),
        (f"a '{names.norm_formula}' final norm (mean-centred)", names.norm_formula not in ("rms", "rms_plus_one")),
    ) if stands]
    if not why:
        return None
    return (f"not applicable: model_type {model.config.model_type!r} has {'; '.join(why)} (the logit split is "
            "written for decoders with one o_proj per layer, sequential residual adds and an RMS final norm)")


@dataclass(frozen=True, eq=False)
class Recorded:
    """One forward pass, read at `positions`: the parts [C, P, H] and what folds them into logits (FP64)."""

    dtype: torch.dtype
    positions: list[int]
    labels: list[tuple[str, int | None, int | None]]    # (component, layer, head) of each part
    parts: torch.Tensor                                 # [C, P, H]
    resid: torch.Tensor                                 # [P, H] the final norm's recorded input
    norm_out: torch.Tensor                              # [P, H] its recorded output (the LM-head input)
    logits: torch.Tensor                                # [P, V] the model's own output, its dtype
    scale: torch.Tensor                                 # [P, 1] the final norm's frozen scale
    gain: torch.Tensor                                  # [H]
    resid_bound: torch.Tensor                           # [P, H] numerics.logit_parts.residual_bound
    head_weight: torch.Tensor                           # [V, H] the LM head (the model's own tensor)
    head_bias: torch.Tensor | None
    softcap: float | None


def _eps(norm: nn.Module) -> float:
    return next(float(v) for a in _EPS_ATTRS if isinstance(v := getattr(norm, a, None), int | float))


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def _hooks(model: nn.Module, seen: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], pos: torch.Tensor):
    """Record embed, every o_proj's input (z) and output, every MLP part, the final norm's input and output,
    each [P, X] in FP64 at the positions `pos` only (so a long prompt holds L x P rows, not L x T)."""
    names = family(model)

    def keep(key, t):
        dtypes[key] = t.dtype
        seen[key] = t.detach()[0].index_select(0, pos.to(t.device)).to("cpu", torch.float64)

    def post(key):
        return lambda m, args, out: keep(key, _first(out))

    def pre(key):
        return lambda m, args, kwargs: keep(key, args[0] if args else kwargs["hidden_states"])
    plan = [(model.get_submodule(names.embed), post("embed"), False),
            (model.get_submodule(names.final_norm), pre("resid"), True),
            (model.get_submodule(names.final_norm), post("norm_out"), False)]
    for i, layer in enumerate(decoder_layers(model)):
        o_proj = layer.get_submodule(names.attn).get_submodule(names.o_proj)
        plan += [(o_proj, pre(f"z{i}"), True), (o_proj, post(f"o{i}"), False),
                 (layer.get_submodule(names.mlp_out), post(f"mlp{i}"), False)]
    handles = [m.register_forward_pre_hook(fn, with_kwargs=True) if is_pre else m.register_forward_hook(fn)
               for m, fn, is_pre in plan]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def record_parts(model: nn.Module, input_ids: torch.Tensor, positions: Sequence[int]) -> Recorded:
    """One forward pass of `model` (as loaded: its dtype, its attention) over input_ids [1, T]; the parts at
    `positions`. Raises NotApplicable (`applicability`) for a family the split is not written for."""
    if (reason := applicability(model)) is not None:
        raise NotApplicable(reason)
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    T = input_ids.shape[1]
    if not positions or any(not 0 <= p < T for p in positions):
        raise ValueError(f"positions {list(positions)}: each must be in [0, {T - 1}] for this {T}-token input")
    seen: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    pos = torch.tensor(list(positions))
    model.eval()
    # Every row of logits, as the forward stage computes them: the same matmul shape, the capture's bits.
    with _hooks(model, seen, dtypes, pos), torch.no_grad():
        out = model(input_ids=input_ids.to(model.get_input_embeddings().weight.device), use_cache=False)
    dtype = dtypes["resid"]                     # the stream's dtype, what the bounds are in
    labels, stacked, bound = _split(model, seen, dtype)
    names, resid = family(model), seen["resid"]
    norm, head = model.get_submodule(names.final_norm), model.get_submodule(names.lm_head)
    cap = getattr(text_config(model), names.final_softcap) if names.final_softcap else None
    return Recorded(dtype, list(positions), labels, stacked, resid, seen["norm_out"],
                    out.logits[0].index_select(0, pos.to(out.logits.device)).cpu(),
                    lp.frozen_scale(resid, _eps(norm)), lp.norm_gain(norm.weight.detach().cpu(), names.norm_formula),
                    bound, head.weight.detach(), None if head.bias is None else head.bias.detach(), cap)


def _split(model: nn.Module, seen: dict[str, torch.Tensor], dtype: torch.dtype):
    """(labels, parts [C, P, H], the residual bound [P, H]) from the hooked tensors, in the order the model adds
    them; the stream is summed again here, in FP64, for the bound's |partial sums| (`residual_bound`)."""
    names, n_heads = family(model), text_config(model).num_attention_heads
    embed = seen["embed"]
    labels, parts, inner = [("embed", None, None)], [embed], 0
    stream, partial_abs, attn_abs, attn_mac = embed.clone(), 0.0, 0.0, 0.0
    for i, layer in enumerate(decoder_layers(model)):
        o_proj = layer.get_submodule(names.attn).get_submodule(names.o_proj)
        heads, mac, inner = _attention_parts(layer, o_proj, seen[f"z{i}"], seen[f"o{i}"], names, n_heads)
        labels += [(f"blocks.{i}.attn.head{h}", i, h) for h in range(len(heads))]
        if o_proj.bias is not None:
            labels.append((f"blocks.{i}.attn.bias", i, None))
            heads.append(_attention_bias(layer, o_proj, seen[f"o{i}"], names))
        attn, mlp = torch.stack(heads).sum(0), seen[f"mlp{i}"]
        labels.append((f"blocks.{i}.mlp", i, None))
        parts += [*heads, mlp]
        partial_abs = partial_abs + (stream + attn).abs() + (stream + attn + mlp).abs()
        stream = stream + attn + mlp
        attn_abs, attn_mac = attn_abs + attn.abs(), attn_mac + mac
    bound = lp.residual_bound(dtype, partial_abs, attn_abs, attn_mac, inner)
    return labels, torch.stack(parts), bound


def _post_norm(layer: nn.Module, names) -> tuple[nn.Module | None, str]:
    norm = layer.get_submodule(names.post_attn_norm) if names.post_attn_norm else None
    return norm, names.norm_formula


def _attention_parts(layer, o_proj, z: torch.Tensor, o: torch.Tensor, names, n_heads: int):
    """Per head [P, H] (through a post-attention norm with its scale frozen at o's, where there is one),
    the layer's |W_o| |z| + |b| for the bound (the same way), and o_proj's input size."""
    w = o_proj.weight.detach().to("cpu", torch.float64)             # [H, heads * hd]
    hd = w.shape[1] // n_heads
    zh, wh = z.view(z.shape[0], n_heads, hd), w.view(w.shape[0], n_heads, hd)
    heads = torch.einsum("phd,Hhd->hpH", zh, wh)                    # [heads, P, H]
    mag = z.abs() @ w.abs().T + (0.0 if o_proj.bias is None else o_proj.bias.detach().cpu().double().abs())
    norm, formula = _post_norm(layer, names)
    if norm is not None:
        scale, gain = lp.frozen_scale(o, _eps(norm)), lp.norm_gain(norm.weight.detach().cpu(), formula)
        heads, mag = lp.normalise(heads, scale, gain), mag / scale * gain.abs()
    return list(heads), mag, w.shape[1]


def _attention_bias(layer, o_proj, o: torch.Tensor, names) -> torch.Tensor:
    bias = o_proj.bias.detach().to("cpu", torch.float64).expand_as(o)
    norm, formula = _post_norm(layer, names)
    if norm is None:
        return bias.clone()
    return lp.normalise(bias, lp.frozen_scale(o, _eps(norm)), lp.norm_gain(norm.weight.detach().cpu(), formula))


def residual_check(rec: Recorded) -> lp.Gap:
    """The parts' FP64 sum against the recorded final-norm input, element by element, within `resid_bound`."""
    gap = (rec.parts.sum(0) - rec.resid).abs()
    (p, h), measured, bound = lp.worst(gap, rec.resid_bound)
    return lp.Gap(measured, bound, f"position {rec.positions[p]}, dim {h}", float(gap.max()))


def capture_gap(rec: Recorded, tensors: Mapping[str, torch.Tensor]) -> lp.Gap:
    """The hooked pass against a capture of the same model and prompt (`capture.run_capture`, the forward
    stage's capture.safetensors): the final norm's input (the last block's `resid_post`) and output, and the
    logits where the capture has every row (with capture.positions=last the LM head ran on one row, a matmul
    of another shape: other bits, which the lm_head recompute check covers), at the recorded positions. The
    same pass on the same machine gives the same bits: the bound is 0, so the parts belong to the recorded
    run."""
    n_layers = sum(1 for k in tensors if k.endswith(".resid_post"))
    logits, T = tensors[act_name("logits")][0], tensors[act_name("final_norm_out")].shape[1]
    worst = (0.0, "nowhere")
    for p, position in enumerate(rec.positions):
        pairs = [("resid_post", rec.resid[p], tensors[act_name("resid_post", n_layers - 1)][0, position]),
                 ("final_norm_out", rec.norm_out[p], tensors[act_name("final_norm_out")][0, position])]
        if logits.shape[0] == T:        # positions="last": HF's LM head ran on one row, another matmul shape
            pairs.append(("logits", rec.logits[p], logits[position]))
        for name, mine, theirs in pairs:
            gap = float((mine.double() - theirs.double()).abs().max())
            if gap > worst[0] or worst[1] == "nowhere":
                worst = (gap, f"{name} at position {position}")
    return lp.Gap(worst[0], 0.0, worst[1], worst[0])


def top_candidates(rec: Recorded, position: int, k: int) -> list[int]:
    """The k best ids of the model's logits at `position`, logit descending, ties by lower id."""
    row = rec.logits[rec.positions.index(position)].double().numpy()
    return [int(i) for i in np.lexsort((np.arange(row.size), -row))[:k]]


def logit_parts(rec: Recorded, candidates: Mapping[int, Sequence[int]]) -> pd.DataFrame:
    """The parts table: per position and candidate token id, every part's contribution to its logit.

    Columns `numerics.parts_table.PARTS_COLUMNS`: `logit` is the model's own (its dtype, as float64),
    `logit_fp64` the FP64 recompute from the recorded final-norm output and the head (what the parts
    must add up to: `numerics.logit_parts.sum_check`), `bound` that check's bound for the candidate.
    """
    frames = []
    for position, ids in candidates.items():
        if position not in rec.positions:
            raise ValueError(f"position {position} was not recorded (recorded: {rec.positions})")
        p, ids = rec.positions.index(position), [int(t) for t in ids]
        rows = rec.head_weight[ids].to("cpu", torch.float64)                        # [K, H]
        bias = torch.zeros(len(ids), dtype=torch.float64) if rec.head_bias is None else \
            rec.head_bias[ids].to("cpu", torch.float64)
        contrib = lp.fold(rec.parts[:, p], rec.scale[p], rec.gain, rows)           # [C, K]
        z = contrib.sum(0) + bias
        extra = [(lbl, v) for lbl, v, present in ((("bias", None, None), bias, rec.head_bias is not None),
                                                  (("softcap", None, None), lp.softcap_part(z, rec.softcap),
                                                   rec.softcap is not None)) if present]
        labels = rec.labels + [lbl for lbl, _ in extra]
        values = torch.cat([contrib, *(v[None] for _, v in extra)])                # [C', K]
        fp64 = rec.norm_out[p] @ rows.T + bias
        fp64 = fp64 + lp.softcap_part(fp64, rec.softcap)
        gap = (rec.parts[:, p:p + 1].sum(0) - rec.resid[p:p + 1]).abs()
        bound = lp.logit_bound(rec.dtype, gap, rec.scale[p:p + 1], rec.gain, rec.norm_out[p:p + 1], rows)[0]
        for k, t in enumerate(ids):
            frames.append(pd.DataFrame({
                "position": position, "token_id": t, "component": [c for c, _, _ in labels],
                "layer": pd.array([lyr for _, lyr, _ in labels], dtype="Int64"),
                "head": pd.array([h for _, _, h in labels], dtype="Int64"),
                "contribution": values[:, k].numpy(), "logit": float(rec.logits[p, t]),
                "logit_fp64": float(fp64[k]), "bound": float(bound[k])}))
    return pd.concat(frames, ignore_index=True)[list(parts_table.PARTS_COLUMNS)]
