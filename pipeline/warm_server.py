"""The warm process behind `pipeline.warm`: imports the heavy packages once, forks a stage per request.

Started by the first stage of its key (`pipeline.warm._spawn`: SOCKET its one argument) in a session
of its own; it binds SOCKET only when its imports are done (a stage that connects finds it ready),
serves requests one fork each, and exits after `NEXTTOKEN_WARM_IDLE_S` seconds with no child.

One Python thread, one selector: the listening socket, each stage's connection (its end means
the stage process is gone: its child gets Ctrl-C, so it removes its staging folder, and SIGKILL
if it still runs ORPHAN_GRACE_S later) and each child's pidfd (readable when it exits: its wait
status goes back to the stage). The preloaded libraries' own threads (OpenBLAS's workers,
jemalloc's background thread) are idle and register their fork handlers; no torch op has run, so
no OpenMP pool exists, and CUDA is never initialised here.

A child runs in a session of its own and holds none of this process's sockets. It becomes the
stage as `python -m` would make it: the stage's fds 0-2, working directory,
environment, sys.path and argv, fresh sys.std* streams like the stage's, the stage process's
signal dispositions (Python's defaults; what it ignores stays ignored) and mask, no module left
from this process's own checkout, and `runpy._run_module_as_main` (what
`-m` calls) in a fresh `__main__`; it exits as an interpreter would (non-daemon threads joined,
atexit handlers run, streams flushed).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import types
from pathlib import Path

from pipeline import warm

ORPHAN_GRACE_S = 30.0      # a child whose stage process died: Ctrl-C, then SIGKILL after this


def main(path: Path) -> None:
    t0 = time.perf_counter()
    try:
        for name in warm.PRELOAD:
            importlib.import_module(name)
        idle = warm.settings()[1]
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        listener.bind(str(tmp))
        listener.listen(16)
    except BaseException:
        path.with_suffix(".failed").touch()     # stages run fresh, and try no new start for a while
        raise
    print(f"{time.strftime('%F %T')} pid {os.getpid()}: imports took {time.perf_counter() - t0:.1f} s, "
          f"{threading.active_count()} Python thread(s)", flush=True)
    os.replace(tmp, path)                # ready: connections from now on are served
    ino = path.stat().st_ino
    try:
        _serve(listener, idle)
    finally:
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_ino == ino:    # still ours (a later process may have replaced it)
                path.unlink()
        listener.close()
    with contextlib.suppress(OSError, ValueError):
        if int(path.with_suffix(".pid").read_text()) == os.getpid():     # no later process of this key
            path.with_suffix(".pid").unlink()
            path.with_suffix(".log").unlink(missing_ok=True)   # an idle exit: nothing in the log to keep


class Children:
    """The forked stages: each one's connection to its stage process and its pidfd."""

    def __init__(self, sel) -> None:
        self.sel = sel
        self.conn: dict[int, socket.socket] = {}
        self.pidfd: dict[int, int] = {}
        self.orphans: dict[int, float] = {}    # pid -> when it is killed, if Ctrl-C has not ended it by then

    def add(self, pid: int, conn: socket.socket) -> None:
        self.conn[pid], self.pidfd[pid] = conn, os.pidfd_open(pid)
        self.sel.register(self.pidfd[pid], selectors.EVENT_READ, ("exited", pid))
        self.sel.register(conn, selectors.EVENT_READ, ("gone", pid))

    def orphan(self, pid: int) -> None:
        """Its stage process is gone: Ctrl-C now (it removes its staging folder), SIGKILL later."""
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.conn[pid])
        self.signal(pid, signal.SIGINT)
        self.orphans[pid] = time.monotonic() + ORPHAN_GRACE_S

    def signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd[pid], sig)

    def reap(self, pid: int) -> None:
        """It exited: its wait status to its stage process (when that is still there)."""
        _, status = os.waitpid(pid, 0)
        conn, pidfd = self.conn.pop(pid), self.pidfd.pop(pid)
        self.orphans.pop(pid, None)
        for fd in (pidfd, conn):
            with contextlib.suppress(KeyError, ValueError):      # the connection ended first ("gone")
                self.sel.unregister(fd)
        with contextlib.suppress(OSError):
            conn.sendall(f"status {status}\n".encode())
        conn.close()
        os.close(pidfd)

    def overdue(self, now: float) -> float | None:
        """SIGKILL the orphans whose grace ran out; seconds until the next one's."""
        for pid in [p for p, when in self.orphans.items() if when <= now]:
            self.signal(pid, signal.SIGKILL)
            del self.orphans[pid]
        return min(self.orphans.values(), default=now + 3600) - now


def _serve(listener: socket.socket, idle: float) -> None:
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept", None))
    children = Children(sel)
    last = time.monotonic()
    while True:
        now = time.monotonic()
        timeout = children.overdue(now)
        if not children.conn:
            timeout = idle - (now - last)
            if timeout <= 0:
                return
        for key, _ in sel.select(max(0.0, timeout)):
            kind, pid = key.data
            try:
                if kind == "accept":
                    conn, _ = listener.accept()
                    started = _start(conn, listener, sel, children)
                    if started is not None:
                        pid, answered = started
                        children.add(pid, conn)
                        if not answered:      # the stage process went away before it learnt the pid
                            children.orphan(pid)
                elif kind == "exited":
                    children.reap(pid)
                    last = time.monotonic()
                elif kind == "gone" and pid in children.conn:
                    try:
                        alive = children.conn[pid].recv(1, socket.MSG_PEEK)
                    except OSError:
                        alive = b""
                    if not alive:
                        children.orphan(pid)
            except Exception:     # one request's trouble never ends the process serving the others
                print(f"{time.strftime('%F %T')} {kind} {pid}:\n{traceback.format_exc()}", flush=True)


def _start(conn: socket.socket, listener: socket.socket, sel, children: Children) -> tuple[int, bool] | None:
    """Read one request and fork its child: its pid, and whether the stage process got it. None (the
    connection and any file descriptors received closed) when the request is bad or no fork could be made."""
    fds: list[int] = []
    try:
        conn.settimeout(warm.REQUEST_TIMEOUT_S)
        msg, fds, _, _ = socket.recv_fds(conn, 4, 3)
        if len(msg) != 4 or len(fds) != 3:
            raise ValueError("a request without its header and three file descriptors")
        size, = struct.unpack("!I", msg)
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("the request ended early")
            body += chunk
        request = json.loads(body)
        conn.settimeout(None)
        pid = os.fork()
    except (OSError, ValueError) as e:
        print(f"{time.strftime('%F %T')} refused a request: {e}", flush=True)
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    if pid == 0:
        code = 1
        try:
            # a session of its own: a stage that signals its process group (Ray shutting down, a
            # tool's killpg) reaches itself and its children, never this process or another stage
            os.setsid()
            sel.close()
            for other in (listener, conn, *children.conn.values()):
                other.close()
            for fd in children.pidfd.values():
                os.close(fd)
            code = _become(request, fds)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"pid {pid}\n".encode())
    except OSError:
        return pid, False
    return pid, True


def _become(request: dict, fds: list[int]) -> int:
    """In the child: the stage process `python -m` would have started, then run it."""
    for sig in (*warm.RELAYED, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)          # as CPython sets it
    for sig in request["ignored"]:                         # what the stage process ignores (nohup: SIGHUP)
        signal.signal(sig, signal.SIG_IGN)
    if signal.SIGPIPE not in request["ignored"]:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["mask"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["environ"])
    os.environ[warm.CHILD_ENV] = str(os.getpid())
    sys.path[:] = request["path"]
    sys.orig_argv = request["orig_argv"]
    sys.argv = ["-m", *request["argv"]]
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own stream, open until it exits)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        spec = request["streams"][name]
        binary = open(fd, "wb", buffering=0 if spec["raw"] else -1, closefd=False)  # noqa: SIM115 (as above)
        setattr(sys, name, io.TextIOWrapper(binary, encoding=spec["encoding"], errors=spec["errors"],
                                            line_buffering=spec["line_buffering"],
                                            write_through=spec["write_through"]))
    for name in _own_modules():           # the child imports the stage's modules from where it runs
        del sys.modules[name]
    sys.modules["__main__"] = types.ModuleType("__main__")
    import runpy
    try:
        runpy._run_module_as_main(request["module"], alter_argv=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)      # as CPython does: die of the signal
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish()
    return code


def _own_modules() -> list[str]:
    """The modules of this process's own checkout: every package that lies directly in the folder
    `pipeline` came from (not what a venv inside that folder installed), and their submodules."""
    root = Path(warm.__file__).resolve().parents[1]
    tops = {name for name, module in sys.modules.items() if "." not in name and getattr(module, "__file__", None)
            and Path(module.__file__).resolve().parent in (root, root / name)}
    return [name for name in sys.modules if name.split(".")[0] in tops]


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What an interpreter does on its way out."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            s.flush()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
