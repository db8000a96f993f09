"""Pause a stage halfway through writing an artifact, so a test can kill it there.

`env(point)` is the environment that makes any Python process started with it (the stage
itself, or the stage `dvc repro` starts) run `tests/helpers/pause_site/sitecustomize.py`,
which wraps one writer; `marker(point, root)` is the file the paused process writes its id
to. The hook belongs to the tests: no production code reads it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ENV = "NEXTTOKEN_TEST_PAUSE"
SITE = Path(__file__).resolve().parent / "pause_site"
POINTS = {"forward.capture": ("forward", "capture.safetensors"), "logits.rows": ("logits", "logits.parquet")}


def env(point: str, base: dict[str, str] | None = None, root: Path | None = None) -> dict[str, str]:
    """root: where the marker goes whatever the process's working directory (else its own)."""
    base = dict(os.environ if base is None else base)
    where = {"NEXTTOKEN_TEST_PAUSE_DIR": str(root)} if root is not None else {}
    return {**base, ENV: point, "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), base.get("PYTHONPATH")])),
            **where}


def marker(point: str, root: Path) -> Path:
    return Path(root) / ".nexttoken" / f"test-pause-{point}"


def start(cmd: list[str], ws: Path, env: dict[str, str], point: str,
          timeout: float = 600) -> tuple[subprocess.Popen, int]:
    """Start cmd in ws with env (made by `env`) and wait until a process reaches `point`: the
    started process, and the pid the paused one wrote (its marker removed)."""
    m = marker(point, Path(env.get("NEXTTOKEN_TEST_PAUSE_DIR", ws)))
    m.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not m.exists() or not m.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"{cmd} ended before {point} ({proc.returncode}):\n{proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{cmd} never reached {point}")
        time.sleep(0.1)
    pid = int(m.read_text())
    m.unlink()
    return proc, pid
