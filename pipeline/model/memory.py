"""Refuse a forward pass that cannot fit, before loading anything: estimate its peak memory.

From the model's config and weight headers alone (nothing loaded), for batch 1, T prompt
tokens, b bytes per value of the compute dtype:

- weights: every tensor of the snapshot in the compute dtype (`loader.weights_bytes`);
- eager attention, one layer at a time: scores, scaled, masked, float32 softmax and its cast
  back live together at worst: heads * T^2 * (4b + 4) bytes (12 in bf16), plus the T^2 mask;
- other activations: a few [T, hidden] and [T, intermediate] tensors;
- logits: [R, V] (R = T, or 1 with capture.positions=last);
- the capture (`capture.capture_names`): every kept tensor, exactly; on CUDA it is copied to
  the CPU as it is recorded, on the CPU it is the model's own tensors, kept. A model for one
  GPU loads on the CPU first (`loader.load_model`), so the CPU needs the larger of the two.

The compute device's share is compared with its free memory (CUDA: `torch.cuda.mem_get_info`,
summed over the GPUs a spread model uses; CPU: available RAM), the capture's with the CPU's.
The figures are an estimate (allocator slack and library temporaries come on top), meant to
stop the pass that would surely run out, with what to change, not to promise the rest fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.model import loader
from pipeline.model.capture import CaptureSpec
from pipeline.model.families import FAMILIES

GIB = 2**30


@dataclass(frozen=True)
class Estimate:
    """Peak bytes of one captured forward pass, by part."""

    tokens: int
    heads: int
    weights: int
    attention: int        # the eager attention of one layer (the mask included)
    activations: int
    logits: int           # the model's output, on the compute device
    captured: int         # what the capture keeps (on the CPU)
    attention_captured: int   # of which the stored attention weights
    logit_rows: int       # T, or 1 with capture.positions=last

    def on_device(self, device: torch.device) -> int:
        """Bytes the compute device holds at the peak (on the CPU the capture is held there too)."""
        work = self.weights + self.attention + self.activations
        return work + self.captured if device.type == "cpu" else work + self.logits


def estimate(snapshot: Path, dtype: torch.dtype, tokens: int, spec: CaptureSpec,
             trust_remote_code: bool = False) -> Estimate:
    cfg = loader.auto_config(snapshot, trust_remote_code).get_text_config()
    b = torch.empty((), dtype=dtype).element_size()
    t, layers, hidden = tokens, cfg.num_hidden_layers, cfg.hidden_size
    # GPT-2 and GPT-NeoX have no num_key_value_heads (every head has its own K/V) nor an
    # intermediate_size attribute (GPT-2: n_inner, None meaning 4 * hidden).
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    intermediate = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    rows = t if spec.positions == "all" else 1
    logits, mask = rows * cfg.vocab_size * b, t * t * b
    q, kv = t * heads * head_dim * b, t * kv_heads * head_dim * b          # one [T, heads, head_dim] tensor
    qk_norm = cfg.model_type in FAMILIES and FAMILIES[cfg.model_type].q_norm is not None
    stored_attention = len(spec.resolve_layers(layers)) * heads * t * t * b
    captured = (t * hidden * b * (3 + 5 * layers)      # embed, final_norm_out, layer 0's ln1_out; 5 per layer
                + 3 * q + 3 * kv                        # layer 0: q, q_rot, z; k, v, k_rot
                + (q + kv if qk_norm else 0)            # Gemma: q/k norm outputs
                + mask + stored_attention + logits + t * 8)   # the mask, attention weights, logits, input_ids
    return Estimate(
        tokens=t, heads=heads, weights=loader.weights_bytes(snapshot, dtype),
        attention=heads * t * t * (4 * b + 4) + mask,
        activations=t * (4 * hidden + 3 * intermediate) * b,
        logits=logits, captured=captured, attention_captured=stored_attention, logit_rows=rows)


def free_bytes(device: torch.device, spread: bool = False) -> int:
    """Free memory of the device (all visible GPUs when the model is spread over them)."""
    if device.type == "cuda":
        gpus = range(loader.gpu_count()) if spread else [device.index or 0]
        return sum(torch.cuda.mem_get_info(i)[0] for i in gpus)
    import psutil
    return psutil.virtual_memory().available


def guard(need: Estimate, device: torch.device, spread: bool = False, free=None) -> None:
    """Raise one line when the estimate exceeds the free memory of the device or of the CPU.

    free(device, spread) -> bytes: `free_bytes` unless given.
    """
    free, cpu = free or free_bytes, torch.device("cpu")
    # Off the CPU, the CPU holds the capture, and first the weights on one device (loaded there, then moved).
    on_cpu = need.captured if spread else max(need.captured, need.weights)
    places = [(device, need.on_device(device))] + ([] if device.type == "cpu" else [(cpu, on_cpu)])
    for place, size in places:
        have = free(place, spread)
        if size > have:
            raise UserError(_refusal(need, place, size, have, device, spread))


def _refusal(need: Estimate, place: torch.device, size: int, have: int, device: torch.device, spread: bool) -> str:
    t, holds_capture = need.tokens, place.type == "cpu"
    parts = {"capture": need.captured, "weights while loading": need.weights} if place.type != device.type else {
        "weights": need.weights, f"eager attention of one layer ({need.heads} heads x {t}^2)": need.attention,
        "logits": need.logits, "other activations": need.activations, **({"capture": need.captured}
                                                                           if holds_capture else {})}
    shown = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
    remedies = [f"capture.positions=last (logits: 1 row instead of {need.logit_rows})"] if need.logit_rows > 1 else []
    if holds_capture and need.attention_captured:
        remedies.append(f"fewer capture.attention_layers (their weights: {need.attention_captured / GIB:.2f} GiB)")
    remedies.append("a shorter prompt (attention grows with its square)")
    if device.type == "cuda" and not spread and (loader.gpu_count() > 1 or holds_capture and size == need.weights):
        remedies.append(f"capture.device={loader.SPREAD} (accelerate loads the weights straight onto the GPUs, "
                        f"{loader.gpu_count()} here)")
    return (f"not enough memory for the forward pass of this {t}-token prompt: it needs about {size / GIB:.2f} GiB "
            f"on {place} ({shown}) but {have / GIB:.2f} GiB are free: use " + ", or ".join(remedies))
