"""The one naming scheme of captured tensors (TransformerLens style), with no torch import.

`act_name("resid_pre", 3) -> "blocks.3.resid_pre"`. `pipeline.model.capture` records under
these names; the stages that only read a capture (logits, report) import them from here.
"""

from __future__ import annotations

GLOBAL_KINDS = ("embed", "pos_embed", "final_norm_out", "logits")
LAYER_KINDS = ("resid_pre", "attn_weights", "attn_out", "resid_mid", "mlp_out", "resid_post")
# Layer-0 internals, in the order they are computed.
# A family has the ones its pieces call for (`capture.capture_names`): a fused projection gives
# attn.qkv and the attention function's value input attn.value instead of attn.q / attn.k / attn.v.
ATTN_INTERNALS = ("ln1_out", "attn.q", "attn.k", "attn.v", "attn.qkv", "attn.q_norm_out", "attn.k_norm_out",
                  "attn.q_rot", "attn.k_rot", "attn.value", "attn.mask", "attn_weights", "attn.z")


def act_name(kind: str, layer: int | None = None) -> str:
    """The one naming function: `act_name("resid_pre", 3) -> "blocks.3.resid_pre"`."""
    if layer is None:
        if kind not in GLOBAL_KINDS:
            raise ValueError(f"{kind!r} is not a model-level activation; known: {GLOBAL_KINDS}")
        return kind
    if kind not in LAYER_KINDS and kind not in ATTN_INTERNALS:
        raise ValueError(f"{kind!r} is not a per-layer activation")
    return f"blocks.{layer}.{kind}"
