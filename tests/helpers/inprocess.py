"""Run stages in this process, in a workspace, as `python -m stages.<name>` would there.

For tests that run many whole chains (every model family): the imports and the interpreter
start are paid once. A stage's main reads params.yaml from the working directory, so each
runs with the workspace as cwd; the model loads are shared within one chain
(`loader.shared_loads`), as `nexttoken verify` shares them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path

CHAIN = ("validate", "prepare_model", "tokenize", "forward", "logits", "probs", "trajectories", "lens", "checks",
         "report")


@contextlib.contextmanager
def cwd(path: Path):
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_chain(ws: Path, stages=CHAIN) -> None:
    """Each stage's main() in order, in `ws`; a stage's failure raises (SystemExit or its error)."""
    from pipeline.model import loader

    with cwd(ws), loader.shared_loads():
        for stage in stages:
            importlib.import_module(f"stages.{stage}").main()
