"""A reader that stops early (`nexttoken ... | head`) ends the command quietly, not with a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.conftest import REPO
from tests.reliability.conftest import python_env


def _into_closed_pipe(argv: list[str], cwd) -> subprocess.CompletedProcess:
    """argv run with its stdout a pipe whose reader has already gone (every write fails with EPIPE)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(argv, cwd=cwd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              env=python_env())
    finally:
        os.close(write)


def test_output_into_a_closed_pipe_exits_141_without_a_traceback(tmp_path):
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    proc = _into_closed_pipe(["nexttoken", "compose", "--check"], tmp_path)     # prints one line on stdout
    assert (proc.returncode, proc.stderr) == (141, "")
