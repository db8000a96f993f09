"""executor=ray with no address: the local Ray a stage starts (issue 49, items 4 and 5).

- A start that times out ("The current node timed out during startup", what Ray 2.60 raised on a
  loaded 2-core machine) is retried once, after a pause and with a longer GCS wait; a second
  timeout is one line naming the settings to change, the half-started processes stopped, nothing
  written.
- A start that times out once, then comes up: the stage runs and gives the serial bytes; and the Ray
  it started listens on 127.0.0.1 only, with no dashboard, and checks a token (Ray's own default).

The timeouts are injected by replacing `ray.init` in this process (the stages run in-process,
tests/helpers/inprocess.py): a fake that starts a process standing for the half-started node, then
raises Ray's own message.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from pipeline.errors import UserError
from pipeline.executor import cluster
from pipeline.store import paths
from pipeline.store.artifacts import read_manifest
from tests.conftest import TEST_STEPS, copy_ws, run_module, snapshot
from tests.helpers.inprocess import run_chain

RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed "
               "to startup or the GCS has become overloaded.")
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


def _workspace(tiny_workspace, dest, *overrides):
    ws = copy_ws(tiny_workspace, dest)
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "capture.device=cpu", "model=tiny_qwen2",
               *overrides, check=True)
    run_chain(ws, ("validate",))
    return ws


class FlakyInit:
    """`ray.init` that times out `failures` times (each leaving a process behind, as a half-started node
    does), then calls the real one and records what the started Ray listens on."""

    def __init__(self, real, failures: int):
        self.real, self.failures = real, failures
        self.calls: list[dict] = []        # per call: its kwargs and the GCS wait in the environment
        self.left: list[subprocess.Popen] = []
        self.listening: list[tuple[str, str, int]] = []
        self.processes: list[str] = []
        self.webui_url = None
        self.token_auth = None

    def __call__(self, **kwargs):
        import os
        self.calls.append({"kwargs": kwargs, "gcs_wait": os.environ.get(cluster.GCS_WAIT)})
        if len(self.calls) <= self.failures:
            self.left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]))
            raise Exception(RAY_TIMEOUT)      # what Ray raises: a bare Exception
        out = self.real(**kwargs)
        self._look()
        return out

    def _look(self):
        """Every inet socket listening in this process and the Ray processes it started; the dashboard URL."""
        import ray
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                name = " ".join(p.cmdline())[:120]
                self.processes.append(name)
                self.listening += [(name, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                                   if c.status == psutil.CONN_LISTEN]
            except psutil.Error:           # a process that ended meanwhile
                continue
        self.webui_url = ray._private.worker.global_worker.node.address_info["webui_url"]
        from ray._raylet import AuthenticationMode, get_authentication_mode
        self.token_auth = get_authentication_mode() == AuthenticationMode.TOKEN


@pytest.fixture
def no_pause(monkeypatch):
    monkeypatch.setattr(cluster, "RETRY_PAUSE_S", 0.0)
    monkeypatch.setenv(cluster.GCS_WAIT, "unset")
    monkeypatch.delenv(cluster.GCS_WAIT)           # restored (to unset) after the test: the retry sets it
    monkeypatch.setenv("RAY_AUTH_MODE", "unset")
    monkeypatch.delenv("RAY_AUTH_MODE")            # as for a stage; a local ray.init sets it to "token"


def test_a_start_that_times_out_twice_is_one_line_naming_the_settings_with_nothing_written(
        tiny_workspace, tmp_path, monkeypatch, no_pause):
    import ray
    ws = _workspace(tiny_workspace, tmp_path / "ws", "executor=ray", "executor.workers=1")
    before = snapshot(ws)
    fake = FlakyInit(ray.init, failures=2)
    monkeypatch.setattr(ray, "init", fake)
    with pytest.raises(UserError) as err:
        run_chain(ws, ("forward",))
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith("could not start a local Ray: its node timed out during start-up twice"), message
    for setting in ("executor.address=127.0.0.1:6379", "executor=serial", f"{cluster.GCS_WAIT}=120"):
        assert setting in message, message
    assert len(fake.calls) == 2                                             # one retry, no more
    assert [c["gcs_wait"] for c in fake.calls] == [None, str(cluster.RETRY_GCS_WAIT_S)]   # the retry waits longer
    for call in fake.calls:
        assert call["kwargs"]["address"] == "local" and call["kwargs"]["_node_ip_address"] == "127.0.0.1"
        assert call["kwargs"]["include_dashboard"] is False
    for p in fake.left:                          # each half-started "node" stopped before the next try
        assert p.wait(timeout=30) is not None
    assert snapshot(ws) == before
    assert not list((ws / paths.STAGING).glob("forward-*"))


def test_an_error_other_than_a_timeout_is_not_retried(tiny_workspace, tmp_path, monkeypatch, no_pause):
    import ray
    ws = _workspace(tiny_workspace, tmp_path / "ws", "executor=ray", "executor.workers=1")
    calls = []

    def broken(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("raylet binary not found")
    monkeypatch.setattr(ray, "init", broken)
    with pytest.raises(UserError, match=r"^could not start or join a local Ray: raylet binary not found$"):
        run_chain(ws, ("forward",))
    assert len(calls) == 1


@pytest.mark.slow
def test_a_start_that_times_out_once_is_retried_on_loopback_with_no_dashboard_and_gives_the_serial_bytes(
        tiny_workspace, tmp_path, monkeypatch, no_pause):
    import ray
    serial = _workspace(tiny_workspace, tmp_path / "serial")
    run_chain(serial, ("forward",))
    ws = _workspace(tiny_workspace, tmp_path / "ray", "executor=ray", "executor.workers=1")
    fake = FlakyInit(ray.init, failures=1)
    monkeypatch.setattr(ray, "init", fake)
    run_chain(ws, ("forward",))
    assert len(fake.calls) == 2 and fake.left[0].wait(timeout=30) is not None
    manifest = read_manifest("forward", ws)
    assert manifest["executor"]["kind"] == "ray"
    outputs = {o["path"]: o["sha256"] for o in manifest["outputs"]}
    assert outputs == {o["path"]: o["sha256"] for o in read_manifest("forward", serial)["outputs"]}
    # security defaults: every socket the local Ray listens on is on loopback, and there is no dashboard
    assert len({port for _, _, port in fake.listening}) >= 3, fake.listening       # GCS, raylet, workers: seen
    assert {ip for _, ip, _ in fake.listening} <= LOOPBACK, fake.listening
    assert fake.webui_url == "", fake.webui_url
    assert fake.token_auth is True             # Ray 2.60's default for a local ray.init: token auth on
    # Ray 2.60 runs its dashboard process even so, with no web server: it must listen on nothing
    assert [p for p in fake.processes if "dashboard/dashboard.py" in p], fake.processes      # it was looked at
    assert not [(name, port) for name, _, port in fake.listening if "dashboard" in name or port == 8265]
    assert not ray.is_initialized()                                      # the stage shut its Ray down


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """A one-node Ray started by `ray start --head` on 127.0.0.1 with token authentication, its token in a file of
    its own (never ~/.ray): -> (address, token file). Stopped by its processes' ids, not `ray stop` (which stops
    every Ray on the machine)."""
    top = tmp_path_factory.mktemp("token_head")
    token = top / "token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "HOME": str(top)}
    before = {p.pid for p in psutil.process_iter()}
    # Ray's sockets live under its temp folder and AF_UNIX paths end at 107 bytes: a short folder of its own
    # (under an xdist worker's basetemp the session's socket paths ran past it and `ray start` failed)
    ray_dir = Path(tempfile.mkdtemp(prefix="ntray-", dir="/tmp"))
    subprocess.run(["ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus",
                    "0", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(ray_dir)],
                   env=env, check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}", token
    finally:
        ours = _tree([p for p in psutil.process_iter(["pid", "cmdline"]) if p.pid not in before
                      and str(ray_dir) in " ".join(p.info["cmdline"] or [])])
        for p in ours:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(ours, timeout=30)
        shutil.rmtree(ray_dir, ignore_errors=True)


def _tree(roots: list[psutil.Process]) -> list[psutil.Process]:
    """`roots` (the head's GCS, raylet, monitors: their command lines name its temp folder) and every process
    under them (the agents rename themselves `ray::...`), collected before any is stopped."""
    out = {p.pid: p for p in roots}
    for p in roots:
        with contextlib.suppress(psutil.Error):
            out.update({c.pid: c for c in p.children(recursive=True)})
    return list(out.values())


def _forward(ws, home, token: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m stages.forward` in `ws` as a client of the token head: RAY_AUTH_MODE=token, a HOME with no
    ~/.ray/auth_token, and the token (if any) as `token` gives it; no other RAY_AUTH_* of this environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "HOME": str(home), **token})
    return subprocess.run([sys.executable, "-m", "stages.forward"], cwd=ws, capture_output=True, text=True,
                          timeout=300, env=env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("given", ["mode only", "wrong token"])
def test_a_client_without_the_clusters_token_is_refused_in_one_line_saying_how_to_give_it(
        token_head, tiny_workspace, tmp_path, given):
    address, _ = token_head
    ws = _workspace(tiny_workspace, tmp_path / "ws", "executor=ray", f"executor.address={address}")
    before = snapshot(ws)
    proc = _forward(ws, tmp_path, {} if given == "mode only" else {"RAY_AUTH_TOKEN": uuid.uuid4().hex})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    why = "this process has no token" if given == "mode only" else "it refused this process's token"
    assert f"executor.address='{address}'" in lines[0] and why in lines[0] and "RAY_AUTH_TOKEN" in lines[0], lines[0]
    assert "RAY_AUTH_TOKEN_PATH" in lines[0] and "~/.ray/auth_token" in lines[0], lines[0]
    assert snapshot(ws) == before


@pytest.mark.slow
def test_a_client_with_the_token_joins(token_head, tiny_workspace, tmp_path):
    """The same head, the token given by RAY_AUTH_TOKEN_PATH: the client is let in (so the refusals above are the
    token's doing). The head has no CPUs: the stage's workers cannot start, and it says so within the bound."""
    address, token = token_head
    ws = _workspace(tiny_workspace, tmp_path / "ws", "executor=ray", f"executor.address={address}",
                    "executor.prompt_timeout_s=5")
    proc = _forward(ws, tmp_path, {"RAY_AUTH_TOKEN_PATH": str(token)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert "the Ray workers were not ready within executor.prompt_timeout_s=5" in lines[0], lines[0]
