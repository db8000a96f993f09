"""Interrupted stages: killed while writing capture.safetensors or logits.parquet, nothing is lost.

The tests' own hook (`tests/helpers/pause.py`, which wraps the writer before running the
stage) stops the writer halfway through the file; the test then kills the stage (SIGKILL: no clean-up at all;
SIGINT: Ctrl-C). artifacts/ must still hold the previous complete run, byte for byte; a
stale staging folder left by SIGKILL is removed by the next run of that stage, whose outputs
equal the uninterrupted ones. The same under DVC (`dvc status`, `dvc repro`) is in
test_dvc_faults.py (slow).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.store import artifacts, paths
from tests.conftest import copy_ws, run_module, snapshot
from tests.helpers import pause
from tests.reliability.conftest import data_hashes, staging_left

POINTS = pause.POINTS   # point -> (stage, the file being written, in the staging folder)


def start_paused(ws: Path, point: str, cmd: list[str] | None = None) -> tuple[subprocess.Popen, int]:
    """Start the stage (or cmd) with the writer set to pause at `point`; return it and the stage's pid."""
    env = pause.env(point, {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    return pause.start(cmd or [sys.executable, "-m", f"stages.{POINTS[point][0]}"], ws, env, point)


def partial_file(ws: Path, point: str, pid: int) -> Path:
    """The half-written file in the paused stage's staging folder (proof the kill is mid-write)."""
    stage, name = POINTS[point]
    found = sorted((ws / paths.STAGING / f"{stage}-{pid}").rglob(name))    # in its prompt's partition
    assert len(found) == 1 and found[0].stat().st_size > 0, f"no partial {name} in staging"
    return found[0]


def test_stale_staging_of_a_killed_run_is_removed_by_the_next_run(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    staging = tmp_path / paths.STAGING
    stale = [staging / f"forward-{dead.pid}", staging / f"forward-{dead.pid}.old"]
    kept = [staging / f"logits-{dead.pid}",             # another stage's: its own next run cleans it
            staging / f"forward-{os.getppid()}"]        # a live process's: maybe running right now
    for d in stale + kept:
        d.mkdir(parents=True)
        (d / "capture.safetensors").write_bytes(b"half")
    with artifacts.stage_run("forward", {}, tmp_path) as run:
        run.write_json("facts.json", {})
    assert [d for d in stale if d.exists()] == [] and all(d.exists() for d in kept)
    assert sorted(p.name for p in (tmp_path / "artifacts/forward").iterdir()) == ["facts.json", "manifest.json"]


@pytest.mark.parametrize("point,sig", [("forward.capture", signal.SIGKILL), ("logits.rows", signal.SIGINT)],
                         ids=["forward.capture-SIGKILL", "logits.rows-SIGINT"])
def test_killed_stage_leaves_the_previous_run_whole(chain_ws, tmp_path, point, sig):
    ws = copy_ws(chain_ws, tmp_path / "ws")
    stage = POINTS[point][0]
    before, data = snapshot(ws), data_hashes(ws)
    proc, pid = start_paused(ws, point)
    partial = partial_file(ws, point, pid)
    os.kill(pid, sig)
    _, stderr = proc.communicate(timeout=120)
    assert snapshot(ws) == before, "artifacts/ changed by an interrupted stage"
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "Traceback" not in stderr
        assert stderr.strip() == f"nexttoken {stage}: interrupted; nothing was written to artifacts/{stage}"
        assert staging_left(ws) == []
        return
    assert proc.returncode == -signal.SIGKILL and partial.exists(), stderr    # SIGKILL: no clean-up ran
    run_module(f"stages.{stage}", ws, check=True)                     # the next run of that stage
    assert staging_left(ws) == [] and data_hashes(ws) == data


def test_ctrl_c_while_a_stage_imports_is_one_line(chain_ws, tmp_path):
    """SIGINT while `python -m stages.forward` is still importing torch: one line, exit 130, no
    traceback (it was 34 lines): stages/__init__.py sets the handler before the heavy imports."""
    ws = copy_ws(chain_ws, tmp_path / "ws")
    before = snapshot(ws)
    env = pause.env("import.torch")
    proc, pid = pause.start([sys.executable, "-m", "stages.forward"], ws, env, "import.torch", timeout=120)
    assert pid == proc.pid                               # the stage process itself, importing
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr == "nexttoken forward: interrupted; nothing was written to artifacts/forward\n"
    assert snapshot(ws) == before and staging_left(ws) == []
