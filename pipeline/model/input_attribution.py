"""Which prompt tokens a logit depends on: integrated gradients and input x gradient over the input
embeddings (Captum), with the completeness of the integrated gradients measured.

For a target (the logits row at `target_position`, the id `target_token_id`), f(e) is that logit
of the model run on input embeddings e [1, T, H] (the embedding module's output: Gemma's already
scaled by sqrt(hidden_size)). Integrated gradients from the baseline b:

    IG_s = sum_h (e_sh - b_sh) * integral_0^1 df/de_sh(b + a (e - b)) da     (one figure per source position s)

and completeness says sum_s IG_s = f(e) - f(b). The integral is Captum's IntegratedGradients on the
embeddings (the same as its LayerIntegratedGradients on the embedding layer with the baseline's token ids; a
test checks that), a midpoint Riemann sum in c with a = c**alpha_power (the same integral, a change of
variable). Captum's public `attribute` takes only its named rules, so the nodes go through its
`_attribute(step_sizes_and_alphas=...)` (captum==0.8.0, pinned).

The baseline is a prompt of the tokenizer's pad token (`baseline_ids`: pad, else unk, else eos), with
each position that holds the BOS token kept as it is. Not the all-zero embedding: along the straight
line from 0 every RMS norm of a pre-norm model switches on within an a far below float32's resolution
(the norms compound from layer to layer): on gemma3_270m f(a e) swings between -54 and +14 for a in
[1e-36, 1e-8] while f(0) = 0, so no rule of any step count integrates it (32 / 64 / 128 steps missed a
difference of 5.9 by 19 / 0.06 / 11). The BOS position is kept because interpolating it moves the
position every other one attends to (the attention sink) and makes the path rough (a pad baseline with
BOS interpolated: gaps of 3 to 12 at 8 to 64 steps on a difference of 3). From that baseline, evenly
spaced nodes (alpha_power 1, Captum's riemann_middle) converge: gaps of 1.3 % and 0.3 % of the difference
for the top two at 32 steps. Where the pad token's embedding row is all zero (a toy whose init zeroes its
padding row: tiny_qwen2) the path starts at 0 after all, where the norms switch on within a ~ sqrt(eps /
mean(e^2)) that float32 does resolve on a toy, and the nodes are dense there (`path_alpha_power`: 4;
tiny_qwen2: 1.6 % at 32 steps, where evenly spaced nodes leave 96 %). docs/attribution.md has the figures.
Input x gradient: Captum's InputXGradient, e * df/de at e, summed over h (local: no baseline).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pandas as pd
import torch
from torch import nn

from pipeline.errors import UserError

METHODS = ("integrated_gradients", "input_x_gradient")
COLUMNS = ("target_position", "target_token_id", "source_position", "method", "attribution", "logit_input",
           "logit_baseline")
IG_STEPS = 32
ALPHA_POWER = 4
# The stated bound of the completeness check: |sum IG - (f(e) - f(b))| <= COMPLETENESS_REL * |f(e) - f(b)|.
# Not derived (a Riemann sum's error needs the integrand's derivatives): what 32 midpoint steps reach from the
# pad baseline, with room, on tiny_qwen2 and gemma3_270m (docs/attribution.md); a report check, never a failed run.
COMPLETENESS_REL = 0.05


def baseline_ids(input_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """The baseline prompt: the tokenizer's pad id (else unk, else eos) at every position, the BOS id kept
    where the input has it. Refused in one line for a tokenizer with none of the three."""
    fill = next((i for i in (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id)
                 if i is not None), None)
    if fill is None:
        raise UserError("input attribution needs a baseline token: the tokenizer has no pad, unk or eos token")
    out = torch.full_like(input_ids, int(fill))
    bos = tokenizer.bos_token_id
    if bos is not None:
        out = torch.where(input_ids == bos, input_ids, out)
    return out


def nodes(n_steps: int, alpha_power: int) -> tuple[list[float], list[float]]:
    """(weights, alphas): midpoints b_k = (k + 1/2) / n, a_k = b_k**p, weights p * b_k**(p - 1) / n."""
    if n_steps < 1 or alpha_power < 1:
        raise ValueError(f"n_steps={n_steps}, alpha_power={alpha_power}: both must be integers >= 1")
    b = (torch.arange(n_steps, dtype=torch.float64) + 0.5) / n_steps
    return (alpha_power * b ** (alpha_power - 1) / n_steps).tolist(), (b ** alpha_power).tolist()


def path_alpha_power(model: nn.Module, input_ids: torch.Tensor, baseline: torch.Tensor) -> int:
    """ALPHA_POWER (nodes dense near the baseline) where the path starts at the zero vector, that is where every
    baseline position that moves has an all-zero embedding row (a toy's pad row, zeroed by its init): there the
    norms switch on within a ~ sqrt(eps) / rms(e) of it. 1 (evenly spaced midpoints, Captum's riemann_middle)
    from a real token's embedding."""
    layer = model.get_input_embeddings()
    moving = baseline[baseline != input_ids].to(layer.weight.device)
    with torch.no_grad():
        return ALPHA_POWER if moving.numel() and not bool(layer(moving).any()) else 1


@contextlib.contextmanager
def _frozen(model: nn.Module):
    """No gradients kept for the weights while attributing (only the inputs'), flags restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _logit_fns(model: nn.Module, position: int, token_id: int):
    """The target's logit as a function of token ids, and of input embeddings: one figure per batch item."""
    keep = torch.tensor([position], device=model.get_input_embeddings().weight.device)

    def logit(**inputs):
        return model(**inputs, use_cache=False, logits_to_keep=keep).logits[:, 0, token_id]
    # A copy of the embeddings goes in: a forward that scales inputs_embeds in place (CTRL's `*= sqrt(d_model)`)
    # would otherwise change the caller's embeddings, and refuses to on the leaf tensor Captum differentiates by.
    return (lambda ids: logit(input_ids=ids)), (lambda embeds: logit(inputs_embeds=embeds.clone()))


def attribute(model: nn.Module, input_ids: torch.Tensor, targets: Sequence[tuple[int, int]],
              baseline: torch.Tensor, n_steps: int = IG_STEPS, alpha_power: int | None = None) -> pd.DataFrame:
    """Per (target_position, target_token_id) in `targets`: each source position 0..target_position's
    attribution by each of METHODS, with the target's logit at the input and at `baseline` (token ids, the
    shape of `input_ids`: `baseline_ids`), `n_steps` nodes dense near the baseline by `alpha_power` (default:
    `path_alpha_power`). The model must be float32 (gradients of bf16 logits are too coarse to integrate)."""
    from captum.attr import InputXGradient, IntegratedGradients

    layer = model.get_input_embeddings()
    if layer.weight.dtype != torch.float32:
        raise ValueError(f"input attribution runs in float32; the model is {layer.weight.dtype} "
                         "(load it with dtype=float32)")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    if baseline.shape != input_ids.shape:
        raise ValueError(f"baseline ids {tuple(baseline.shape)} must have the input's shape {tuple(input_ids.shape)}")
    weights, alphas = nodes(n_steps, path_alpha_power(model, input_ids, baseline) if alpha_power is None
                            else alpha_power)
    T = input_ids.shape[1]
    input_ids, baseline = input_ids.to(layer.weight.device), baseline.to(layer.weight.device)
    model.eval()
    frames = []
    with _frozen(model):
        embeds, base_embeds = layer(input_ids).detach(), layer(baseline).detach()
        for position, token_id in targets:
            if not 0 <= position < T:
                raise ValueError(f"target position {position}: must be in [0, {T - 1}] for this {T}-token input")
            by_ids, by_embeds = _logit_fns(model, position, int(token_id))
            with torch.no_grad():
                logit_input, logit_baseline = float(by_ids(input_ids)[0]), float(by_ids(baseline)[0])
            (ig,) = IntegratedGradients(by_embeds)._attribute((embeds,), (base_embeds,), n_steps=n_steps,
                                                              step_sizes_and_alphas=(weights, alphas))
            ixg = InputXGradient(by_embeds).attribute(embeds.clone().requires_grad_(True))
            for method, values in zip(METHODS, (ig, ixg)):
                per_source = values[0, :position + 1].sum(-1).detach().to("cpu", torch.float64)
                frames.append(pd.DataFrame({
                    "target_position": position, "target_token_id": int(token_id),
                    "source_position": range(position + 1), "method": method, "attribution": per_source.numpy(),
                    "logit_input": logit_input, "logit_baseline": logit_baseline}))
    return pd.concat(frames, ignore_index=True)[list(COLUMNS)]


def completeness(table: pd.DataFrame) -> pd.DataFrame:
    """Per target: the IG sum, logit(input) - logit(baseline), the gap |sum - difference|, its stated
    bound COMPLETENESS_REL * |difference|, and whether the gap is within it."""
    ig = table[table["method"] == "integrated_gradients"]
    per = ig.groupby(["target_position", "target_token_id"], sort=True).agg(
        ig_sum=("attribution", "sum"), logit_input=("logit_input", "first"),
        logit_baseline=("logit_baseline", "first")).reset_index()
    per["difference"] = per["logit_input"] - per["logit_baseline"]
    per["gap"] = (per["ig_sum"] - per["difference"]).abs()
    per["bound"] = COMPLETENESS_REL * per["difference"].abs()
    per["within"] = per["gap"] <= per["bound"]
    return per
