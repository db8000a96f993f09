"""Every stage, declared once: the params.yaml keys it reads, the earlier stages' artifacts it reads,
what it writes.

From these declarations: `dvc.yaml` is generated (`nexttoken dvc-yaml`, pipeline/tools/dvc_yaml.py; the
tests run its `--check`), with each stage's code dependencies found by reading the imports of its entry
point, `python -m stages.<name>` (stages/<name>.py: the function that does its work), so editing a
library module re-runs exactly the stages that import it. Each stage records
`schema.subset(params, PARAMS[stage])` as its config, and `nexttoken audit` compares that record with
params.yaml.

The validate stage reads every section (DVC tracks the whole params.yaml for it) and writes,
for each stage that reads params, `resolved(params, stage, prompt)`: those keys with the prompt
resolved (a prompt file's text, or a prompt set's records) in place. Each such stage depends on
that file, so DVC re-runs it when what it reads changes (a prompt file's text or a set's records
included) and skips it otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import schema
from pipeline.errors import UserError
from pipeline.store import paths, provenance


@dataclass(frozen=True)
class Stage:
    """One stage, declared once: what it reads of params.yaml, what it reads of the earlier stages'
    artifacts, what it writes. `python -m stages.<name>` is its entry point (stages/<name>.py, the function
    that does its work); the code it runs is found by reading that module's imports
    (`pipeline/tools/dvc_yaml.py`), so dvc.yaml, generated from these declarations, lists it without upkeep."""

    name: str
    params: tuple[str, ...]            # dotted params.yaml keys; () = none (all it needs is in the artifacts)
    reads: tuple[str, ...] = ()        # paths under artifacts/ (a stage folder, a set-level file, a dataset folder)
    writes: tuple[str, ...] = ()       # () = its whole folder; else the paths in it that DVC caches
    metrics: tuple[str, ...] = ()      # DVC metrics files in its folder (`dvc metrics show`, `dvc exp show`)
    also: tuple[str, ...] = ()         # other dependencies: repository paths or ${params} DVC resolves
    notes: tuple[tuple[str, str], ...] = ()    # (path, why): the comment dvc.yaml prints beside that path
    about: str = ""                    # the comment dvc.yaml prints above the stage


def _p(item: tuple[str, str]) -> str:
    """A per-prompt file's dataset folder, or a set-level file, as DVC names it."""
    return paths.dataset(item).as_posix() if item in paths.PER_PROMPT else paths.stage_dir(item[0]).joinpath(
        item[1]).as_posix()


def _dir(stage: str) -> str:
    return paths.stage_dir(stage).as_posix()


def _manifest(stage: str) -> str:
    return paths.manifest_path(stage).as_posix()


_TRAJECTORY_OUTS = (_p(paths.STEPS), _p(paths.STEP_LOGITS), _p(paths.TRAJECTORIES))
# Every stage in the order `dvc repro` runs them (each after the stages whose outputs it reads).
STAGES: tuple[Stage, ...] = (
    Stage("validate", tuple(schema.SECTIONS), also=(schema.PROMPT_DIR,),
          notes=((schema.PROMPT_DIR, "prompt.file and prompt.set live here; each stage depends on its own copy"),)),
    Stage("prepare_model", ("model.name", "model.source", "model.trust_remote_code"),
          also=("${model.source.files}",),
          notes=(("${model.source.files}", "the model's folder or GGUF file (an edited weight re-runs the chain)"),)),
    Stage("tokenize", ("model.name", "model.tokenizer", "prompt"), reads=(_dir("prepare_model"),)),
    Stage("forward", ("model.name", "model.trust_remote_code", "capture"),
          reads=(_dir("prepare_model"), _p(paths.TOKENS), _p(paths.TOKENIZE_SUMMARY))),
    # everything it needs comes from the forward stage's artifacts
    Stage("logits", (), reads=(_p(paths.SOURCE), _dir("forward"))),
    # capture.kernels: every stage whose numbers depend on the CPU kernels (the FP64 softmax too)
    Stage("probs", ("probs", "sampling.temperature", "sampling.top_k", "sampling.top_p", "capture.kernels"),
          reads=(_p(paths.LOGITS), _p(paths.VOCAB), _p(paths.TOKENIZE_SUMMARY)),
          writes=(_p(paths.TABLE), _p(paths.FILTERED), _p(paths.PROBS_SUMMARY), _p(paths.PROBS_PROMPT_METRICS),
                  _manifest("probs")),
          metrics=(_p(paths.PROBS_METRICS),),
          notes=((_p(paths.TOKENIZE_SUMMARY), "the prompt's id (prompt_metrics.parquet)"),)),
    Stage("trajectories", ("model.name", "model.trust_remote_code", "capture.dtype", "capture.device",
                           "capture.attn_implementation", "capture.kernels", "sampling"),
          reads=(_dir("prepare_model"), _p(paths.TOKENS), _p(paths.TOKENIZE_SUMMARY)),
          writes=(*_TRAJECTORY_OUTS, _p(paths.TRAJECTORY_PROMPT_METRICS), _manifest("trajectories")),
          metrics=(_p(paths.TRAJECTORIES_METRICS),)),
    Stage("equivalence", ("model.name", "model.trust_remote_code", "capture", "report.prompt_id", "equivalence"),
          reads=(_dir("prepare_model"), _p(paths.TOKENS), _p(paths.CAPTURE), _p(paths.FORWARD_FACTS),
                 *_TRAJECTORY_OUTS, _manifest("trajectories")),
          about="The forward pass re-run under each variation (sdpa, padded batch, dtype, threads, kernels) and "
                "the trajectories' kv-cache pairs, against the record; its own checks table "
                "(pipeline/checks/equivalence.py)."),
    # the model's final norm and LM head, loaded as forward loaded them (same dtype, device, kernels)
    Stage("lens", ("model.name", "model.trust_remote_code", "capture.dtype", "capture.device",
                   "capture.attn_implementation", "capture.kernels", "lens"),
          reads=(_dir("prepare_model"), _p(paths.CAPTURE), _p(paths.FORWARD_FACTS))),
    # the parts need a hooked forward pass of their own (the capture keeps no per-head context past layer 0)
    Stage("attribution", ("model.name", "model.trust_remote_code", "capture.dtype", "capture.device",
                          "capture.attn_implementation", "capture.kernels", "report.prompt_id", "attribution"),
          reads=(_dir("prepare_model"), _p(paths.TOKENS), _p(paths.CAPTURE), _p(paths.FORWARD_FACTS)),
          about="Why this token: each top-k candidate's logit split into the residual stream's parts, and the "
                "top-1's input attribution, for the chosen prompts; its own checks table "
                "(pipeline/checks/attribution.py)."),
    Stage("checks", ("model.name", "model.trust_remote_code", "model.tokenizer", "model.reference_figures", "prompt",
                     "capture.dtype", "capture.device", "capture.attn_implementation", "capture.kernels", "probs",
                     "sampling", "checks"),
          reads=(_dir("prepare_model"), _p(paths.TOKENS), _p(paths.TOKENIZE_SUMMARY), _p(paths.VOCAB),
                 _p(paths.CAPTURE), _p(paths.FORWARD_FACTS), _p(paths.LOGITS), _p(paths.TABLE), _p(paths.FILTERED),
                 _p(paths.PROBS_PROMPT_METRICS), *_TRAJECTORY_OUTS, _p(paths.TRAJECTORY_PROMPT_METRICS),
                 _p(paths.LENS), _p(paths.LENS_SUMMARY)),
          writes=(_p(paths.CHECKS), _manifest("checks")), metrics=(_p(paths.METRICS),),
          also=("pipeline/reference",),
          notes=(("pipeline/reference", "editing the reference figures re-runs the checks"),)),
    # which prompt to detail; everything it shows comes from the artifacts
    Stage("report", ("report",),
          reads=(_manifest("validate"), _p(paths.SOURCE), _manifest("prepare_model"), _dir("tokenize"),
                 _dir("forward"), _dir("logits"), _p(paths.PROBS_SUMMARY), _p(paths.FILTERED),
                 _p(paths.PROBS_PROMPT_METRICS), _manifest("probs"), _p(paths.STEPS), _p(paths.TRAJECTORIES),
                 _p(paths.TRAJECTORY_PROMPT_METRICS), _manifest("trajectories"), _dir("lens"), _p(paths.CHECKS),
                 _manifest("checks"), _p(paths.EQUIVALENCE), _p(paths.VARIANT_LOGITS), _manifest("equivalence"),
                 _manifest("attribution"), _p(paths.LOGIT_PARTS), _p(paths.INPUTS)),
          notes=((_manifest("validate"), "every stage's record: the report's Stages table"),
                 (_manifest("attribution"), "its row of the Stages table; why the split does not apply"),
                 (_p(paths.LOGIT_PARTS), "section 10 and the explorer's why step (report/attribution.py)"),
                 (_p(paths.EQUIVALENCE), "the matrix section (pipeline/report/equivalence.py)"),
                 (_p(paths.VARIANT_LOGITS), "the explorer's Equivalence panel"))),
)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
PARAMS: dict[str, tuple[str, ...]] = {s.name: s.params for s in STAGES}


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


# How the per-prompt stages run (serial, or on Ray): validate writes it beside the stages' configs, the
# stages read it, and no stage depends on it in DVC: where the work runs does not change its bytes.
EXECUTOR = "executor"


def recorded(stage: str, validated: dict) -> dict:
    """The params.yaml subset a stage's validated config came from (what its manifest records and
    `nexttoken audit` compares): the prompt as given, without its resolved text or records."""
    if not reads_prompt(stage):
        return validated
    prompt = {k: v for k, v in validated["prompt"].items() if k != "prompts"}
    if prompt.get("file") is not None or prompt.get("set") is not None:
        prompt["text"] = None
    return {**validated, "prompt": prompt}


class StageConfig:
    """What a stage reads of the config: the file validate wrote for it (artifacts/validate/<stage>.json),
    nothing else of params.yaml. `section(name)` is typed: the whole section where the stage declared it,
    else just the keys it declared (schema.load_part)."""

    def __init__(self, stage: str, validated: dict, root: Path | str = "."):
        self.stage, self.validated, self.root = stage, validated, Path(root)
        self.recorded = recorded(stage, validated)

    def section(self, name: str):
        return schema.load_part(self.recorded, name, self.root)

    def executor(self):
        """Where its per-prompt work runs (`executor`): read, never a DVC dependency."""
        return schema.parse(schema.SECTIONS[EXECUTOR], _read(paths.validated(EXECUTOR, self.root)), EXECUTOR)


def _read(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{file.as_posix()} not found: the validate stage writes it; run `dvc repro` "
                        f"(or `python -m stages.validate` first)") from None


def validated_params_sha256(root: Path | str = ".") -> str | None:
    """The sha256 of the params.yaml the validate stage last checked (its manifest's facts), None if none."""
    try:
        manifest = json.loads(paths.manifest_path("validate", root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (manifest.get("facts") or {}).get("params_sha256") if isinstance(manifest, dict) else None


def config(stage: str, root: Path | str = ".") -> StageConfig:
    """The stage's validated config (see StageConfig). A stage started by hand (or called in a process) after
    params.yaml changed would run the config validate checked before: refused in one line. Under DVC
    (`DVC_STAGE` set) DVC has run validate whenever a value of params.yaml changed; a byte change that
    changes no value (DVC's own rewrite of the file) must not stop the run there. Only the file's sha256 is
    read here, never its keys."""
    if not PARAMS[stage] or stage == "validate":
        raise ValueError(f"stage {stage} reads no validated config")
    if os.environ.get("DVC_STAGE"):
        return StageConfig(stage, _read(paths.validated(stage, root)), root)
    try:
        now = provenance.sha256_file(Path(root) / paths.PARAMS)
    except FileNotFoundError:
        now = None                      # no params.yaml (a test's bare folder): nothing to compare
    if now is not None and now != validated_params_sha256(root):
        raise UserError(f"params.yaml has changed since the validate stage checked it: run `dvc repro` (or "
                        f"`python -m stages.validate` first); a stage reads only the config validate wrote for it, "
                        f"{paths.validated(stage).as_posix()}")
    return StageConfig(stage, _read(paths.validated(stage, root)), root)
