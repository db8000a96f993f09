"""A candidate's logit as a sum of residual-stream parts: the FP64 arithmetic, on tensors only.

The residual stream entering the final norm is a sum of parts x = sum_c x_c (the embeddings,
each attention head, each MLP; `pipeline.model.logit_parts` records them). The final norm is
linear once its scale is frozen at the recorded value s = sqrt(mean(x^2) + eps) of the whole
stream, so the logit of token t splits exactly:

    logit_t = W_t . (x / s * g) + b_t = sum_c W_t . (x_c / s * g) + b_t        (g: the norm's gain)

and a final softcap cap * tanh(z / cap) adds one more part, softcap(z) - z. The sum check
compares the parts' sum with the logit recomputed in FP64 from the recorded final norm output,
a second derivation that never uses s: a part folded without the gain, or normalised by its own
rms instead of the frozen s, fails it. The stream's bound is a first-order rounding bound in the
model's dtype (`unit_roundoff`, `residual_bound`); the sum check's bound is the measured stream gap
and the final norm's own rounding, through the head (`logit_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

# Matmuls in a lower dtype are assumed to accumulate in float32 (the CPU kernels do; on CUDA, torch's
# allow_bf16_reduced_precision_reduction may reduce in bf16, beyond this bound).
ACCUMULATE = torch.float32


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: a value rounded to `dtype` is within u * |value| (bf16 2**-8, fp16 2**-11, fp32 2**-24)."""
    return torch.finfo(dtype).eps / 2


def frozen_scale(resid: torch.Tensor, eps: float) -> torch.Tensor:
    """[P, 1]: the rms norm's scale sqrt(mean(x^2) + eps) of the recorded stream [P, H], in FP64."""
    x = resid.double()
    return torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def norm_gain(weight: torch.Tensor, formula: str) -> torch.Tensor:
    """[H] FP64: what multiplies x / s in the norm: w ("rms") or 1 + w ("rms_plus_one": Gemma)."""
    if formula == "rms":
        return weight.double()
    if formula == "rms_plus_one":
        return 1.0 + weight.double()
    raise ValueError(f"norm formula {formula!r}: a frozen-scale split needs 'rms' or 'rms_plus_one'")


def normalise(part: torch.Tensor, scale: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """One part [..., P, H] through a norm whose scale is frozen: part / s * g (linear in the part)."""
    return part / scale * gain


def softcap_part(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(z / cap) - z: what a final softcap adds to the pre-cap logit z (0 without one)."""
    return torch.zeros_like(z) if cap is None else torch.tanh(z / cap) * cap - z


def fold(parts: torch.Tensor, scale: torch.Tensor, gain: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[C, K] contributions of C parts [C, H] at one position (frozen scale [1]) to K head rows [K, H]."""
    return normalise(parts, scale, gain) @ rows.double().T


def residual_bound(dtype: torch.dtype, partial_abs: torch.Tensor, attn_abs: torch.Tensor, attn_mac: torch.Tensor,
                   inner: int) -> torch.Tensor:
    """[P, H]: how far the FP64 sum of the parts may be from the recorded stream, to first order.

    `partial_abs`: the sum, over the residual adds, of |the stream after the add| (each add rounds it
    once: u |x|); `attn_abs`: the sum over layers of |attention output| as added, rounded once by
    o_proj and once more by a norm after it, where there is one (2 u); `attn_mac`: the sum over
    layers of |W_o| |z| + |b| (times |g| / s after a norm), o_proj's `inner` products accumulated in
    ACCUMULATE at worst (inner * u_acc). The MLP parts and the embeddings are the recorded tensors
    themselves. Doubled for the second-order terms and the float32 steps inside the norms.
    """
    u = unit_roundoff(dtype)
    u_acc = min(u, unit_roundoff(ACCUMULATE))
    return 2 * (u * partial_abs + 2 * u * attn_abs + inner * u_acc * attn_mac)


def logit_bound(dtype: torch.dtype, resid_gap: torch.Tensor, scale: torch.Tensor, gain: torch.Tensor,
                norm_out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[P, K]: how far the parts' sum may be from the FP64 logit of the recorded norm output f.

    Two differences, each mapped to a logit by a head row as |W_t| . |e| (a softcap's slope is at
    most 1, so the bound holds after it too):
    - the parts' stream is off the recorded one by `resid_gap` = |sum of parts - x| (measured; that
      it is rounding is `residual_check`'s business), which the frozen norm scales by |g| / s;
    - f is x / s * g as the model's norm computed it: in float32 (HF's RMSNorms upcast), 1 / s off
      by (H / 2 + 2) u32 at worst (mean of H squares, sqrt, rsqrt), then rounded to `dtype` at most
      twice (the normalised value, its product with the gain), and the float32 steps between them:
      4 u |f| covers the roundings with room for the second-order terms.
    Using the measured stream gap, not its worst case, keeps the bound below what a wrong fold
    changes on a real bf16 model (gemma3_270m: the worst case alone exceeded its logits).
    """
    u, u32, hidden = unit_roundoff(dtype), unit_roundoff(torch.float32), norm_out.shape[-1]
    per_dim = resid_gap * gain.abs() / scale + (4 * u + (hidden / 2 + 2) * u32) * norm_out.double().abs()
    return per_dim @ rows.double().abs().T


@dataclass(frozen=True)
class Gap:
    """A check's figure: the |difference| that is worst relative to its own bound, that bound, where it is,
    and the largest |difference| anywhere (`largest`, which may sit under a larger bound)."""

    measured: float
    bound: float
    where: str
    largest: float = float("nan")

    @property
    def passed(self) -> bool:
        return self.measured <= self.bound


def worst(gap: torch.Tensor, bound: torch.Tensor) -> tuple[tuple[int, ...], float, float]:
    """(index, gap, bound) where gap / bound is largest (a zero bound counts as the smallest positive)."""
    ratio = gap / bound.clamp_min(torch.finfo(torch.float64).tiny)
    index = tuple(int(i) for i in np.unravel_index(int(torch.argmax(ratio)), tuple(ratio.shape)))
    return index, float(gap[index]), float(bound[index])


def sum_check(parts: pd.DataFrame) -> Gap:
    """Per (position, token_id) of a parts table: |sum of contributions - logit_fp64| against `bound`."""
    per = parts.groupby(["position", "token_id"], sort=True).agg(
        total=("contribution", "sum"), logit_fp64=("logit_fp64", "first"), bound=("bound", "first"))
    gap = torch.tensor((per["total"] - per["logit_fp64"]).abs().to_numpy())
    (i,), measured, bound = worst(gap, torch.tensor(per["bound"].to_numpy()))
    position, token_id = per.index[i]
    return Gap(measured, bound, f"position {position}, token_id {token_id}", float(gap.max()))
