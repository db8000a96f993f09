"""The README's and docs' DuckDB examples run as written after `make setup` (issue 27 item 3).

`make setup` installs duckdb's Python package, which has no `duckdb` command (`duckdb -c ...` failed
with `command not found`): every shell block that queries with DuckDB is run here with bash, in the
tiny_qwen2 session chain, with only the venv's bin first on PATH, as `source .venv/bin/activate`
leaves it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str, word: str) -> list[tuple[str, str]]:
    """(file:index, code) of every fenced block in lang that mentions word."""
    return [(f"{doc.relative_to(REPO)}:{i}", code) for doc in DOCS
            for i, (fence, code) in enumerate(FENCE.findall(doc.read_text(encoding="utf-8"))) if fence == lang
            and word in code]


SHELL = _blocks("bash", "duckdb")


def test_no_doc_calls_a_duckdb_command():
    """`duckdb` is a Python module here: a `duckdb -c` / `duckdb file.db` command line anywhere is one that fails."""
    calls = [f"{doc.relative_to(REPO)}:{n}" for doc in DOCS
             for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1)
             if re.search(r"(^|[`$;|&(]\s*)duckdb\s+(-|\S+\.(db|duckdb|parquet)\b)", line)]
    assert not calls, calls
    assert SHELL, "the README's DuckDB examples are shell blocks that run `python` with the duckdb package"


@pytest.mark.parametrize("where,code", SHELL, ids=[w for w, _ in SHELL])
def test_a_duckdb_shell_example_runs_in_a_run_workspace(tiny_chain, where, code):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    proc = subprocess.run(["bash", "-e", "-c", code], cwd=tiny_chain, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, f"{where}:\n{code}\n{proc.stderr}"
    first_select = re.search(r"select (\w+)", code).group(1)
    assert first_select in proc.stdout and "└" in proc.stdout, proc.stdout    # DuckDB's table, as .show() draws it
