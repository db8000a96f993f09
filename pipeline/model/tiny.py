"""The seeded toy Qwen2 (`model=tiny_qwen2`): its weights from the architecture and the seed alone.

Imports only torch and transformers, so `bench/gpu_check.py` builds the very model the
pipeline prepares (`snapshot` saves it with the tokenizer) on a machine that has nothing else.
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
