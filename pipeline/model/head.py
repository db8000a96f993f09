"""The model's own LM head applied as the model applies it: lm_head, Granite's logits_scaling, Cohere's
logit_scale, a final softcap.

One function, shared by the checks (`pipeline.checks.recompute`: the stored LM-head input ->
the stored logits) and the logit lens (`pipeline.model.lens`: every layer's normed residual),
so both apply exactly the model's ops in its order and dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.model.capture import family, text_config


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    # The same three ops, in the same order, as HF (Gemma final logits / Gemma 2 attention).
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def lm_head_rows(model: nn.Module, final_norm_out: torch.Tensor, rows: int) -> torch.Tensor:
    """The model's own lm_head (+ final softcapping, if the family has it) on the last `rows`
    positions of the stored LM-head input, sliced as HF slices it (`slice_logits_to_keep`), so
    the matmul has the shape it had in the pass that made the logits."""
    names, cfg = family(model), text_config(model)
    lm_head = model.get_submodule(names.lm_head)
    x = final_norm_out[:, -rows:, :].to(device=next(lm_head.parameters()).device)
    cap = getattr(cfg, names.final_softcap) if names.final_softcap else None
    with torch.inference_mode():
        logits = lm_head(x)
        if names.head_fp32:             # the model scales / softcaps in float32 (found on the model: capture)
            logits = logits.float()
        if names.logits_scaling:        # Granite: logits / logits_scaling, before any softcap
            logits = logits / getattr(cfg, names.logits_scaling)
        if names.logit_scale:           # Cohere: logits * logit_scale (the model's attribute, from its config)
            logits = logits * getattr(model, names.logit_scale)
        return softcap(logits, cap)
