"""How far one forward pass's logits are from another's: the equivalence matrix's figures.

Both sides are [positions, V] logits; each is cast to float64 (the variant's own dtype first:
a float32 row is compared as it was computed, not rounded to bf16). The top-p 0.9 kept set at
T = 1 is transformers' `TopPLogitsWarper`'s (what sampling applies at T = 1, top_k = 0: `sampling.warpers`),
run on all positions at once in float32; the KL divergence KL(recorded || variant) is FP64 at T = 1
(mean and max over the positions, and at the last one, the next token's: `kl_last`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pipeline.numerics.sampling import SamplingSettings, warpers

TOP_P = 0.9


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a ∩ b| / |a ∪ b| of two id sets (1.0 for two empty sets)."""
    sa, sb = set(a.tolist()), set(b.tolist())
    union = len(sa | sb)
    return 1.0 if union == 0 else len(sa & sb) / union


def kl_rows(recorded: torch.Tensor, variant: torch.Tensor) -> torch.Tensor:
    """KL(recorded || variant) per row at T = 1, FP64: sum p (log p - log q) over the full vocabulary."""
    logp = torch.log_softmax(recorded.double(), dim=-1)
    logq = torch.log_softmax(variant.double(), dim=-1)
    p = logp.exp()
    # p = 0 contributes 0 (the limit), also where log q is -inf
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def kept_sets(logits: torch.Tensor, top_p: float = TOP_P) -> list[np.ndarray]:
    """Per row of [P, V] logits, the ids top-p keeps at T = 1 (float32, as sampling sees them)."""
    scores = warpers(SamplingSettings(temperature=1.0, top_k=0, top_p=top_p))(None, logits.float().clone())
    return [torch.nonzero(torch.isfinite(r)).flatten().numpy() for r in scores]


def top1_changed(recorded: torch.Tensor, variant: torch.Tensor, positions: list[int]) -> list[int]:
    """The positions whose argmax id differs (ties: the lowest id, as torch.argmax)."""
    a, b = recorded.double().argmax(-1).tolist(), variant.double().argmax(-1).tolist()
    return [p for p, x, y in zip(positions, a, b) if x != y]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (a cast variant is never bit-identical to the record)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def compare(recorded: torch.Tensor, variant: torch.Tensor, positions: list[int], top_p: float = TOP_P) -> dict:
    """The figures of one variation against the record. recorded, variant: [len(positions), V]."""
    if recorded.ndim != 2 or tuple(recorded.shape) != tuple(variant.shape):
        raise ValueError(f"logits {list(recorded.shape)} vs {list(variant.shape)}: expected two equal [P, V]")
    diff = (recorded.double() - variant.double()).abs()
    # the kept set of the last position, the next token's (every position's: one sort of [P, V] per side, 25x the cost)
    (a,), (b,) = kept_sets(recorded[-1:], top_p), kept_sets(variant[-1:], top_p)
    kl = kl_rows(recorded, variant)
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "top1_changed": top1_changed(recorded, variant, positions),
        "kept_recorded": int(a.size),
        "kept_variant": int(b.size),
        "kept_jaccard": jaccard(a, b),
        "kept_recorded_ids": [int(i) for i in a],      # the two sets themselves, ascending ids (the explorer's)
        "kept_variant_ids": [int(i) for i in b],
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "kl_last": float(kl[-1]),          # the next token's (the last position's), beside the kept sets
        "bit_identical": same_bits(recorded, variant),
    }


def empty(reason: str) -> dict:
    """A variation that could not run here: NaN figures, the reason in `note`."""
    return {"max_abs_diff": math.nan, "mean_abs_diff": math.nan, "top1_changed": [], "kept_recorded": -1,
            "kept_variant": -1, "kept_recorded_ids": [], "kept_variant_ids": [], "kept_jaccard": math.nan,
            "kl_mean": math.nan,
            "kl_max": math.nan, "kl_last": math.nan, "bit_identical": False, "note": reason}
