"""Shared fixtures: the real conf/ composed and shrunk to the tiny model, temp workspaces.

Nothing loads at import time; model fixtures are session-scoped and read-only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Tests never reach the network, and git commits in temp clones need an identity.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for var, val in (("GIT_AUTHOR_NAME", "nexttoken tests"), ("GIT_AUTHOR_EMAIL", "tests@nexttoken.invalid"),
                 ("GIT_COMMITTER_NAME", "nexttoken tests"), ("GIT_COMMITTER_EMAIL", "tests@nexttoken.invalid")):
    os.environ.setdefault(var, val)


def run_module(module: str, cwd: Path, *args: str, check: bool = False, env: dict | None = None,
               timeout: int = 900) -> subprocess.CompletedProcess:
    """Run `python -m module` in cwd the way DVC runs a stage."""
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def make_workspace(dest: Path, overrides: list[str]) -> Path:
    """A directory with conf/ and a params.yaml composed from it (no git, no DVC)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "conf", dest / "conf", dirs_exist_ok=True)
    run_module("pipeline.tools.cli", dest, "compose", *overrides, check=True)
    return dest


@pytest.fixture(scope="session")
def tiny_workspace(tmp_path_factory) -> Path:
    """A workspace with tiny_qwen2 prepared and tokenized (read-only for tests)."""
    ws = make_workspace(tmp_path_factory.mktemp("tiny_ws"), ["model=tiny_qwen2"])
    for stage in ("prepare_model", "tokenize"):
        run_module(f"stages.{stage}", ws, check=True)
    return ws
