"""What `dvc repro` does before any stage, for a test or the bench that runs a stage by itself: bring
the workspace's artifacts/validate up to date with its params.yaml and prompt files.

A stage reads only the config validate wrote for it (pipeline/store/graph.py), so a stage run by hand
after params.yaml changed would run the old config; DVC never lets that happen (validate depends on
params.yaml and prompts/, every stage on its file). Up to date: validate's manifest records this
params.yaml's sha256 and the prompt files' current ones.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.store import graph, paths, provenance


def current(ws: Path) -> bool:
    if graph.validated_params_sha256(ws) != provenance.sha256_file(Path(ws) / paths.PARAMS):
        return False
    manifest = json.loads(paths.manifest_path("validate", ws).read_text(encoding="utf-8"))
    for i in manifest.get("inputs") or []:
        file = Path(ws) / i["path"]
        if not file.is_file() or provenance.sha256_file(file) != i["sha256"]:
            return False
    return True


def ensure(ws: Path, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess | None:
    """`python -m stages.validate` in ws unless artifacts/validate is current; its result (None: current)."""
    if not (Path(ws) / paths.PARAMS).exists() or current(ws):
        return None
    return subprocess.run([sys.executable, "-m", "stages.validate"], cwd=ws, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def ensure_here() -> None:
    """The same, in this process, in the working directory (the in-process chains)."""
    if Path(paths.PARAMS).exists() and not current(Path.cwd()):
        importlib.import_module("stages.validate").main()
