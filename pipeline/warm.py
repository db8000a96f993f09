"""A warm process for the stages: torch and transformers imported once, each stage run forked from it.

DVC runs every stage as a fresh `python -m stages.<name>`, and seven of them spend 3-5 s of a
fresh interpreter importing torch and transformers before any work (docs/cost_and_scale.md:
that was nearly all of `dvc repro`'s price over one process). Here a stage, once it has read
its params and pinned its kernels (`kernels.pin`), calls `hand_off()`: the rest of the run goes
to a child forked from a warm process that has imported those packages already, and this
process only relays signals and exits with the child's status. DVC sees the same command, the
same stdout/stderr (the child writes to this process's own file descriptors), the same exit
status; the stage's code runs from the start in the child, read from disk, so an edited stage
or library module is never stale (the warm process imports no project module it hands over).

The warm process is keyed (`environment_key`): the Python, its command-line options and
`sys.path`, every distribution installed on it (name, version, when), this module's and the
server's code, the process's umask, CPU affinity, resource limits, niceness and cgroup, and the
whole environment but the few variables DVC and pytest set per stage or per test (KEY_IGNORES).
The kernel pins above all: ATen and oneDNN read theirs when torch loads, so each pinned
environment gets a process of its own; and what an interpreter runs at start (sitecustomize,
.pth files) ran in the warm process with the same environment. It starts on the first hand-off
of its key, whose stage runs fresh while the warm process imports beside it (a stage that comes
meanwhile waits for it), serves any checkout, and exits after `NEXTTOKEN_WARM_IDLE_S` (default
60) s with nothing to run. It runs from "/": what its imports read from a working directory
(matplotlib's ./matplotlibrc) is left to the child's own imports. Anything that stops a hand-off
before the child started (no warm process could be started, a race with one exiting) runs the
stage here as before; the manifest records which way it ran (`process`).

`NEXTTOKEN_WARM=0` turns it off. It is off on its own under `python -X ...` (what the bench's
`-X importtime` measures is a fresh interpreter), where the stage is not the `__main__` module
(a test or tool calling `main()`), where torch is loaded already, and on a platform without
fork and pidfds.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.errors import UserError

SWITCH = "NEXTTOKEN_WARM"                 # "0": every stage runs in its own fresh interpreter
IDLE_ENV = "NEXTTOKEN_WARM_IDLE_S"
CHILD_ENV = "NEXTTOKEN_WARM_CHILD"        # the pid of a forked stage (its own subprocesses are fresh)
IDLE_S = 60.0
START_TIMEOUT_S = 120.0                   # a warm process's imports under load; then the stage runs fresh
REQUEST_TIMEOUT_S = 10.0                  # sending a request; its answer (the child's pid) may wait longer:
REPLY_TIMEOUT_S = 120.0                   # the warm process reads one request at a time
FAILED_RETRY_S = 600.0                    # a warm process that failed to start is not tried again for so long
# What the warm process imports: the stages' heavy third-party modules (transformers' top level is
# lazy; the Auto classes, modeling_utils and generation are what a stage pays for). Not matplotlib:
# it reads ./matplotlibrc from the working directory when it loads.
PRELOAD = ("numpy", "torch", "pyarrow", "pyarrow.parquet", "pyarrow.dataset", "pandas", "safetensors.torch",
           "tokenizers", "yaml", "pydantic", "transformers", "transformers.modeling_utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.generation.utils", "transformers.generation.logits_process", "tabulate")
# The key holds the whole environment but these: set per stage or per test, read by no import (DVC
# gives each stage its name and root; a stage's own children carry CHILD_ENV).
KEY_IGNORES = ("DVC_STAGE", "DVC_ROOT", "PYTEST_CURRENT_TEST", "PWD", "OLDPWD", "SHLVL", "_", CHILD_ENV)
KEY_IGNORE_PREFIXES = ("DVC_EXP_", "PYTEST_XDIST_")
SOCKET_DIR_MAX = 72       # Linux's socket paths: 107 bytes, "/<20 hex>.sock.<pid of 7 digits>" included
# Relayed to the child as they come (SIGTSTP stops both, SIGCONT resumes both); an ignored one stays ignored.
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGCONT, signal.SIGTSTP)

_record: dict = {"warm": False, "why": "this stage does not hand off"}


def record() -> dict:
    """How this stage's process started, for its manifest: forked from a warm process, or fresh (why)."""
    return dict(_record)


# ---------------------------------------------------------------- the stage's side
def settings(environ=None) -> tuple[bool, float]:
    """NEXTTOKEN_WARM (on unless "0") and NEXTTOKEN_WARM_IDLE_S; a bad value is one line naming it."""
    environ = os.environ if environ is None else environ
    switch = environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise UserError(f"{SWITCH}={switch!r} is not allowed: 1 (the default: stages hand off to a warm "
                        f"process) or 0 (every stage in a fresh interpreter)")
    idle = environ.get(IDLE_ENV, str(IDLE_S))
    try:
        seconds = float(idle)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 86400:
        raise UserError(f"{IDLE_ENV}={idle!r} is not allowed: the seconds a warm process waits for work "
                        f"before it exits, > 0 and at most 86400 (default {IDLE_S:g})")
    return switch == "1", seconds


def _why_not(stage: str) -> str | None:
    if not settings()[0]:
        return f"{SWITCH}=0"
    if not (hasattr(os, "fork") and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")):
        return "no fork/pidfd on this platform"
    if sys._xoptions:
        return "the interpreter runs with -X options"
    if _main_module(stage) is None:
        return "the stage is not the __main__ module (`python -m` runs it so)"
    if "torch" in sys.modules:
        return "torch is loaded already"
    return None


def _main_module(stage: str) -> str | None:
    """The module `python -m` runs as __main__, where it is this stage's (None otherwise)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None and spec.name.rsplit(".", 1)[-1] == stage else None


def hand_off(stage: str) -> None:
    """Run this stage in a child of the warm process for this environment and exit with its status.

    Returns (and the stage runs here, fresh) when the child could not be started; once it has
    started, this process never returns: it relays signals until the child's status arrives.
    """
    global _record
    if os.environ.get(CHILD_ENV) == str(os.getpid()):      # this is that child: run the stage
        _record = {"warm": True, "key": environment_key(), "forked_from": os.getppid()}
        return
    if why := _why_not(stage):
        _record = {"warm": False, "why": why}
        return
    try:
        conn = _connect_or_start(environment_key(), _options())
    except (OSError, TimeoutError) as e:
        _record = {"warm": False, "why": f"no warm process: {e}"}
        return
    if conn is None:
        _record = {"warm": False, "why": "the first stage of its environment: it started the warm process "
                                         "for the next ones, and ran fresh meanwhile"}
        return
    # From the request on, a signal waits until it can be forwarded to the child (or, where none
    # started, until the stage runs here and meets it as it would have).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    try:
        pid = _request(conn, _main_module(stage), mask)
    except (OSError, ValueError) as e:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _record = {"warm": False, "why": f"no warm process: {e}"}
        return
    _relay(conn, pid, mask)


def environment_key(environ: dict | None = None) -> str:
    """What a warm process's imports, and a child it forks, inherit from where it started, hashed:
    one warm process per distinct value."""
    environ = os.environ if environ is None else environ
    own = [hashlib.sha256(f.read_bytes()).hexdigest() for f in (Path(__file__), Path(__file__).with_name(
        "warm_server.py"))]      # the protocol and the child's set-up: their content, the same in every clone
    material = {"python": [sys.executable, sys.version, sys.path[1:], list(sys.flags), sys.warnoptions],
                "installed": _installed(sys.path[1:]), "own": own, "process": _process_state(),
                "env": {k: v for k, v in sorted(environ.items())
                        if k not in KEY_IGNORES and not k.startswith(KEY_IGNORE_PREFIXES)}}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def _installed(entries: list[str]) -> list:
    """Every distribution and .pth file on sys.path, by name (its version in it) and modification
    time: an upgrade or a reinstall is a new key. Read from the folders, nothing imported."""
    found = []
    for entry in entries:
        try:
            names = sorted(n for n in os.listdir(entry or ".")
                           if n.endswith((".dist-info", ".egg-info", ".egg-link", ".pth")))
        except OSError:
            continue
        found += [[entry, n, os.stat(os.path.join(entry, n)).st_mtime_ns] for n in names]
    return found


def _process_state() -> dict:
    """What a forked child inherits from the warm process rather than from the stage process."""
    import resource
    mask = os.umask(0)
    os.umask(mask)
    limits = {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource)
              if name.startswith("RLIMIT_")}
    try:
        cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroup = None
    return {"umask": mask, "cpus": sorted(os.sched_getaffinity(0)), "limits": limits,
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "cgroup": cgroup}


def _options() -> list[str]:
    """The interpreter's command-line options (`-u`, `-W error`, ...): the warm process gets them too."""
    argv, i = sys.orig_argv, 1
    while i < len(argv) and argv[i] not in ("-m", "-c") and argv[i].startswith("-"):
        i += 2 if argv[i] in ("-W", "-X", "--check-hash-based-pycs") else 1
    return argv[1:i]


def home() -> Path:
    """Where the sockets, locks and logs live: private to this user."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    d = Path(base) / f"nexttoken-warm-{os.getuid()}"
    if len(os.fsencode(d)) > SOCKET_DIR_MAX:
        raise OSError(f"{d} is too long a folder for a Unix socket ({SOCKET_DIR_MAX} bytes at most)")
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        # another user's folder (or a link) would hand them this stage's files and environment
        raise OSError(f"{d} is not a folder of this user's alone (uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")
    return d


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        raise
    return s


def _connect_or_start(key: str, options: list[str]) -> socket.socket | None:
    """A connection to the warm process of `key`; None where this call started it (its imports
    then run beside this stage, which runs fresh). A start under way is waited for."""
    import fcntl
    path = home() / f"{key}.sock"
    try:
        return _connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    pidfile = path.with_suffix(".pid")
    with open(home() / f"{key}.lock", "w") as lock:    # one starter per key
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        starting = _starting(pidfile, path)
        if starting is None:
            failed = path.with_suffix(".failed")
            with contextlib.suppress(FileNotFoundError):
                if (age := time.time() - failed.stat().st_mtime) < FAILED_RETRY_S:
                    raise OSError(f"the warm process failed to start {age:.0f} s ago "
                                  f"(see {path.with_suffix('.log')})")
            path.unlink(missing_ok=True)                 # a process that died without removing it
            pidfile.write_text(str(_spawn(path, options)))
            return None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return _connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            if _starting(pidfile, path) is None:
                raise OSError(f"the warm process {starting} ended before it was ready "
                              f"(see {path.with_suffix('.log')})") from None
            time.sleep(0.05)
    raise TimeoutError(f"the warm process {starting} was not ready after {START_TIMEOUT_S:.0f} s")


def _starting(pidfile: Path, path: Path) -> int | None:
    """The pid of the warm process for `path` when it is still alive (it may be importing)."""
    try:
        pid = int(pidfile.read_text())
        alive = str(path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if alive else None


def _spawn(path: Path, options: list[str]) -> int:
    """Start the warm process for `path` in a session of its own, from "/", with this interpreter's
    options; its pid."""
    root = str(Path(__file__).resolve().parents[1])     # this checkout's server code
    serve = f"import sys, runpy; sys.path.insert(0, {root!r}); runpy.run_module('pipeline.warm_server', " \
            "run_name='__main__')"
    with open(path.with_suffix(".log"), "ab") as out:
        proc = subprocess.Popen([sys.executable, *options, "-c", serve, str(path)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True, cwd="/")
    proc.returncode = 0       # it outlives this process by design: no "still running" warning at exit
    return proc.pid


def _streams() -> dict:
    out = {}
    for name in ("stdout", "stderr"):
        s = getattr(sys, name)
        out[name] = {"encoding": getattr(s, "encoding", None), "errors": getattr(s, "errors", None),
                     "line_buffering": getattr(s, "line_buffering", False),
                     "write_through": getattr(s, "write_through", False),
                     "raw": isinstance(getattr(s, "buffer", None), io.FileIO)}     # -u: no binary buffer
    return out


def _request(conn: socket.socket, module: str, mask: set) -> int:
    """Send this process's fds 0-2 and what `python -m` set up; the child's pid comes back."""
    for s in (sys.stdout, sys.stderr):
        s.flush()
    ignored = [int(sig) for sig in (*RELAYED, signal.SIGPIPE) if signal.getsignal(sig) == signal.SIG_IGN]
    body = json.dumps({"module": module, "argv": sys.argv[1:], "orig_argv": sys.orig_argv,
                       "path": sys.path, "cwd": os.getcwd(), "environ": dict(os.environ),
                       "streams": _streams(), "ignored": ignored, "mask": sorted(int(m) for m in mask)}).encode()
    conn.settimeout(REQUEST_TIMEOUT_S)
    socket.send_fds(conn, [struct.pack("!I", len(body))], [0, 1, 2])
    conn.sendall(body)
    conn.settimeout(REPLY_TIMEOUT_S)
    reply = _line(conn)
    if not reply.startswith("pid "):
        raise ValueError(f"the warm process answered {reply!r}")
    return int(reply.split()[1])


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise ValueError("the warm process closed the connection")
        data += chunk
    return data.decode().strip()


def _relay(conn: socket.socket, pid: int, mask: set) -> None:
    """Forward signals to the child until its status arrives; exit as it did."""
    global _record
    _record = {"warm": True}
    pidfd = os.pidfd_open(pid)       # signals reach this child, never a later process with its pid

    def forward(signum, frame):
        # Ctrl-Z: the child, in a session of its own, would drop a SIGTSTP (an orphaned process
        # group): it gets SIGSTOP, and this process stops too; SIGCONT (forwarded) resumes both
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGSTOP if signum == signal.SIGTSTP else signum)
        if signum == signal.SIGTSTP:
            os.kill(os.getpid(), signal.SIGSTOP)
    for sig in RELAYED:
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)    # what came meanwhile is forwarded now
    conn.settimeout(None)             # the stage's own run time: as long as a fresh stage would take
    try:
        status = int(_line(conn).split()[1])
    except (OSError, ValueError, IndexError) as e:
        forward(signal.SIGKILL, None)
        print(f"nexttoken: the warm process running this stage (pid {pid}) was lost ({e}); "
              f"the stage's outcome is unknown: run it again, or with {SWITCH}=0", file=sys.stderr)
        os._exit(1)
    if os.WIFSIGNALED(status):       # die the same way, so DVC sees what a fresh stage would give
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)          # a signal whose default is to carry on (SIGCHLD, SIGWINCH)
    os._exit(os.waitstatus_to_exitcode(status))
