"""The warm process (pipeline/warm.py): a stage forked from it is the stage a fresh `python -m
stages.<name>` would have been. Same output bytes, stdout, stderr and exit status; Ctrl-C and
SIGKILL of the stage process reach the run; an edited stage or library module is read from disk.

Each test has a warm home of its own (XDG_RUNTIME_DIR), so the warm processes it starts are its
own: found by their command line and stopped at its end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline.store import paths, provenance
from tests.conftest import REPO, copy_ws, run_module, snapshot
from tests.helpers import pause
from tests.reliability.conftest import staging_left

STAGES = ("prepare_model", "tokenize", "forward", "logits", "probs", "trajectories", "lens", "checks", "report")
# what a manifest says of the run beside its outputs: the same whichever way the stage started
RECORDED = ("config", "seeds", "model", "libraries", "hardware", "determinism", "kernels", "python_executable",
            "command")
CREATED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00")    # when each stage ran: the report shows it


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def warm_processes(home: Path) -> list[int]:
    """The pids of the warm processes whose socket lies under home (not the children they forked,
    which share their command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                ppid = int(stat_fields(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue
            if b"pipeline.warm_server" in cmdline and str(home).encode() in cmdline:
                found[int(entry.name)] = ppid
    return sorted(pid for pid, ppid in found.items() if ppid not in found)


@pytest.fixture
def home():
    d = Path(tempfile.mkdtemp(prefix="ntw-", dir="/tmp"))      # short: a Unix socket's path is short
    yield d
    for pid in warm_processes(d):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def warm_env(home: Path, **extra: str) -> dict[str, str]:
    """The test's own warm home; an idle time longer than any fresh run between two warm ones."""
    return {"XDG_RUNTIME_DIR": str(home), "NEXTTOKEN_WARM": "1", "NEXTTOKEN_WARM_IDLE_S": "900", **extra}


def outputs(ws: Path, stage: str) -> dict[str, str]:
    """sha256 of each output file; the report's two pages with the runs' times taken out (report.md's
    table of stage runs also gives each one's duration)."""
    folder = paths.stage_dir(stage, ws)
    out = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.name == paths.MANIFEST:
            continue
        if p.name in ("report.md", "explorer.html"):
            text = CREATED.sub("<created>", p.read_text(encoding="utf-8"))
            if p.name == "report.md":
                text = "\n".join(line for line in text.splitlines() if "<created>" not in line)
            out[p.name] = hashlib.sha256(text.encode()).hexdigest()
        else:
            out[p.relative_to(folder).as_posix()] = provenance.sha256_file(p)
    return out


def manifest(ws: Path, stage: str) -> dict:
    return json.loads((paths.stage_dir(stage, ws) / paths.MANIFEST).read_text())


def process(ws: Path, stage: str) -> dict:
    return manifest(ws, stage)["process"]


def wait_gone(pid: int, seconds: float = 60) -> None:
    """Until pid has ended (a zombie has: whether its new parent reaps it is the machine's init's affair)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            state = stat_fields(pid)[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        time.sleep(0.1)


# what a first stage does before its hand-off (stage_main's progress switch changes the environment)
STARTER = ("from pipeline import progress, warm; progress.quiet_off_terminal(); "
           "assert warm._connect_or_start(warm.environment_key(), warm._options()) is None")


def start_warm(ws: Path, home: Path, env: dict | None = None) -> int:
    """Start the warm process a stage run in ws with env would use (as a first stage does); its pid
    once it is ready, or at once when `env` pauses its imports."""
    env = {**os.environ, **warm_env(home), **(env or {})}
    subprocess.run([sys.executable, "-c", STARTER], cwd=ws, env=env, check=True, timeout=60)
    paused = "NEXTTOKEN_TEST_PAUSE" in env and "import" in env["NEXTTOKEN_TEST_PAUSE"]
    deadline = time.monotonic() + 120
    while True:
        pids = warm_processes(home)
        if pids and (paused or list(home.rglob("*.sock"))):
            return pids[0]
        assert time.monotonic() < deadline, "no warm process"
        time.sleep(0.1)


def test_a_warm_run_gives_the_bytes_and_output_of_a_fresh_one(tiny_chain, tmp_path, home):
    fresh, forked = copy_ws(tiny_chain, tmp_path / "fresh"), copy_ws(tiny_chain, tmp_path / "warm")
    for stage in STAGES:
        a = run_module(f"stages.{stage}", fresh, check=True, env={"NEXTTOKEN_WARM": "0"})
        b = run_module(f"stages.{stage}", forked, check=True, env=warm_env(home))
        assert outputs(forked, stage) == outputs(fresh, stage), stage
        assert (b.stdout, b.stderr) == (a.stdout, a.stderr), stage
        assert ({k: manifest(forked, stage).get(k) for k in RECORDED}
                == {k: manifest(fresh, stage).get(k) for k in RECORDED}), stage
        assert process(fresh, stage) == {"warm": False, "why": "NEXTTOKEN_WARM=0"}
    first, *records = [process(forked, s) for s in STAGES]
    assert not first["warm"] and first["why"].startswith("the first stage of its environment: it started")
    assert all(r["warm"] for r in records)
    [server] = warm_processes(home)                      # one warm process served every later stage
    assert len({r["key"] for r in records}) == 1 and {r["forked_from"] for r in records} == {server}


def test_a_failing_stage_fails_the_same_way(tiny_chain, tmp_path, home):
    """A UserError raised after the hand-off: exit status 2 and the one line, relayed."""
    ws = copy_ws(tiny_chain, tmp_path / "ws")
    shutil.rmtree(paths.stage_dir("prepare_model", ws))
    before = snapshot(ws)
    a = run_module("stages.forward", ws, env={"NEXTTOKEN_WARM": "0"})
    server = start_warm(ws, home)
    b = run_module("stages.forward", ws, env=warm_env(home))
    assert a.returncode == b.returncode == 2
    assert b.stderr == a.stderr and len(b.stderr.splitlines()) == 1 and "Traceback" not in b.stderr
    assert snapshot(ws) == before
    assert warm_processes(home) == [server]      # it ran in that one's child: a fresh run would start another


def test_edited_code_is_never_stale(tiny_chain, tmp_path, home):
    """The warm process keeps no project module: a stage and a library module edited after it
    started are what the next run executes (the workspace's own copy of the code comes first on
    sys.path, as in a clone)."""
    ws = copy_ws(tiny_chain, tmp_path / "ws")
    for package in ("stages", "pipeline"):
        shutil.copytree(REPO / package, ws / package, ignore=shutil.ignore_patterns("__pycache__"))
    start_warm(ws, home)
    first = run_module("stages.probs", ws, check=True, env=warm_env(home))
    assert "edited" not in first.stdout and process(ws, "probs")["warm"], process(ws, "probs")
    stage = ws / "stages/probs.py"
    stage.write_text(stage.read_text().replace("    from pipeline.numerics import probs\n",
                                               "    from pipeline.numerics import probs\n"
                                               "    print('edited stage')\n"))
    errors = ws / "pipeline/errors.py"          # a module the warm process itself imported
    errors.write_text(errors.read_text() + "\nprint('edited library')\n")
    second = run_module("stages.probs", ws, check=True, env=warm_env(home))
    # the library's print: once in the stage process, once more in the child that imports it again
    assert second.stdout.count("edited library") == 2 and second.stdout.count("edited stage") == 1
    assert process(ws, "probs")["forked_from"] == warm_processes(home)[0]


def start_at_capture(ws: Path, home: Path) -> tuple[subprocess.Popen, int]:
    """forward, paused halfway through capture.safetensors in its warm child; that child's pid."""
    env = pause.env("forward.capture", {**os.environ, **warm_env(home)})
    start_warm(ws, home, env)
    proc, child = pause.start([sys.executable, "-m", "stages.forward"], ws, env, "forward.capture", timeout=300)
    assert child != proc.pid                             # the work runs in the warm child,
    assert os.getsid(child) == child                     # in a session of its own: a killpg of the
    return proc, child                                   # stage's reaches no other stage


def test_ctrl_c_of_the_stage_process_reaches_its_warm_child(tiny_chain, tmp_path, home):
    ws = copy_ws(tiny_chain, tmp_path / "ws")
    before = snapshot(ws)
    proc, child = start_at_capture(ws, home)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert stderr == "nexttoken forward: interrupted; nothing was written to artifacts/forward\n"
    assert snapshot(ws) == before and staging_left(ws) == []
    wait_gone(child)


def test_a_killed_stage_process_stops_its_warm_child(tiny_chain, tmp_path, home):
    """SIGKILL of the process DVC started: its child gets Ctrl-C from the warm process and removes
    its staging folder; artifacts/ holds the previous run."""
    ws = copy_ws(tiny_chain, tmp_path / "ws")
    before = snapshot(ws)
    proc, child = start_at_capture(ws, home)
    proc.kill()
    proc.communicate(timeout=60)
    wait_gone(child)
    assert snapshot(ws) == before and staging_left(ws) == []


def test_ctrl_c_while_waiting_for_the_warm_process_is_one_line(tiny_chain, tmp_path, home):
    """A stage that comes while its warm process still imports waits for it; Ctrl-C then is the
    stage's one line and exit 130, as during a fresh interpreter's own imports."""
    ws = copy_ws(tiny_chain, tmp_path / "ws")
    before = snapshot(ws)
    m = pause.marker("import.torch", ws)
    env = pause.env("import.torch", {**os.environ, **warm_env(home)}, root=ws)
    server = start_warm(ws, home, env)
    deadline = time.monotonic() + 120
    while not m.exists() or not m.read_text():
        assert time.monotonic() < deadline, "the warm process never reached its torch import"
        time.sleep(0.1)
    assert int(m.read_text()) == server                   # paused in its imports: not ready
    proc = subprocess.Popen([sys.executable, "-m", "stages.forward"], cwd=ws, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)                                         # its own start is about 0.3 s: it waits by now
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr == "nexttoken forward: interrupted; nothing was written to artifacts/forward\n"
    assert snapshot(ws) == before and staging_left(ws) == []
    # it waited: a stage that ran fresh would have reached its own torch import and written its pid
    assert int(m.read_text()) == server


@pytest.mark.parametrize("var,value", [("NEXTTOKEN_WARM", "yes"), ("NEXTTOKEN_WARM_IDLE_S", "-1")])
def test_a_bad_setting_stops_the_stage_in_one_line(tiny_chain, tmp_path, home, var, value):
    ws = copy_ws(tiny_chain, tmp_path / "ws")
    before = snapshot(ws)
    for stage in ("validate", "probs"):   # validate: before `dvc repro` removes any stage's outputs
        proc = run_module(f"stages.{stage}", ws, env={**warm_env(home), var: value})
        assert proc.returncode == 2
        assert proc.stderr.startswith(f"nexttoken {stage}: error: {var}={value!r} is not allowed")
        assert len(proc.stderr.splitlines()) == 1 and snapshot(ws) == before and warm_processes(home) == []


def test_sigterm_is_relayed_and_an_ignored_sighup_stays_ignored(tiny_chain, tmp_path, home):
    """Under `nohup`, a hangup leaves the stage running, warm as fresh; SIGTERM ends both the child
    and the stage process by that signal, as it ends a fresh stage."""
    ws = copy_ws(tiny_chain, tmp_path / "ws")
    env = pause.env("forward.capture", {**os.environ, **warm_env(home)})
    start_warm(ws, home, env)
    cmd = ["bash", "-c", f"trap '' HUP; exec {sys.executable} -m stages.forward"]
    proc, child = pause.start(cmd, ws, env, "forward.capture", timeout=300)
    os.kill(proc.pid, signal.SIGHUP)
    time.sleep(1)
    assert proc.poll() is None and Path(f"/proc/{child}").exists()
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    wait_gone(child)


def test_a_warm_process_lost_mid_run_fails_the_stage_in_one_line(tiny_chain, tmp_path, home):
    ws = copy_ws(tiny_chain, tmp_path / "ws")
    before = snapshot(ws)
    proc, child = start_at_capture(ws, home)
    [server] = warm_processes(home)
    os.kill(server, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and len(stderr.splitlines()) == 1
    assert f"the warm process running this stage (pid {child}) was lost" in stderr
    wait_gone(child)                          # killed by the stage process: nothing runs unseen
    assert snapshot(ws) == before
