"""The warm process behind `pipeline.warm`: imports the heavy packages once, forks a stage per request.

Started by the first stage of its key (`pipeline.warm._spawn`: SOCKET its one argument) in a session
of its own; it binds SOCKET only when its imports are done (a stage that connects finds it ready),
serves requests one fork each, and exits after `NEXTTOKEN_WARM_IDLE_S` seconds with no child.

One thread, one selector: the listening socket, each stage's connection (its end means the stage
process is gone: its child gets Ctrl-C, so it removes its staging folder, and SIGKILL if it still
runs ORPHAN_GRACE_S later) and each child's pidfd
(readable when it exits: its wait status goes back to the stage). No thread runs beside the
forks, so a child never inherits a lock held elsewhere.

A child becomes the stage as `python -m` would make it: the stage's fds 0-2, working directory,
environment, sys.path and argv, fresh sys.std* streams like the stage's, Python's own signal
dispositions, no project module left from this process, and `runpy._run_module_as_main` (what
`-m` calls) in a fresh `__main__`; it exits as an interpreter would (non-daemon threads joined,
atexit handlers run, streams flushed).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
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
    for name in warm.PRELOAD:
        importlib.import_module(name)
    print(f"{time.strftime('%F %T')} pid {os.getpid()}: imports took {time.perf_counter() - t0:.1f} s",
          flush=True)
    idle = warm.settings()[1]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    listener.bind(str(tmp))
    listener.listen(16)
    os.replace(tmp, path)                # ready: connections from now on are served
    ino = path.stat().st_ino
    try:
        _serve(listener, idle)
    finally:
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_ino == ino:    # still ours (a later process may have replaced it)
                path.unlink()
        listener.close()
    path.with_suffix(".log").unlink(missing_ok=True)     # an idle exit: nothing in the log to keep
    with contextlib.suppress(OSError, ValueError):
        if int(path.with_suffix(".pid").read_text()) == os.getpid():
            path.with_suffix(".pid").unlink()


def _serve(listener: socket.socket, idle: float) -> None:
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept", None))
    children: dict[int, tuple[socket.socket, int]] = {}    # pid -> (connection, pidfd)
    orphans: dict[int, float] = {}     # pid -> when it is killed, if Ctrl-C has not ended it by then
    last = time.monotonic()
    while True:
        now = time.monotonic()
        for pid in [p for p, when in orphans.items() if when <= now]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            del orphans[pid]
        if children:
            timeout = min(orphans.values(), default=now + 3600) - now
        else:
            timeout = idle - (now - last)
            if timeout <= 0:
                return
        for key, _ in sel.select(max(0.0, timeout)):
            kind, pid = key.data
            if kind == "accept":
                conn, _ = listener.accept()
                pid = _start(conn, listener, sel)
                if pid is not None:
                    pidfd = os.pidfd_open(pid)
                    children[pid] = (conn, pidfd)
                    sel.register(pidfd, selectors.EVENT_READ, ("exited", pid))
                    sel.register(conn, selectors.EVENT_READ, ("gone", pid))
            elif kind == "exited":
                conn, pidfd = children.pop(pid)
                orphans.pop(pid, None)
                _, status = os.waitpid(pid, 0)
                for fd in (pidfd, conn):
                    with contextlib.suppress(KeyError):      # the connection ended first ("gone")
                        sel.unregister(fd)
                with contextlib.suppress(OSError):
                    conn.sendall(f"status {status}\n".encode())
                conn.close()
                os.close(pidfd)
                last = time.monotonic()
            elif kind == "gone":
                conn = children[pid][0]
                try:
                    alive = conn.recv(1, socket.MSG_PEEK)
                except OSError:
                    alive = b""
                if not alive:        # the stage process is gone: its run is stopped as Ctrl-C would
                    sel.unregister(conn)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGINT)
                    orphans[pid] = time.monotonic() + ORPHAN_GRACE_S


def _start(conn: socket.socket, listener: socket.socket, sel) -> int | None:
    """Read one request and fork its child; None (the connection closed) when the request is bad."""
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
    except (OSError, ValueError) as e:
        print(f"{time.strftime('%F %T')} refused a request: {e}", flush=True)
        conn.close()
        return None
    conn.settimeout(None)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sel.close()
            listener.close()
            conn.close()
            code = _become(request, fds)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    return pid


def _become(request: dict, fds: list[int]) -> int:
    """In the child: the stage process `python -m` would have started, then run it."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)          # as CPython sets it
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
        stream = open(fd, "w", encoding=spec["encoding"], errors=spec["errors"], closefd=False,  # noqa: SIM115
                      buffering=1 if spec["line_buffering"] else -1)
        if spec["write_through"]:
            stream.reconfigure(write_through=True)
        setattr(sys, name, stream)
    for name in [m for m in sys.modules if m.split(".")[0] in warm.PROJECT]:
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
