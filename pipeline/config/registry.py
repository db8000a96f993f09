"""Which params.yaml keys each stage reads: stated once, here.

`dvc.yaml` lists the same keys under each stage's `params` (tests/unit/test_dvc_yaml.py keeps
the two in step), so changing a key re-runs exactly the stages that read it. Each stage
records `schema.subset(params, PARAMS[stage])` as its config, and `nexttoken audit`
compares that record with params.yaml.
"""

from __future__ import annotations

PARAMS: dict[str, tuple[str, ...]] = {
    "prepare_model": ("model.name", "model.source", "model.trust_remote_code"),
    "tokenize": ("model.name", "model.tokenizer", "prompt"),
    "forward": ("model.name", "model.trust_remote_code", "capture"),
    "logits": (),           # everything it needs comes from the forward stage's artifacts
    # capture.kernels: every stage whose numbers depend on the CPU kernels (the FP64 softmax too)
    "probs": ("probs", "sampling.temperature", "sampling.top_k", "sampling.top_p", "capture.kernels"),
    "trajectories": ("model.name", "model.trust_remote_code", "capture.dtype", "capture.device",
                     "capture.attn_implementation", "capture.kernels", "sampling"),
    "checks": ("model.name", "model.trust_remote_code", "model.tokenizer", "model.reference_figures", "prompt",
               "capture.dtype", "capture.device", "capture.attn_implementation", "capture.kernels", "probs",
               "sampling", "checks"),
    "report": (),           # everything it shows comes from the artifacts (and their manifests)
}


def reads_prompt(stage: str) -> bool:
    """Whether the stage reads the prompt (and so depends on the prompt files under prompts/)."""
    return "prompt" in PARAMS[stage]
