"""Fixtures and helpers of the reliability suite: one tiny_qwen2 chain, copied per fault.

`chain_ws` is the session's `tiny_chain` (tests/conftest.py: run once, in fresh processes as
DVC would); tests that break something work on a copy of it. A fault must end with
exit status 2, one line on stderr naming the problem, no traceback, and artifacts/ and
params.yaml byte-identical (`snapshot`).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.store import paths, provenance
from tests.conftest import snapshot
from tests.helpers import validated


@pytest.fixture(scope="session")
def chain_ws(tiny_chain) -> Path:
    """tiny_qwen2 through trajectories: the session's `tiny_chain` (read-only: copy it with `copy_ws`)."""
    return tiny_chain


def link_copy(src: Path, dest: Path) -> Path:
    """copy_ws with hard links: fast, and safe where files are only ever replaced (stages swap whole
    folders; rewrite_weights writes a new file), never edited in place."""
    shutil.copytree(src, dest, symlinks=True, copy_function=os.link, ignore=shutil.ignore_patterns(".nexttoken"))
    return dest


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread for in-process stage runs: on a busy shared CPU two threads oversubscribe
    (2-3x slower). A workspace's runs and checks should all be made under the same setting."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rewrite_weights(ws: Path, edit: Callable[[dict], None]) -> None:
    """Edit the prepared model's weights in place (`edit(tensors)`), and record the new file as
    what prepare_model made: a different *model*, not a tampered artifact (which the stages
    refuse, see test_corrupt_artifacts.py)."""
    from safetensors.torch import load_file, save_file

    weights = ws / "artifacts/prepare_model/model.safetensors"
    tensors = load_file(str(weights))
    edit(tensors)
    weights.unlink()                   # a new inode: hard-linked copies keep the old file
    save_file(tensors, str(weights), metadata={"format": "pt"})
    manifest_path = paths.manifest_path("prepare_model", ws)
    manifest = json.loads(manifest_path.read_text())
    for out in manifest["outputs"]:
        if out["path"].endswith("model.safetensors"):
            out["sha256"] = provenance.sha256_file(weights)
    manifest_path.unlink()
    manifest_path.write_text(json.dumps(manifest, indent=2))


def is_data_file(rel: str) -> bool:
    """A data file under artifacts/: not a manifest (times, hosts, durations), not DVC's .gitignore,
    not the report (it renders those manifests)."""
    name = rel.rsplit("/", 1)[-1]
    return rel.startswith(paths.ARTIFACTS + "/") and name not in (paths.MANIFEST, ".gitignore") \
        and not rel.startswith(f"{paths.ARTIFACTS}/report/")


def data_hashes(root: Path) -> dict[str, str]:
    """sha256 of every data file under artifacts/."""
    return {k: v for k, v in snapshot(root).items() if is_data_file(k)}


def staging_left(root: Path) -> list[str]:
    d = root / paths.STAGING
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut a file to a fraction of its size (a new inode: hard-linked copies stay whole)."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[:int(len(data) * keep)])


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


def one_line_error(out: Outcome | object, *needles: str) -> str:
    """Exit status 2 and exactly one stderr line, no traceback, naming each needle; returns the line."""
    code = getattr(out, "code", getattr(out, "returncode", None))
    stderr = out.stderr.strip()
    assert code == 2, f"exit {code}, expected 2:\n{out.stdout}\n{stderr}"
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    return lines[0]


def run_stage_here(stage: str, ws: Path, monkeypatch) -> Outcome:
    """A stage's real entry point (`stage_main(STAGE, main)`) in this process, in ws.

    The same code path as `python -m stages.<stage>` without the 5-10 s of imports per
    run: for the many corrupt-artifact cases. A few run as real subprocesses as well. After validate
    (its refusal is the outcome then) when params.yaml or a prompt file changed since it ran, as
    `dvc repro` runs it first.
    """
    import importlib

    from pipeline.store.artifacts import stage_main
    module = importlib.import_module(f"stages.{stage}")
    monkeypatch.chdir(ws)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            if stage != "validate" and not validated.current(ws):    # as dvc repro runs validate first
                validate = importlib.import_module("stages.validate")
                stage_main(validate.STAGE, validate.main)
            stage_main(module.STAGE, module.main)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return Outcome(code, out.getvalue(), err.getvalue())


def python_env(**extra: str) -> dict[str, str]:
    """The environment a subprocess gets: this one, with the venv's bin first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra}
