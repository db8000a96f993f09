"""tests/helpers/stage_peak: a stage's peak RSS is its own, not the size of the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import stage_peak

HELD_MB = 1024
GROW = "if __name__ == '__main__':\n    block = bytearray(300 * 2**20)\n    block[::4096] = b'1' * len(block[::4096])\n"


def _wait4_peak_mb() -> float:
    """What os.wait4 reports for a bare interpreter started from this process (the figure replaced)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024


def test_a_child_reports_its_own_peak_while_its_parent_holds_a_gigabyte(tmp_path):
    (tmp_path / "grow.py").write_text(GROW)
    held = bytearray(HELD_MB * 2**20)
    try:
        held[::4096] = b"\1" * len(held[::4096])       # touch every page: resident
        if _wait4_peak_mb() <= HELD_MB:
            pytest.skip("this kernel does not carry the parent's size into wait4's ru_maxrss")
        out = stage_peak.run("grow", tmp_path, dict(os.environ), tmp_path / "grow.log")
    finally:
        del held
    assert out["rc"] == 0, (tmp_path / "grow.log").read_text()
    assert 300 < out["peak_mb"] < 300 + 150, out        # its 300 MB (run as __main__) and an interpreter


def test_a_failing_module_still_reports_its_peak_and_its_exit_status(tmp_path):
    (tmp_path / "fail.py").write_text("import sys\nprint('no', file=sys.stderr)\nsys.exit(3)\n")
    out = stage_peak.run("fail", tmp_path, dict(os.environ), tmp_path / "fail.log")
    assert out["rc"] == 3 and 0 < out["peak_mb"] < 150
    assert (tmp_path / "fail.log").read_text().endswith("no\n")


def test_a_killed_module_has_no_peak_and_a_negative_status(tmp_path):
    (tmp_path / "die.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    out = stage_peak.run("die", tmp_path, dict(os.environ), tmp_path / "die.log")
    assert out["rc"] == -signal.SIGKILL and out["peak_mb"] is None


def test_the_module_runs_as_python_m_runs_it(tmp_path):
    """A stage package sees what `python -m` shows while it imports (stages/__init__.py's Ctrl-C rule)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import os, sys\nARGV0, ORIG, PATH0 = sys.argv[0], sys.orig_argv, sys.path[0]\n")
    (pkg / "mod.py").write_text("import os, sys\nfrom pkg import ARGV0, ORIG, PATH0\n"
                                "ok = (ARGV0 == '-m' and ORIG[-2:] == ['-m', 'pkg.mod'] and PATH0 == os.getcwd()\n"
                                "      and __name__ == '__main__' and sys.argv[0].endswith('mod.py'))\n"
                                "sys.exit(0 if ok else 5)\n")
    out = stage_peak.run("pkg.mod", tmp_path, dict(os.environ), tmp_path / "mod.log")
    assert out["rc"] == 0, (out, (tmp_path / "mod.log").read_text())
