"""Which params.yaml keys each stage reads: stated once, here.

`dvc.yaml` lists the same keys under each stage's `params` (tests/unit/test_dvc_yaml.py keeps
the two in step), so changing a key re-runs exactly the stages that read it. Each stage
records `schema.subset(params, PARAMS[stage])` as its config, and `nexttoken audit`
compares that record with params.yaml.

The validate stage reads every section (DVC tracks the whole params.yaml for it) and writes,
for each stage that reads params, `resolved(params, stage, prompt)`: those keys with the prompt
resolved (a prompt file's text, or a prompt set's records) in place. Each such stage depends on
that file, so DVC re-runs it when what it reads changes (a prompt file's text or a set's records
included) and skips it otherwise.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import schema

PARAMS: dict[str, tuple[str, ...]] = {
    "validate": tuple(schema.SECTIONS),
    "prepare_model": ("model.name", "model.source", "model.trust_remote_code"),
    "tokenize": ("model.name", "model.tokenizer", "prompt"),
    "forward": ("model.name", "model.trust_remote_code", "capture"),
    "logits": (),           # everything it needs comes from the forward stage's artifacts
    # capture.kernels: every stage whose numbers depend on the CPU kernels (the FP64 softmax too)
    "probs": ("probs", "sampling.temperature", "sampling.top_k", "sampling.top_p", "capture.kernels"),
    "trajectories": ("model.name", "model.trust_remote_code", "capture.dtype", "capture.device",
                     "capture.attn_implementation", "capture.kernels", "sampling"),
    # the model's final norm and LM head, loaded as forward loaded them (same dtype, device, kernels)
    "lens": ("model.name", "model.trust_remote_code", "capture.dtype", "capture.device", "capture.attn_implementation",
             "capture.kernels", "lens"),
    "checks": ("model.name", "model.trust_remote_code", "model.tokenizer", "model.reference_figures", "prompt",
               "capture.dtype", "capture.device", "capture.attn_implementation", "capture.kernels", "probs",
               "sampling", "checks"),
    "report": ("report",),  # which prompt to detail; everything it shows comes from the artifacts
}
# The equivalence stage: the forward pass as recorded (capture), re-run under each variation.
PARAMS["equivalence"] = ("model.name", "model.trust_remote_code", "capture", "report.prompt_id", "equivalence")


def reads_prompt(stage: str) -> bool:
    """Whether the stage reads the prompt (and so the text of `prompt.file`, when that is set)."""
    return "prompt" in PARAMS[stage]


def validated_stages() -> list[str]:
    """The stages the validate stage writes a resolved config for: every other stage that reads params."""
    return [s for s, keys in PARAMS.items() if keys and s != "validate"]


def resolved(params: dict, stage: str, prompt: dict) -> dict:
    """What `stage` reads from params.yaml, with the prompt resolved (`prompt_set.resolved`: the text read
    from `prompt.file`, or a set's records) for the stages that read it."""
    out = schema.subset(params, PARAMS[stage])
    if reads_prompt(stage):
        out["prompt"] = {**out["prompt"], **prompt}
    return out



def diff_keys(a, b, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings (a recorded config and params.yaml)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in a or k not in b:
                out.append(key)
            else:
                out.extend(diff_keys(a[k], b[k], key))
        return out
    return [] if a == b and type(a) is type(b) else [prefix or "<root>"]


ABSENT = "<absent>"


def dotted(d: Any, key: str) -> Any:
    """d["a"]["b"] for key "a.b"; ABSENT where the path does not exist."""
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return ABSENT
        d = d[part]
    return d
