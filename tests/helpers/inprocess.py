"""Run stages in this process, in a workspace, as `python -m stages.<name>` would there.

For tests that run many whole chains (every model family): the imports and the interpreter
start are paid once. A stage's main reads its validated config (validate's file, brought up to
date first as dvc repro would) from the working directory, so each runs with the workspace as
cwd; the model loads are shared within one chain (`loader.shared_loads`), as `nexttoken verify`
shares them.

CHAIN is the one list of stages the tests run as "the whole chain": the stages of dvc.yaml, in
its order (a topological one: tests/unit/test_dvc_yaml.py), read from dvc.yaml itself. So a stage
added to dvc.yaml is run by every whole-chain test (every family's) from its first day.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path

import yaml

from tests.helpers import validated

ROOT = Path(__file__).resolve().parents[2]


def dvc_stages(repo: Path = ROOT) -> tuple[str, ...]:
    """The stages `dvc repro` runs in `repo`, in dvc.yaml's order."""
    return tuple(yaml.safe_load((repo / "dvc.yaml").read_text())["stages"])


CHAIN = dvc_stages()


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
            if stage != "validate":
                validated.ensure_here()      # as dvc repro runs validate first (params.yaml edited by a test)
            importlib.import_module(f"stages.{stage}").main()
