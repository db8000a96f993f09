"""tests/helpers/stage_peak: a stage's peak RSS is its own, not the size of the process that started it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import stage_peak

HELD_MB = 1024


def _hold(mb: int) -> bytearray:
    block = bytearray(mb * 2**20)
    block[::4096] = b"\1" * len(range(0, len(block), 4096))      # touch every page: resident
    return block


def test_a_child_reports_its_own_peak_while_its_parent_holds_a_gigabyte(tmp_path):
    held = _hold(HELD_MB)
    (tmp_path / "grow.py").write_text("block = bytearray(300 * 2**20); block[::4096] = b'1' * len(block[::4096])\n")
    out = stage_peak.run("grow", tmp_path, dict(os.environ), tmp_path / "grow.log")
    assert out["rc"] == 0, (tmp_path / "grow.log").read_text()
    assert 300 < out["peak_mb"] < 300 + 150, out        # its 300 MB and an interpreter, not this process
    # What wait4 says of the same kind of child: at least this process's size (the figure replaced).
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    _, _, usage = os.wait4(proc.pid, 0)
    assert usage.ru_maxrss / 1024 > HELD_MB
    del held


def test_a_failing_module_still_reports_its_peak_and_its_exit_status(tmp_path):
    (tmp_path / "fail.py").write_text("import sys\nprint('no', file=sys.stderr)\nsys.exit(3)\n")
    out = stage_peak.run("fail", tmp_path, dict(os.environ), tmp_path / "fail.log")
    assert out["rc"] == 3 and 0 < out["peak_mb"] < 150
    assert (tmp_path / "fail.log").read_text() == "no\n"
