"""End to end: `dvc repro` and `dvc exp run` in a temporary git clone of this working tree.

The clone (tests/helpers/worktree.py) holds the tracked and untracked-but-not-ignored files (what a
commit of the current tree would hold), with its own git history and DVC cache, on tiny_qwen2.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.store import paths, provenance
from tests.helpers import shared
from tests.helpers.partitions import part
from tests.helpers.worktree import sh

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The run's baseline (a clone, `nexttoken compose model=tiny_qwen2`, `dvc repro`, committed), copied."""
    return shared.baseline_clone(tmp_path_factory.mktemp("clone") / "repo")


def test_repro_runs_every_stage_and_is_then_up_to_date(clone):
    lock = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    stages = list(yaml.safe_load((clone / "dvc.yaml").read_text())["stages"])
    assert set(lock) == set(stages)
    status = sh(clone, "dvc", "status")
    assert "up to date" in status.stdout
    again = sh(clone, "dvc", "repro")
    assert "didn't change, skipping" in again.stdout and "Running stage" not in again.stdout


def test_editing_two_library_modules_reruns_exactly_the_stages_that_import_them(clone):
    """dvc.yaml's code deps are found from the stages' imports (pipeline/tools/dvc_yaml.py): an edit of
    numerics/repetition.py (the loop detector: trajectories, the equivalence stage's decoding, the
    checks) and one of report/plots.py (the report's figures) leave exactly those stages out of date.
    The expected stages are stated here by hand, from reading the imports, not from the generator."""
    edited = {"pipeline/numerics/repetition.py": {"trajectories", "equivalence", "checks"},
              "pipeline/report/plots.py": {"report"}}
    try:
        for module in edited:
            with open(clone / module, "a", encoding="utf-8") as f:
                f.write("\n# an edit\n")
        status = json.loads(sh(clone, "dvc", "status", "--json").stdout)
        assert set(status) == set().union(*edited.values()), status
        for stage, changes in status.items():
            changed = {p for c in changes for p in (c.get("changed deps") or {}) if isinstance(c, dict)}
            assert changed == {m for m, stages in edited.items() if stage in stages}, (stage, changes)
    finally:
        sh(clone, "git", "checkout", "--", *edited)
    assert "up to date" in sh(clone, "dvc", "status").stdout


def test_verify_after_dvc_repro_is_identical_and_changes_nothing(clone):
    """`dvc repro`, then `nexttoken verify` (the workspace) and `--rev HEAD` (git + the DVC cache):
    every artifact identical, exit 0; DVC's own files beside the outputs (.gitignore) are not the run's."""
    before = sh(clone, "git", "status", "--porcelain").stdout
    for args in ((), ("--rev", "HEAD", "--stages", "forward", "probs")):
        proc = sh(clone, "nexttoken", "verify", *args)
        assert proc.stdout.rstrip().endswith("verdict: IDENTICAL: every re-run artifact is bit-identical"), proc.stdout
        assert "differs" not in proc.stdout
    assert sh(clone, "git", "status", "--porcelain").stdout == before
    assert "up to date" in sh(clone, "dvc", "status").stdout


def test_forced_tokenize_is_byte_identical(clone):
    path = part(paths.TOKENS, clone)
    before = provenance.sha256_file(path)
    sh(clone, "dvc", "repro", "--force", "--single-item", "tokenize")
    assert provenance.sha256_file(path) == before
    sh(clone, "git", "checkout", "--", ".")


def test_compose_check_detects_a_conf_change(clone):
    # params.yaml was composed for tiny_qwen2: in step with conf/ + the recorded overrides (make repro passes)
    assert sh(clone, "nexttoken", "compose", "--check").returncode == 0
    work = clone.parent / "check_copy"
    shutil.copytree(clone, work, ignore=shutil.ignore_patterns("artifacts", ".dvc"))
    sh(work, "nexttoken", "compose")
    assert sh(work, "nexttoken", "compose", "--check").returncode == 0
    conf = work / "conf/sampling/reference.yaml"
    conf.write_text(conf.read_text().replace("top_k: 0", "top_k: 7"))
    proc = sh(work, "nexttoken", "compose", "--check", check=False)
    assert proc.returncode == 1 and "sampling.top_k" in proc.stderr


def test_sampling_change_reruns_only_the_sampling_stages(clone):
    proc = sh(clone, "dvc", "exp", "run", "-S", "model=tiny_qwen2", "-S", "sampling.temperature=0.7")
    out = proc.stdout
    for skipped in ("prepare_model", "tokenize", "forward", "logits", "lens"):
        assert f"Stage '{skipped}' didn't change, skipping" in out, out
    for rerun in ("probs", "trajectories"):
        assert f"Running stage '{rerun}'" in out, out
    params = yaml.safe_load((clone / "params.yaml").read_text())
    assert params["sampling"]["temperature"] == 0.7 and params["model"]["name"] == "tiny_qwen2"


def test_exp_run_with_a_new_prompt_composes_and_runs(clone):
    # The override as the README and `nexttoken compose --prompt` give it: quoted for Hydra.
    sh(clone, "dvc", "exp", "run", "-S", "model=tiny_qwen2", "-S", "prompt.text='Hello world, it\\'s me!'")
    params = yaml.safe_load((clone / "params.yaml").read_text())
    assert params["prompt"]["text"] == "Hello world, it's me!"
    tokens = __import__("pyarrow.parquet", fromlist=["x"]).read_table(part(paths.TOKENS, clone))
    assert tokens.num_rows == 7   # "Hello", " world", ",", " it", "'s", " me", "!"


def test_bad_prompt_in_exp_run_fails_cleanly(clone):
    # The validate stage refuses it with one clear line before DVC removes any stage's outputs
    # (it used to be tokenize, after DVC had deleted artifacts/tokenize); DVC knows to re-run.
    before = sorted(p.name for p in (clone / "artifacts/tokenize").iterdir())
    proc = sh(clone, "dvc", "exp", "run", "-S", "model=tiny_qwen2", "-S", "prompt.text=' '", check=False)
    assert proc.returncode != 0
    assert "nexttoken validate: error: prompt.text=' ' is not allowed: a non-empty string" in proc.stdout + proc.stderr
    assert sorted(p.name for p in (clone / "artifacts/tokenize").iterdir()) == before
    staging = clone / ".nexttoken/staging"
    assert not staging.exists() or not any(staging.iterdir())
    assert "tokenize" in sh(clone, "dvc", "status").stdout


def test_compose_prompt_then_repro_names_the_prompt_in_the_report(clone):
    """Issue 13's acceptance: `nexttoken compose model=tiny_qwen2 --prompt "Hello! it's (me) = 🍕, ok"`
    composes, `dvc repro` runs it, and the report's title names that prompt (not the reference one's name,
    whose expected ids are not checked against it)."""
    text = "Hello! it's (me) = 🍕, ok"
    out = sh(clone, "nexttoken", "compose", "model=tiny_qwen2", "--prompt", text).stdout
    name = f"hello_it_s-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    assert f"prompt={name}" in out
    sh(clone, "dvc", "repro")
    title = (clone / "artifacts/report/report.md").read_text(encoding="utf-8").splitlines()[0]
    assert title == f'# Next-token report: tiny_qwen2 on prompt {name} ("{text}")'
    tok = json.loads(part(paths.TOKENIZE_SUMMARY, clone).read_text(encoding="utf-8"))
    assert tok["prompt"] == text and tok["expected_token_ids"] is None
    checks = pq.read_table(clone / "artifacts/checks/checks.parquet").to_pylist()
    assert "tokenizer_expected_ids" not in {c["name"] for c in checks}
    assert all(c["verdict"] == "pass" for c in checks if c["severity"] == "error")


def test_dvc_repro_on_a_set_runs_and_is_then_up_to_date(clone):
    """Issue 27's command on a set, `nexttoken compose model=tiny_qwen2 prompt.set=prompts/mine.jsonl && dvc repro`,
    through DVC itself (a set derives its full-vocabulary tables: DVC's outs must still exist, a5939b8); then
    nothing is out of date and `nexttoken verify` re-runs probs bit for bit."""
    records = [json.loads(line) for line in (clone / "prompts/concepts.jsonl").read_text(encoding="utf-8").splitlines()]
    (clone / "prompts/mine.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[:2]),
                                              encoding="utf-8")
    sh(clone, "nexttoken", "compose", "model=tiny_qwen2", "prompt.set=prompts/mine.jsonl")
    sh(clone, "dvc", "repro")
    assert paths.prompt_ids(paths.TOKENS, clone) == sorted(r["id"] for r in records[:2])
    assert "up to date" in sh(clone, "dvc", "status").stdout
    proc = sh(clone, "nexttoken", "verify", "--stages", "probs")
    assert proc.stdout.rstrip().endswith("verdict: IDENTICAL: every re-run artifact is bit-identical"), proc.stdout
    checks = pq.read_table(clone / "artifacts/checks/checks.parquet").to_pylist()
    assert {c["prompt_id"] for c in checks} >= {r["id"] for r in records[:2]}
    assert all(c["verdict"] == "pass" for c in checks if c["severity"] == "error")


def test_a_failed_run_leaves_no_report_that_looks_current(clone):
    """Issue 50: after a good run, a stage killed as the OOM killer kills (SIGKILL, no handler runs) leaves the
    report and every explorer page carrying a first line that names the run they belong to and the stage that
    started since; a stage failing with its own error says where that report is; a complete `dvc repro` brings
    the clean report back, and DVC is then up to date."""
    from pipeline.store.artifacts import STALE_HTML_ID, STALE_MD
    from tests.reliability.test_interrupted import start_paused

    folder = paths.stage_dir("report", clone)
    sh(clone, "dvc", "repro")                              # whatever an earlier test left: a good run first
    clean = {p.name: p.read_text(encoding="utf-8") for p in folder.iterdir() if p.suffix in (".md", ".html")}
    assert "report.md" in clean and "explorer.html" in clean and not clean["report.md"].startswith(STALE_MD)
    made_by = json.loads(paths.manifest_path("report", clone).read_text())["git"]["commit"][:12]

    proc, pid = start_paused(clone, "forward.capture", ["dvc", "repro", "--force", "--single-item", "forward"])
    os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    for name, text in clean.items():
        now = (folder / name).read_text(encoding="utf-8")
        if name == "report.md":
            first = now.splitlines()[0]
            assert first.startswith(STALE_MD) and "stage forward" in first and f"git commit {made_by}" in first
            assert "params.yaml sha256 " in first and now.endswith(text)         # the old report follows, whole
        else:
            body = text.index("<body>") + len("<body>")
            assert now.index(f'id="{STALE_HTML_ID}"') < body + 20 and now.count(STALE_HTML_ID) == 1, name
            assert "stage forward" in now and now.replace(now[body:now.index("</div>", body) + 6], "") == text

    failed = sh(clone, "python", "-m", "stages.logits", check=False)   # its input is gone: its own one line
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1, failed.stderr
    assert f"the last good report, of an earlier run (git commit {made_by}" in failed.stderr
    assert "is artifacts/report/report.md (marked stale)" in failed.stderr
    assert (folder / "report.md").read_text(encoding="utf-8").count(STALE_MD) == 1   # marked once

    sh(clone, "dvc", "repro")
    assert not any(STALE_MD in p.read_text(encoding="utf-8") or STALE_HTML_ID in p.read_text(encoding="utf-8")
                   for p in folder.iterdir() if p.suffix in (".md", ".html"))
    assert "up to date" in sh(clone, "dvc", "status").stdout
