"""Seeded toys (`model.source.kind=tiny`): a model's weights from its family, sizes and seed alone.

Family qwen2 (`model=tiny_qwen2`, the tests' model) is `build`. Imports only torch and transformers,
so `bench/gpu_check.py` builds the very model the pipeline prepares (`sources.Tiny` saves it with the
tokenizer) on a machine that has nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def build(architecture: Mapping[str, Any], seed: int, eos_id: int):
    """A float32 Qwen2ForCausalLM: seeded random init, untied LM head ~ N(0, lm_head_std^2).

    A random init gives near-flat next-token distributions; a wider LM head makes a few
    candidates stand out, so sampling and top-p tests have something to select.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    arch = dict(architecture)
    lm_head_std = float(arch.pop("lm_head_std"))
    config = Qwen2Config(**arch, tie_word_embeddings=False, use_sliding_window=False,
                         bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, dtype="float32")
    # fork_rng: seed the init without leaving the caller's global RNG changed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std, generator=generator)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return model


# Per-family settings a toy of that family needs beyond the shared sizes: which layer types to
# mix, experts, and multipliers away from 1 (a check that ignored a multiplier of 1 would pass).
_FAMILY_EXTRAS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
                "attention_multiplier": 0.0625},
    "smollm3": {"no_rope_layers": [1, 0]},             # layer 0 with RoPE, layer 1 without (NoPE)
    # softcaps low enough to act on a toy's small scores (the defaults 50 / 30 round to a no-op in bf16)
    "gemma2": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "gpt2": {"n_inner": None},                          # set from intermediate_size below
}


def build_family(model_type: str, architecture: Mapping[str, Any], seed: int, eos_id: int):
    """A float32 seeded toy of any family in `families.TINY_FAMILIES`, the sizes of `architecture`.

    qwen2 is `build` itself (tiny_qwen2's numbers). Every other family starts from its own
    config class's defaults (`AutoConfig.for_model`), with the shared sizes, head_dim =
    hidden / heads, the tokenizer's special ids, and `_FAMILY_EXTRAS`. The init is the family's
    own, seeded; the LM head is widened as in `build` (for a tied head, the embedding with it).
    """
    if model_type == "qwen2":
        return build(architecture, seed, eos_id)
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    arch = dict(architecture)
    lm_head_std = float(arch.pop("lm_head_std"))
    arch.pop("rope_theta")          # each family's own default RoPE base (v5 keeps it in rope_parameters)
    config = AutoConfig.for_model(model_type)
    extras = dict(_FAMILY_EXTRAS.get(model_type, {}))
    if model_type == "gpt2":
        extras.update(n_inner=arch["intermediate_size"], n_positions=arch["max_position_embeddings"])
    values = {**arch, "head_dim": arch["hidden_size"] // arch["num_attention_heads"],
              "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, **extras}
    for key, value in values.items():
        if key == "rms_norm_eps":
            for eps in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"):
                if hasattr(config, eps):
                    setattr(config, eps, value)
        elif (hasattr(config, key) or key in extras) and _settable(config, key):
            setattr(config, key, value)
    for per_layer in ("layer_types", "no_rope_layers"):    # made for the default depth: cut to this one
        values_now = getattr(config, per_layer, None)
        if isinstance(values_now, list) and len(values_now) != config.num_hidden_layers:
            setattr(config, per_layer, values_now[:config.num_hidden_layers])
    if hasattr(config, "sliding_window") and "sliding_window" not in extras and config.sliding_window:
        config.sliding_window = 8     # shorter than the prompt, so the sliding mask is exercised
    config.dtype = "float32"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, lm_head_std, generator=generator)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return model


def _settable(config, key: str) -> bool:
    """False for a config attribute that is a read-only property (Falcon's head_dim: hidden / heads)."""
    prop = getattr(type(config), key, None)
    return not isinstance(prop, property) or prop.fset is not None
