"""Run `python -m <module>` (a stage) in a fresh interpreter: exit status, wall and CPU time, and
that interpreter's own peak RSS.

The peak is not `os.wait4`'s `ru_maxrss`: at exec, Linux carries the address space the child was
forked with into its high-water mark, so a child of a process holding a model reports at least
that process's size. Measured: a `python -c pass` started from a parent holding 2 GB reports
2059 MB, its own VmHWM 11 MB. The bench and the tests start stages from such processes, so the
child reports its own `VmHWM` (the high-water mark of the address space exec gave it) as it
exits, into a file named by an environment variable. The stage runs in that interpreter:
its own work is what is measured.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers import validated

PEAK_FILE_ENV = "NEXTTOKEN_PEAK_FILE"
# Runs the module as `python -m` would (while the package imports, sys.argv[0] is "-m" and
# sys.orig_argv names the module, so stages/__init__.py sets its quiet Ctrl-C handler; sys.path[0]
# is the working directory), then writes this process's VmHWM (kB), also when the module exits
# with an error (SystemExit goes through `finally`). VmHWM leaves out the interpreter's teardown.
# It parses /proc/self/status itself rather than call bench.common.peak_mb: that module imports
# torch, which a stage must not find loaded before `kernels.pin`, and which would count in the peak.
RUNNER = """\
import os, runpy, sys
module = sys.argv.pop(1)
sys.argv[0], sys.orig_argv, sys.path[0] = "-m", [sys.executable, "-m", module], os.getcwd()
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    try:
        with open("/proc/self/status") as status:
            peak = status.read().split("VmHWM:")[1].split()[0]
        with open(os.environ["NEXTTOKEN_PEAK_FILE"], "w") as f:
            f.write(peak)
    except (OSError, KeyError, IndexError):     # no peak rather than a changed exit status
        pass
"""


def run(module: str, cwd: Path, env: dict[str, str], log: Path) -> dict:
    """`python -m module` in cwd, stdout dropped, stderr to log: rc, wall_s, cpu_s (user + system,
    every thread and the children it waited for, from wait4: CPU time is not inherited), peak_mb
    (the child's own VmHWM, not its children's; None if it died before writing it, e.g. killed)."""
    if module != "stages.validate":
        validated.ensure(cwd, env)            # as dvc repro runs validate first (not measured)
    fd, peak_file = tempfile.mkstemp(prefix="peak-", suffix=".kb")
    os.close(fd)
    try:
        t0 = time.perf_counter()
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", RUNNER, module], cwd=cwd,
                                    env={**env, PEAK_FILE_ENV: peak_file},
                                    stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)     # this child's own accounting, not every child's
            proc.returncode = os.waitstatus_to_exitcode(status)     # reaped: Popen must not wait again
        wall = time.perf_counter() - t0
        text = Path(peak_file).read_text().strip()
    finally:
        os.unlink(peak_file)
    return {"rc": proc.returncode, "wall_s": round(wall, 3),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "peak_mb": round(int(text) / 1024, 1) if text else None}
