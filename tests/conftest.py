"""Shared fixtures: the real conf/ composed and shrunk to the tiny model, temp workspaces.

Nothing loads at import time. The two workspace fixtures are built once per run (for every xdist worker:
tests/helpers/shared.py), in fresh processes as DVC would run the stages, and are read-only: `tiny_workspace`
(prepare_model, tokenize) and `tiny_chain` (a copy of it, run through lens). A test
that runs a stage or changes a file works on its own copy (`copy_ws`); each fixture checks
at the end of the session that nobody wrote into it, so what a test sees never depends on
which tests ran before it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.store import paths, provenance
from tests.helpers import shared, validated

REPO = Path(__file__).resolve().parents[1]
CHAIN = ("forward", "logits", "probs", "trajectories", "lens")

# Tests never reach the network, and git commits in temp clones need an identity.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for var, val in (("GIT_AUTHOR_NAME", "nexttoken tests"), ("GIT_AUTHOR_EMAIL", "tests@nexttoken.invalid"),
                 ("GIT_COMMITTER_NAME", "nexttoken tests"), ("GIT_COMMITTER_EMAIL", "tests@nexttoken.invalid")):
    os.environ.setdefault(var, val)


# ---------------------------------------------------------------- the suite's disk (issue 50)
# A whole-suite run writes GBs of clones, workspaces and DVC caches under pytest's basetemp. What
# outlives it: pytest keeps a failing test's folder (pyproject: tmp_path_retention_policy = "failed",
# count 1, so one run's at most); a passing test's tmp_path goes when it ends, and a module-scoped
# fixture's folders (below) when its module's tests are done. DVC's per-repository site cache (state
# and index databases, one folder per clone: /var/tmp/dvc by default) goes under one folder that the
# run removes at its end.
# The folder is this run's own (made by the process that starts the run; its xdist workers inherit it), so
# a second run beside it keeps its databases when the first removes its folder.
_OWN_SITE_CACHE = None
if "DVC_SITE_CACHE_DIR" not in os.environ:
    _OWN_SITE_CACHE = os.environ["DVC_SITE_CACHE_DIR"] = tempfile.mkdtemp(prefix="nexttoken-tests-dvc-site-")
# What the files share, built once per run (tests/helpers/shared.py: the dvc repro'd baseline clone, the prepared
# gemma3_270m), in a folder of this run's own, made and removed the same way.
_OWN_SHARED = None
if shared.ENV not in os.environ:
    _OWN_SHARED = os.environ[shared.ENV] = tempfile.mkdtemp(prefix="nexttoken-tests-shared-")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A module-scoped fixture's folders under basetemp (made by tmp_path_factory.mktemp while it was set
    up) are removed at its teardown, unless a test failed meanwhile: a module's clones do not pile up
    for the rest of the session. Session fixtures (tiny_workspace, tiny_chain) stay: they are shared."""
    if fixturedef.scope != "module":
        return (yield)
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    before, failed, made = set(base.iterdir()), request.session.testsfailed, set()

    def remove():
        if request.session.testsfailed == failed:
            for folder in made:
                shutil.rmtree(folder, ignore_errors=True)
    fixturedef.addfinalizer(remove)     # first: finalizers run last-in first-out, so after the fixture's own
    try:
        return (yield)
    finally:
        made.update(set(base.iterdir()) - before)


def pytest_sessionfinish(session):
    if _OWN_SITE_CACHE:     # the process that made it: the controller, after its workers (or -n 0's one process)
        shutil.rmtree(_OWN_SITE_CACHE, ignore_errors=True)
    if _OWN_SHARED:
        shutil.rmtree(_OWN_SHARED, ignore_errors=True)


@pytest.fixture(autouse=True)
def _process_state_restored():
    """What a test changes in this process's environment variables, working directory and torch thread count
    is put back after it. `make test` runs the files on pytest-xdist workers in an order that varies from run
    to run, so a leak would make a later test's result depend on which file ran before it in the same
    worker (a CUBLAS_WORKSPACE_CONFIG left behind showed up as a kernel-path difference in verify)."""
    env, cwd = dict(os.environ), os.getcwd()
    threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    yield
    for key in set(env) | set(os.environ):   # only what changed: threads of the test may still read the rest
        if key != "PYTEST_CURRENT_TEST" and os.environ.get(key) != env.get(key):
            if key in env:
                os.environ[key] = env[key]
            else:
                del os.environ[key]
    if os.getcwd() != cwd:
        os.chdir(cwd)
    if threads is not None and sys.modules["torch"].get_num_threads() != threads:
        sys.modules["torch"].set_num_threads(threads)


def run_module(module: str, cwd: Path, *args: str, check: bool = False, env: dict | None = None,
               timeout: int = 900) -> subprocess.CompletedProcess:
    """Run `python -m module` in cwd the way DVC runs a stage: after validate, when params.yaml or a prompt
    file changed since it last ran (tests/helpers/validated.py; its failure is the result then)."""
    if module.startswith("stages.") and module != "stages.validate":
        proc = validated.ensure(cwd, env, timeout)
        if proc is not None and proc.returncode != 0:
            if check:
                raise AssertionError(f"stages.validate failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            return proc
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# The tests compare the stages' numbers with models they load on the CPU, bit for bit: on a
# machine with a GPU, `capture.device: auto` would run the stages there. CUDA expectations
# live in the tests marked `gpu` (tests/integration/test_cuda.py).
ON_CPU = "capture.device=cpu"


# conf/'s 24 new tokens show gemma3_270m's continuation; the tests' chains decode 4 (the article's steps,
# every check the same), as each step costs the trajectories and checks stages a full-vocabulary pass.
TEST_STEPS = "sampling.max_new_tokens=4"


def make_workspace(dest: Path, overrides: list[str], device: str = "cpu") -> Path:
    """A directory with conf/ and a params.yaml composed from it (no git, no DVC), on `device`, decoding
    TEST_STEPS unless `overrides` say otherwise."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "conf", dest / "conf", dirs_exist_ok=True)
    run_module("pipeline.tools.cli", dest, "compose", f"capture.device={device}", TEST_STEPS, *overrides, check=True)
    return dest


def copy_ws(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".nexttoken"))
    return dest


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under artifacts/ and of params.yaml (what a failed run must not touch)."""
    files = [p for p in (root / paths.ARTIFACTS).rglob("*") if p.is_file()] + [root / paths.PARAMS]
    return {p.relative_to(root).as_posix(): provenance.sha256_file(p) for p in files if p.exists()}


def _read_only(ws: Path):
    before = snapshot(ws)
    yield ws
    assert snapshot(ws) == before, f"a test wrote into the read-only session workspace {ws}: copy it (copy_ws)"


def _build_tiny_workspace(folder: Path) -> None:
    ws = make_workspace(folder / "ws", ["model=tiny_qwen2"])
    for stage in ("prepare_model", "tokenize"):
        run_module(f"stages.{stage}", ws, check=True)


def _build_tiny_chain(folder: Path) -> None:
    ws = copy_ws(shared.once("tiny_workspace", _build_tiny_workspace) / "ws", folder / "ws")
    for stage in CHAIN:
        run_module(f"stages.{stage}", ws, check=True)


@pytest.fixture(scope="session")
def tiny_workspace() -> Path:
    """A workspace with tiny_qwen2 prepared and tokenized (read-only; built once per run, for every worker:
    tests/helpers/shared.py)."""
    yield from _read_only(shared.once("tiny_workspace", _build_tiny_workspace) / "ws")


@pytest.fixture(scope="session")
def tiny_chain(tiny_workspace) -> Path:
    """A copy of tiny_workspace with forward -> lens run once (read-only; built once per run)."""
    yield from _read_only(shared.once("tiny_chain", _build_tiny_chain) / "ws")
