"""Every artifact path, stated once.

Stage folders are fixed and untimestamped (`artifacts/<stage>/`); history lives in git and
`dvc exp`. dvc.yaml names the same folders as stage outputs, and a test keeps the two in
step. Functions take the repository root so nothing here touches the disk at import time.

A run is a set of prompts (a single prompt is a set of one). A per-prompt file `<name>` of
stage S lives in a Hive-style partition, `artifacts/S/<stem>/prompt_id=<id>/<name>` (stem: the
name without its extension), so DuckDB, pyarrow.dataset, pandas and polars read the folder
`artifacts/S/<stem>` as one table with a `prompt_id` column taken from the path. Set-level
files (manifest.json, metrics.json, source.json, vocab.parquet, checks.parquet, report.md)
stay in the stage folder. docs/prompt_sets.md lists which file is which.
"""

from __future__ import annotations

from pathlib import Path

ARTIFACTS = "artifacts"
MANIFEST = "manifest.json"
PARAMS = "params.yaml"
STAGING = ".nexttoken/staging"   # stage outputs are built here, then moved into place whole

# validate comes first: it refuses a bad params.yaml before DVC touches any other stage's outputs.
# equivalence: after forward and trajectories (its kv_cache rows read their step logits), before the report.
STAGES = ("validate", "prepare_model", "tokenize", "forward", "logits", "probs", "trajectories", "equivalence", "lens",
          "attribution", "checks", "report")

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
LENS = ("lens", "lens.parquet")                  # per (layer, position): the top lens.top_k ids
LENS_SUMMARY = ("lens", "lens_summary.parquet")  # per (layer, position): entropy, the final top-1's rank, KL
# The attribution stage (why this token): per chosen prompt, at its last position (docs/attribution.md).
LOGIT_PARTS = ("attribution", "logit_parts.parquet")   # each top-k candidate's logit split into the stream's parts
INPUTS = ("attribution", "inputs.parquet")             # the top-1's attribution to each prompt token (IG, input x grad)
ATTRIBUTION_CHECKS = ("attribution", "checks.parquet")  # its own checks (set-level, the checks stage's schema)
CHECKS = ("checks", "checks.parquet")
METRICS = ("checks", "metrics.json")
REPORT = ("report", "report.md")
EXPLORER = ("report", "explorer.html")           # the detailed prompt's page; a set's others: explorer-<id>.html
EXPLORER_SHOT = ("report", "explorer.png")       # a screenshot of it, where a browser made one (tests, docs)

# The equivalence stage: per prompt, one row per variation; its own checks table (set-level).
EQUIVALENCE = ("equivalence", "equivalence.parquet")
EQUIVALENCE_CHECKS = ("equivalence", "checks.parquet")
# per prompt: each forward variation's own logits at the recorded positions (what the explorer's Equivalence tab shows)
VARIANT_LOGITS = ("equivalence", "variant_logits.parquet")

# One file per prompt: partitioned by prompt id (the rest are set-level, one per run).
PER_PROMPT = frozenset({TOKENS, TOKENIZE_SUMMARY, CAPTURE, FORWARD_FACTS, LOGITS, TABLE, FILTERED,
                        PROBS_SUMMARY, STEPS, STEP_LOGITS, TRAJECTORIES, LENS, LENS_SUMMARY, EQUIVALENCE,
                        VARIANT_LOGITS, LOGIT_PARTS, INPUTS})
PARTITION_KEY = "prompt_id"


def stage_dir(stage: str, root: Path | str = ".") -> Path:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")
    return Path(root) / ARTIFACTS / stage


def validated(stage: str, root: Path | str = ".") -> Path:
    """The validate stage's copy of what `stage` reads, resolved: the file DVC re-runs `stage` on."""
    return stage_dir("validate", root) / f"{stage}.json"


def artifact(item: tuple[str, str], root: Path | str = ".") -> Path:
    """Path of one set-level artifact file, e.g. `artifact(VOCAB)`; a per-prompt one is `partition`'s."""
    if item in PER_PROMPT:
        raise ValueError(f"{item[1]} is one file per prompt: paths.partition(item, prompt_id)")
    stage, name = item
    return stage_dir(stage, root) / name


def partition_rel(name: str, prompt_id: str) -> Path:
    """Where a per-prompt file sits inside its stage folder: `<stem>/prompt_id=<id>/<name>`."""
    if not prompt_id or "/" in prompt_id or "\\" in prompt_id or prompt_id in (".", ".."):
        raise ValueError(f"prompt id {prompt_id!r} cannot name a partition folder")   # ids are checked on reading
    return Path(Path(name).stem) / f"{PARTITION_KEY}={prompt_id}" / name


def partition(item: tuple[str, str], prompt_id: str, root: Path | str = ".") -> Path:
    """Path of one prompt's file, e.g. `partition(LOGITS, "q")` = artifacts/logits/logits/prompt_id=q/logits.parquet."""
    if item not in PER_PROMPT:
        raise ValueError(f"{item[1]} is one file per run: paths.artifact(item)")
    stage, name = item
    return stage_dir(stage, root) / partition_rel(name, prompt_id)


def dataset(item: tuple[str, str], root: Path | str = ".") -> Path:
    """The folder holding every prompt's partition of a per-prompt file (what a reader opens whole)."""
    if item not in PER_PROMPT:
        raise ValueError(f"{item[1]} is one file per run: paths.artifact(item)")
    return stage_dir(item[0], root) / Path(item[1]).stem


def prompt_ids(item: tuple[str, str], root: Path | str = ".") -> list[str]:
    """The prompt ids a dataset folder holds a partition for, sorted (none: the folder is missing)."""
    folder, prefix = dataset(item, root), f"{PARTITION_KEY}="
    if not folder.is_dir():
        return []
    return sorted(d.name.removeprefix(prefix) for d in folder.iterdir()
                  if d.is_dir() and d.name.startswith(prefix) and (d / item[1]).is_file())


def run_prompt_ids(root: Path | str = ".") -> list[str]:
    """The prompts a recorded run holds: its tokenize partitions, sorted (none: tokenize has not run)."""
    return prompt_ids(TOKENS, root)


def lookup(root: Path | str = "."):
    """A plain `(item, prompt_id=None) -> Path` lookup over a recorded run, recording nothing (what
    `StageRun.use` is to a stage): a per-prompt item names its prompt's partition, a set-level one
    its file (whatever prompt is named)."""
    def find(item: tuple[str, str] | Path, prompt_id: str | None = None) -> Path:
        return partition(item, prompt_id, root) if item in PER_PROMPT else locate(item, root)
    return find


def locate(item: tuple[str, str] | Path, root: Path | str = ".", prompt_id: str | None = None) -> Path:
    """An artifact item (a per-prompt one with its prompt id), or a path relative to the
    repository (e.g. a stage's folder), under root."""
    if not isinstance(item, tuple):
        return Path(root) / item
    return partition(item, prompt_id, root) if prompt_id is not None else artifact(item, root)


def manifest_path(stage: str, root: Path | str = ".") -> Path:
    return stage_dir(stage, root) / MANIFEST
