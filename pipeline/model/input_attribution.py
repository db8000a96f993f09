"""Which prompt tokens a logit depends on: integrated gradients and input x gradient over the input
embeddings (Captum), with the completeness of the integrated gradients measured.

For a target (the logits row at `target_position`, the id `target_token_id`), f(e) is that logit
of the model run on input embeddings e [1, T, H] (the embedding module's output: Gemma's already
scaled by sqrt(hidden_size)). Integrated gradients from the all-zero baseline:

    IG_s = sum_h e_sh * integral_0^1 df/de_sh(a e) da          (one figure per source position s)

and completeness says sum_s IG_s = f(e) - f(0). The integral is Captum's IntegratedGradients on
the embeddings (the same as its LayerIntegratedGradients on the embedding layer with an all-zero
layer baseline, which LIG cannot be given: its baselines are token ids). The nodes are a midpoint
Riemann sum in b with a = b**alpha_power (the same integral, a change of variable): with a zero
baseline, every RMSNorm of the model saturates within a ~ sqrt(eps / mean(e^2)) of 0, so the
integrand is steep there and uniform nodes (alpha_power=1, Captum's "riemann_middle") leave gaps
of tens of percent that more steps do not close (docs/attribution.md). Captum's public `attribute`
takes only its named rules, so the nodes go through its `_attribute(step_sizes_and_alphas=...)`
(captum==0.8.0, pinned; a test checks that alpha_power=1 gives its public riemann_middle exactly).
Input x gradient: Captum's InputXGradient, e * df/de at e, summed over h.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pandas as pd
import torch
from torch import nn

METHODS = ("integrated_gradients", "input_x_gradient")
COLUMNS = ("target_position", "target_token_id", "source_position", "method", "attribution", "logit_input",
           "logit_baseline")
IG_STEPS = 32
ALPHA_POWER = 4
# The stated bound of the completeness check: |sum IG - (f(e) - f(0))| <= COMPLETENESS_REL * |f(e) - f(0)|.
# Not derived (a Riemann sum's error needs the integrand's derivatives): what 32 steps with alpha_power=4
# reach on tiny_qwen2 with room (docs/attribution.md); a report check, never a failed run.
COMPLETENESS_REL = 0.05


def nodes(n_steps: int, alpha_power: int) -> tuple[list[float], list[float]]:
    """(weights, alphas): midpoints b_k = (k + 1/2) / n, a_k = b_k**p, weights p * b_k**(p - 1) / n."""
    if n_steps < 1 or alpha_power < 1:
        raise ValueError(f"n_steps={n_steps}, alpha_power={alpha_power}: both must be integers >= 1")
    b = (torch.arange(n_steps, dtype=torch.float64) + 0.5) / n_steps
    return (alpha_power * b ** (alpha_power - 1) / n_steps).tolist(), (b ** alpha_power).tolist()


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


def _logit_fn(model: nn.Module, position: int, token_id: int):
    keep = torch.tensor([position], device=model.get_input_embeddings().weight.device)
    # A copy goes in: a forward that scales inputs_embeds in place (CTRL's `*= sqrt(d_model)`) would otherwise
    # change the caller's embeddings, and refuses to on the leaf tensor Captum differentiates by.
    return lambda embeds: model(inputs_embeds=embeds.clone(), use_cache=False,
                                logits_to_keep=keep).logits[:, 0, token_id]


def attribute(model: nn.Module, input_ids: torch.Tensor, targets: Sequence[tuple[int, int]],
              n_steps: int = IG_STEPS, alpha_power: int = ALPHA_POWER) -> pd.DataFrame:
    """Per (target_position, target_token_id) in `targets`: each source position 0..target_position's
    attribution by each of METHODS, with the target's logit at the input and at the zero baseline.
    The model must be float32 (gradients of bf16 logits are too coarse to integrate)."""
    from captum.attr import InputXGradient, IntegratedGradients

    dtype = model.get_input_embeddings().weight.dtype
    if dtype != torch.float32:
        raise ValueError(f"input attribution runs in float32; the model is {dtype} (load it with dtype=float32)")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    T = input_ids.shape[1]
    weights, alphas = nodes(n_steps, alpha_power)
    model.eval()
    frames = []
    with _frozen(model):
        embeds = model.get_input_embeddings()(input_ids.to(model.get_input_embeddings().weight.device)).detach()
        baseline = torch.zeros_like(embeds)
        for position, token_id in targets:
            if not 0 <= position < T:
                raise ValueError(f"target position {position}: must be in [0, {T - 1}] for this {T}-token input")
            f = _logit_fn(model, position, int(token_id))
            with torch.no_grad():
                logit_input, logit_baseline = float(f(embeds)[0]), float(f(baseline)[0])
            (ig,) = IntegratedGradients(f)._attribute((embeds,), (baseline,), n_steps=n_steps,
                                                      step_sizes_and_alphas=(weights, alphas))
            ixg = InputXGradient(f).attribute(embeds.clone().requires_grad_(True))
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
