"""Pause a stage halfway through writing an artifact, so a test can kill it there.

`env(point)` is the environment that makes any Python process started with it (the stage
itself, or the stage `dvc repro` starts) run `tests/helpers/pause_site/sitecustomize.py`,
which wraps one writer; `marker(point, root)` is the file the paused process writes its id
to. The hook belongs to the tests: no production code reads it.
"""

from __future__ import annotations

import os
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
