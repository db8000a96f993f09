"""Every artifact path, stated once.

Stage folders are fixed and untimestamped (`artifacts/<stage>/`); history lives in git and
`dvc exp`. dvc.yaml names the same folders as stage outputs, and a test keeps the two in
step. Functions take the repository root so nothing here touches the disk at import time.
"""

from __future__ import annotations

from pathlib import Path

ARTIFACTS = "artifacts"
MANIFEST = "manifest.json"
PARAMS = "params.yaml"
STAGING = ".nexttoken/staging"   # stage outputs are built here, then moved into place whole

# validate comes first: it refuses a bad params.yaml before DVC touches any other stage's outputs.
STAGES = ("validate", "prepare_model", "tokenize", "forward", "logits", "probs", "trajectories", "checks", "report")

# (stage, file name) of every data file a later stage or a user reads.
SOURCE = ("prepare_model", "source.json")
TOKENS = ("tokenize", "tokens.parquet")
TOKENIZE_SUMMARY = ("tokenize", "tokenize.json")
VOCAB = ("tokenize", "vocab.parquet")          # every output id of the model: piece, bytes, text
CAPTURE = ("forward", "capture.safetensors")
FORWARD_FACTS = ("forward", "facts.json")
LOGITS = ("logits", "logits.parquet")
TABLE = ("probs", "table.parquet")
FILTERED = ("probs", "filtered.parquet")
PROBS_SUMMARY = ("probs", "summary.json")
PROBS_METRICS = ("probs", "metrics.json")
PROBS_PROMPT_METRICS = ("probs", "prompt_metrics.parquet")   # per (prompt_id, temperature): the next-token figures
STEPS = ("trajectories", "steps.parquet")
STEP_LOGITS = ("trajectories", "step_logits.parquet")
TRAJECTORIES = ("trajectories", "trajectories.json")
TRAJECTORIES_METRICS = ("trajectories", "metrics.json")
# per (prompt_id, branch, kv_cache): loop, n-grams
TRAJECTORY_PROMPT_METRICS = ("trajectories", "prompt_metrics.parquet")
CHECKS = ("checks", "checks.parquet")
METRICS = ("checks", "metrics.json")
REPORT = ("report", "report.md")


def stage_dir(stage: str, root: Path | str = ".") -> Path:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")
    return Path(root) / ARTIFACTS / stage


def validated(stage: str, root: Path | str = ".") -> Path:
    """The validate stage's copy of what `stage` reads, resolved: the file DVC re-runs `stage` on."""
    return stage_dir("validate", root) / f"{stage}.json"


def artifact(item: tuple[str, str], root: Path | str = ".") -> Path:
    """Path of one artifact file, e.g. `artifact(TOKENS)`."""
    stage, name = item
    return stage_dir(stage, root) / name


def locate(item: tuple[str, str] | Path, root: Path | str = ".") -> Path:
    """An artifact item, or a path relative to the repository (e.g. a stage's folder), under root."""
    return artifact(item, root) if isinstance(item, tuple) else Path(root) / item


def manifest_path(stage: str, root: Path | str = ".") -> Path:
    return stage_dir(stage, root) / MANIFEST
