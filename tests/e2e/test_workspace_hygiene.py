"""End to end: what a new user hit with DVC (issue 13), in one temporary clone run once.

A fresh clone's first run leaves git nothing DVC asks to add. A committed tiny_qwen2 run whose prompt
comes from a file under prompts/. Then, in order:
audit is clean and catches an edit of the prompt file (also under `--rev`, which reads the
committed file), and the checks stage names the stale input; a refused `dvc exp run` leaves
git status and every artifact as they were; a new file under prompts/ re-runs validate alone, which
leaves its outputs and so dvc.lock as they were;
a temperature change still skips forward; `dvc plots show` leaves nothing for git.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.store import paths, provenance
from tests.conftest import ON_CPU
from tests.helpers.worktree import clone_worktree, sh

pytestmark = pytest.mark.slow
PROMPT = "prompts/story.txt"
BASE = ("model=tiny_qwen2", ON_CPU, f"prompt.file={PROMPT}", "prompt.text=null")
EXP = [a for o in BASE for a in ("-S", o)]       # `dvc exp run` composes conf/ anew: repeat the run's overrides


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, str, list[str]]:
    """A fresh clone's first `dvc repro`: (the clone, DVC's output, `git status --porcelain` right after)."""
    repo = clone_worktree(tmp_path_factory.mktemp("hygiene"), decode_steps=4)
    (repo / PROMPT).write_text("Once upon a time, a model chose its next token.\n", encoding="utf-8")
    sh(repo, "nexttoken", "compose", *BASE)
    proc = sh(repo, "dvc", "repro")
    return repo, proc.stdout + proc.stderr, porcelain(repo)


@pytest.fixture(scope="module")
def clone(first_run) -> Path:
    repo = first_run[0]
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "tiny_qwen2 run on a prompt file")
    return repo


def artifact_hashes(repo: Path) -> dict[str, str]:
    return {p.relative_to(repo).as_posix(): provenance.sha256_file(p)
            for p in sorted((repo / paths.ARTIFACTS).rglob("*")) if p.is_file()}


def porcelain(repo: Path) -> list[str]:
    return sh(repo, "git", "status", "--porcelain").stdout.splitlines()


def test_a_fresh_run_leaves_git_nothing_to_add(first_run):
    """Issue 27: DVC asked to `git add artifacts/.gitignore artifacts/probs/.gitignore ... dvc.lock`. The
    .gitignore files are committed; dvc.lock, the run's record, DVC stages itself (core.autostage)."""
    _, out, status = first_run
    assert "git add" not in out and "autostage" not in out, out
    ours = {" M params.yaml", " M params.overrides.yaml", f"?? {PROMPT}"}      # this test's compose and prompt
    assert set(status) - ours == {"A  dvc.lock"}, status


def test_audit_is_clean_with_a_prompt_file_and_catches_its_edit(clone):
    for args in ((), ("--rev", "HEAD")):
        proc = sh(clone, "nexttoken", "audit", *args, check=False)
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1].startswith("verdict: CLEAN"), proc.stdout
    (clone / PROMPT).write_text("Edited after the run.\n", encoding="utf-8")
    try:
        proc = sh(clone, "nexttoken", "audit", check=False)
        assert proc.returncode == 1, proc.stdout
        assert f"FINDING [chain] tokenize read {PROMPT} with sha256 " in proc.stdout, proc.stdout
        assert "(edited after the run)" in proc.stdout
        rev = sh(clone, "nexttoken", "audit", "--rev", "HEAD", check=False)   # reads the committed file
        assert rev.returncode == 0, rev.stdout
        checks = sh(clone, "python", "-m", "stages.checks", check=False)      # the stale input, named
        assert checks.returncode == 2 and checks.stderr.count("\n") == 1, checks.stderr
        assert f"is stale: stage tokenize read {PROMPT} (sha256 " in checks.stderr
        assert "re-run tokenize and the stages after it (`dvc repro`)" in checks.stderr
        # issue 50: a stage of a run that started and failed marks the report, and its line says where it is
        assert "; the last good report, of an earlier run (git commit " in checks.stderr
        assert (clone / "artifacts/report/report.md").read_text(encoding="utf-8").startswith("> **Stale report:**")
    finally:
        sh(clone, "git", "checkout", "--", PROMPT)
        sh(clone, "dvc", "checkout", "--force", "artifacts/report")    # the run's own report back, for the tests below


def test_a_refused_exp_run_leaves_the_workspace_as_it_was(clone):
    before = artifact_hashes(clone)
    proc = sh(clone, "dvc", "exp", "run", *EXP, "-S", "sampling.top_p=2", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    ours = [line for line in out.splitlines() if line.startswith("nexttoken ")]
    assert ours == ["nexttoken validate: error: sampling.top_p=2 is not allowed: a number in (0.0, 1.0]"], out
    assert "Running stage 'prepare_model'" not in out and "Running stage 'probs'" not in out
    assert porcelain(clone) == [" M params.yaml"]          # no deleted .gitignore, no untracked output
    assert artifact_hashes(clone) == before
    sh(clone, "git", "checkout", "--", "params.yaml")


def test_a_new_prompt_file_reruns_validate_alone(clone):
    """... and validate, re-run with nothing it writes changed, leaves its folder byte for byte, so once the file
    is gone again dvc.lock is the committed one (issue 50: its manifest's times made dvc.lock modified)."""
    before = {k: v for k, v in artifact_hashes(clone).items() if k.startswith("artifacts/validate/")}
    (clone / "prompts/unused.txt").write_text("a prompt nobody uses\n", encoding="utf-8")
    status = sh(clone, "dvc", "status").stdout
    assert "validate:" in status and "tokenize:" not in status and "checks:" not in status, status
    out = sh(clone, "dvc", "repro").stdout
    assert "Running stage 'validate'" in out
    for stage in ("tokenize", "checks"):
        assert f"Stage '{stage}' didn't change, skipping" in out, out
    assert {k: v for k, v in artifact_hashes(clone).items() if k.startswith("artifacts/validate/")} == before
    (clone / "prompts/unused.txt").unlink()
    sh(clone, "dvc", "repro")
    assert not [line for line in porcelain(clone) if line.endswith("dvc.lock")], porcelain(clone)
    sh(clone, "git", "checkout", "--", ".")


def test_a_temperature_change_still_skips_forward(clone):
    out = sh(clone, "dvc", "exp", "run", *EXP, "-S", "sampling.temperature=0.5").stdout
    assert "Running stage 'validate'" in out
    for skipped in ("prepare_model", "tokenize", "forward", "logits", "lens"):
        assert f"Stage '{skipped}' didn't change, skipping" in out, out
    assert "Running stage 'probs'" in out
    assert not [line for line in porcelain(clone) if line.startswith(("??", " D"))], porcelain(clone)


def test_dvc_plots_show_leaves_nothing_for_git(clone):
    sh(clone, "dvc", "plots", "show")
    assert (clone / "dvc_plots/index.html").is_file()
    assert not [line for line in porcelain(clone) if "dvc_plots" in line]
