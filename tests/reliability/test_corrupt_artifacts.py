"""Corrupt or foreign artifacts as a stage's input: a clear error naming the file, nothing lost.

Three layers, each tested on its own:
- the manifest: an input whose sha256 differs from what its producing stage's manifest
  recorded was not produced by that run (StageRun.use);
- the chain: an input that differs from the one another input was made from (a capture made
  from other tokens than the tokens.parquet beside it) comes from a different run;
- the reader: with no manifest to compare with, a truncated safetensors / Parquet / JSON
  file still gives one line naming it, and a capture with another run's facts.json is refused.
Each case runs the consuming stage's real entry point on a copy of a complete run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline.store import paths
from tests.conftest import copy_ws, snapshot
from tests.helpers import validated
from tests.helpers.partitions import part
from tests.reliability.conftest import one_line_error, python_env, run_stage_here, staging_left, truncate


def _no_manifest(ws: Path, stage: str) -> None:
    paths.manifest_path(stage, ws).unlink()


def _other_prompt(ws: Path, monkeypatch, tmp: Path) -> Path:
    """A copy of ws whose tokenize stage ran on another prompt (a complete, valid, foreign run)."""
    other = copy_ws(ws, tmp / "other")
    params = yaml.safe_load((other / paths.PARAMS).read_text())
    params["prompt"]["text"] = "Hello world"
    (other / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True))
    assert run_stage_here("tokenize", other, monkeypatch).code == 0
    return other


def _swap_in(ws: Path, other: Path, rel: str) -> None:
    (ws / rel).unlink()
    (ws / rel).write_bytes((other / rel).read_bytes())


def _swap_folder(ws: Path, other: Path, rel: str) -> None:
    shutil.rmtree(ws / rel)
    shutil.copytree(other / rel, ws / rel)


@dataclass(frozen=True)
class Corrupt:
    id: str
    stage: str                                      # the stage that reads the bad input
    damage: Callable[..., None]                     # (ws, monkeypatch, tmp_path) -> None
    needles: tuple[str, ...]


def _trunc(rel: str | tuple[str, str]) -> Callable[..., None]:
    return lambda ws, mp, tmp: truncate(_at(ws, rel))


def _trunc_no_manifest(rel: str | tuple[str, str], stage: str) -> Callable[..., None]:
    return lambda ws, mp, tmp: (truncate(_at(ws, rel)), _no_manifest(ws, stage))


def _at(ws: Path, rel: str | tuple[str, str]) -> Path:
    """A repository path, or a per-prompt item's partition (the run's one prompt)."""
    return part(rel, ws) if isinstance(rel, tuple) else ws / rel


PART = "/prompt_id=temperature_question/"       # the chain workspace's prompt


def _foreign_tokens(ws, mp, tmp):
    """Another prompt's tokens.parquet put in this prompt's partition."""
    mine, other = part(paths.TOKENS, ws), part(paths.TOKENS, _other_prompt(ws, mp, tmp))
    mine.unlink()
    mine.write_bytes(other.read_bytes())


def _foreign_tokenize_folder(ws, mp, tmp, params_too: bool = True):
    """tokenize's whole folder from a run on another prompt. params_too: params.yaml names that
    prompt too (so tokenize is not stale, and only forward's record of its tokens can tell)."""
    other = _other_prompt(ws, mp, tmp)
    _swap_folder(ws, other, paths.stage_dir("tokenize").as_posix())    # its partitions are the other prompt's
    if params_too:
        _swap_in(ws, other, paths.PARAMS)


def _foreign_facts(ws, mp, tmp):
    facts = json.loads(part(paths.FORWARD_FACTS, ws).read_text())
    facts["input_ids"] = facts["input_ids"][:-1] + [facts["input_ids"][-1] + 1]   # another prompt's ids
    part(paths.FORWARD_FACTS, ws).unlink()
    part(paths.FORWARD_FACTS, ws).write_text(json.dumps(facts))
    _no_manifest(ws, "forward")


def _bad_manifest(ws, mp, tmp):
    m = paths.manifest_path("forward", ws)
    m.unlink()
    m.write_text("{not json")


def _edited_model_config(ws, mp, tmp):
    cfg = ws / "artifacts/prepare_model/config.json"
    data = json.loads(cfg.read_text())
    data["rms_norm_eps"] = 1e-3           # still a valid config: only the manifest tells
    cfg.unlink()
    cfg.write_text(json.dumps(data))


CASES = [
    Corrupt("truncated capture.safetensors", "logits", _trunc(paths.CAPTURE),
            (f"artifacts/forward/capture{PART}capture.safetensors was not produced by the recorded run of stage "
             "forward", "re-run `dvc repro`")),
    Corrupt("truncated capture.safetensors, no manifest", "logits",
            _trunc_no_manifest(paths.CAPTURE, "forward"),
            (f"artifacts/forward/capture{PART}capture.safetensors is not a readable safetensors file "
             "(truncated or corrupt?)",)),
    Corrupt("truncated logits.parquet", "probs", _trunc(paths.LOGITS),
            (f"artifacts/logits/logits{PART}logits.parquet was not produced by the recorded run of stage logits",)),
    Corrupt("truncated logits.parquet, no manifest", "probs",
            _trunc_no_manifest(paths.LOGITS, "logits"),
            (f"artifacts/logits/logits{PART}logits.parquet is not a readable Parquet file (truncated or corrupt?)",)),
    Corrupt("truncated vocab.parquet, no manifest", "probs",
            _trunc_no_manifest("artifacts/tokenize/vocab.parquet", "tokenize"),
            ("artifacts/tokenize/vocab.parquet is not a readable Parquet file",)),
    Corrupt("truncated tokens.parquet", "forward", _trunc(paths.TOKENS),
            (f"artifacts/tokenize/tokens{PART}tokens.parquet was not produced by the recorded run of stage tokenize",)),
    Corrupt("truncated tokens.parquet, no manifest", "trajectories",
            _trunc_no_manifest(paths.TOKENS, "tokenize"),
            (f"artifacts/tokenize/tokens{PART}tokens.parquet is not a readable Parquet file",)),
    Corrupt("truncated source.json, no manifest", "tokenize",
            _trunc_no_manifest("artifacts/prepare_model/source.json", "prepare_model"),
            ("artifacts/prepare_model/source.json is not valid JSON",)),
    Corrupt("edited model config.json", "forward", _edited_model_config,
            ("artifacts/prepare_model/config.json was not produced by the recorded run of stage prepare_model",)),
    Corrupt("truncated model config.json, no manifest", "forward",
            _trunc_no_manifest("artifacts/prepare_model/config.json", "prepare_model"),
            ("artifacts/prepare_model/config.json is not a readable model config",)),
    Corrupt("tokens.parquet of another prompt", "forward", _foreign_tokens,
            (f"artifacts/tokenize/tokens{PART}tokens.parquet was not produced by the recorded run of stage tokenize",)),
    # another prompt is another partition: forward holds none for it (issue 17's layout)
    Corrupt("whole tokenize run of another prompt, forward of this one", "checks", _foreign_tokenize_folder,
            ("input artifacts/forward/facts/prompt_id=hello_world-", "/facts.json is missing")),
    Corrupt("whole tokenize run of another prompt than params.yaml's", "checks",
            lambda ws, mp, tmp: _foreign_tokenize_folder(ws, mp, tmp, params_too=False),
            ("artifacts/tokenize/tokens/prompt_id=hello_world-", "tokens.parquet is stale: stage tokenize ran with "
             "prompt.text='Hello world', params.yaml has ", "re-run tokenize and the stages after it (`dvc repro`)")),
    Corrupt("facts.json of another run beside this capture, no manifest", "logits", _foreign_facts,
            ("capture.safetensors and", "facts.json come from different runs")),
    Corrupt("corrupt forward manifest.json", "logits", _bad_manifest,
            ("artifacts/forward/manifest.json is not valid JSON",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_corrupt_or_foreign_input_is_named(case, chain_ws, tmp_path, monkeypatch):
    ws = copy_ws(chain_ws, tmp_path / "ws")
    case.damage(ws, monkeypatch, tmp_path)
    if not validated.current(ws):        # a damage that edits params.yaml: validate first, as dvc repro runs it
        assert run_stage_here("validate", ws, monkeypatch).code == 0
    before = snapshot(ws)
    out = run_stage_here(case.stage, ws, monkeypatch)
    one_line_error(out, f"nexttoken {case.stage}: error: ", *case.needles)
    assert snapshot(ws) == before and staging_left(ws) == []


def test_intact_copy_runs(chain_ws, tmp_path, monkeypatch):
    """The control: the same copy, undamaged, runs every consuming stage (so the cases test the damage)."""
    ws = copy_ws(chain_ws, tmp_path / "ws")
    for stage in ("logits", "probs"):
        out = run_stage_here(stage, ws, monkeypatch)
        assert out.code == 0, out.stderr


def test_audit_flags_a_truncated_artifact(chain_ws, tmp_path):
    ws = copy_ws(chain_ws, tmp_path / "ws")
    truncate(part(paths.LOGITS, ws))
    proc = subprocess.run(["nexttoken", "audit"], cwd=ws, capture_output=True, text=True, timeout=600,
                          env=python_env())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"artifacts/logits/logits{PART}logits.parquet" in proc.stdout, proc.stdout
