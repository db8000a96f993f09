"""`executor.kind=ray`: a stage's per-prompt work on Ray actors, one model load per actor.

- `executor.address`: null starts a local Ray for the stage (on 127.0.0.1, no dashboard, no usage
  report) and stops it after; `auto` or `ray://HOST:PORT` (or a GCS address) joins a cluster,
  which stays up. Every node must see the repository at the same path (shared storage): workers
  read their inputs from `artifacts/` there, and return their outputs as bytes.
- `executor.workers` actors, each with `cpus_per_worker` CPUs and `gpus_per_worker` GPUs, running
  `torch_threads` threads (null: the stage process's own count, which a serial run uses: reductions
  split by thread, so another count can change bits; set it to `cpus_per_worker` for speed where the
  equivalence stage's `threads_1` row shows the count changes nothing). Ray sets OMP_NUM_THREADS itself when it is
  unset, and a cluster's workers do not inherit the driver's environment: the thread counts and
  the kernel pins (`capture.kernels`, `pipeline.kernels.PIN_VARS`) go to every actor explicitly in
  its `runtime_env`, and the actor pins them again before it unpickles the work (which imports torch).
- `executor.max_retries`: an actor that dies (a killed worker, a lost node) is restarted and its
  prompt retried this many times; then the stage fails in one line naming the prompt. A call that Ray ends while
  a lost node's actors are moved (or a result lost with that node's object store) is sent again by the stage
  (`_get`). Every wait is bounded (`executor.prompt_timeout_s`).
- At most two prompts per actor are in flight and results are taken in the run's order, so the
  stage holds a bounded number of results whatever the size of the set.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import kernels
from pipeline.errors import UserError
from pipeline.executor.work import PromptResult, accept, run_one
from pipeline.store.artifacts import StageRun

IN_FLIGHT_PER_WORKER = 2
RESEND_PAUSE_S = 1.0       # between sends of a prompt whose actor is unavailable (a node lost)
LOCAL_OBJECT_STORE = 256 * 1024 ** 2     # bytes: a prompt's results are small; Ray's default takes 30 % of RAM
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
# a local Ray on loopback only: without it Ray resolves its node address by the default route
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Every ray.init: the dashboard off (a local Ray listens on nothing beyond its own ports, on 127.0.0.1)
_COMMON = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR", "configure_logging": True,
           "namespace": "nexttoken"}
# How a client gives a cluster's token (Ray 2.60: ray.exceptions.AuthenticationError's own list)
GIVE_TOKEN = ("set RAY_AUTH_MODE=token and give the cluster's token in RAY_AUTH_TOKEN, in a file named by "
              "RAY_AUTH_TOKEN_PATH, or in ~/.ray/auth_token (docs/scale.md)")
# What Ray 2.60 raises (a bare Exception) when its node is not registered within a wait that is fixed at 30 s
# (ray/_private/node.py); seen on a loaded 2-core machine, where the stage then ended in a traceback
START_TIMEOUT = "timed out during startup"
# The retry's wait: the GCS connect window (Ray's default about 20 tries of 1 s), and a pause before it
GCS_WAIT, RETRY_GCS_WAIT_S, RETRY_PAUSE_S = "RAY_gcs_server_port_wait_time_s", 120, 5.0


class Worker:
    """One Ray actor: the kernel pins, then the work (unpickled here, after the pins), its `setup`
    (the model load) once; then prompts."""

    def __init__(self, root: str, work_bytes: bytes, pin_mode: str, threads: int):
        os.environ.update(QUIET_ENV)
        os.chdir(root)              # the repository, at the same path on every node: paths are relative to it
        kernels.pin(pin_mode)                            # the runtime_env set them already: a no-op check
        self.work = pickle.loads(work_bytes)             # imports the stage's model code (torch)
        import torch
        torch.set_num_threads(threads)
        self.where = _where(pin_mode)
        self.work.setup()
        import resource  # the actor's peak RSS with its model loaded (what a worker costs)
        self.where["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)

    def run(self, root: str, config: dict, model: dict | None, prompt_id: str) -> PromptResult:
        result = run_one(self.work, Path(root), config, model, prompt_id)
        result.where = self.where
        return result

    def ready(self) -> dict:
        return self.where


def _where(pin_mode: str) -> dict[str, Any]:
    """Where an actor runs: node, process, device and kernel path (the manifest's per-prompt record)."""
    import platform

    import ray
    import torch

    from pipeline.store import provenance
    ctx = ray.get_runtime_context()
    gpus = ray.get_gpu_ids()
    device = f"cuda ({torch.cuda.get_device_name(0)})" if gpus and torch.cuda.is_available() else "cpu"
    path = provenance.kernel_path()
    return {"node": platform.node(), "node_id": ctx.get_node_id(), "worker_pid": os.getpid(), "device": device,
            "kernel_mode": pin_mode, "aten_cpu_capability": path["aten_cpu_capability"],
            "torch_threads": path["torch_threads"],
            "kernel_path": kernels.summary(path), "cpu_flags": path["cpu_flags"]}


def worker_env(pin_mode: str, threads: int) -> dict[str, str]:
    """The environment every actor gets: the pinning variables as the stage pinned them, the thread
    counts, no usage report."""
    env = {k: v for k in kernels.PIN_VARS if (v := os.environ.get(k)) is not None}
    if pin_mode != "portable":                # portable fixes its own thread count
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    return {**env, **QUIET_ENV}


def _own_threads() -> int:
    """The thread count this stage process computes with, which a serial run uses: reductions split by
    thread (the lens' FP64 sums, say), so another count can change bits."""
    import torch
    return torch.get_num_threads()


def _start(cfg) -> bool:
    """Connect to Ray (start a local one for a null address) -> whether this stage started it."""
    import ray
    import ray.exceptions as rex
    if ray.is_initialized():
        return False
    where = "a local Ray" if cfg.address is None else f"the Ray cluster at executor.address={cfg.address!r}"
    try:
        if cfg.address is None:
            _start_local(cfg)
        else:
            _join(cfg.address)
    except TokenRefused:
        raise UserError(f"could not join {where}: it refused this process's token (\"Authentication token is missing "
                        f"or incorrect\"): {GIVE_TOKEN}") from None
    except StartTimedOut as e:
        raise UserError(f"could not start a local Ray: {e}: run the stage again on a less loaded machine, start "
                        f"one with `ray start --head --node-ip-address 127.0.0.1` and set "
                        f"executor.address=127.0.0.1:6379, or set executor=serial") from None
    except rex.AuthenticationError:        # RAY_AUTH_MODE=token and no token (Ray's own text is a paragraph)
        raise UserError(f"could not start or join {where}: token authentication is on and this process has no "
                        f"token: {GIVE_TOKEN}") from None
    except (ConnectionError, RuntimeError, ValueError) as e:
        hint = "" if cfg.address is None else f" (is it running? does it check a token? then {GIVE_TOKEN})"
        raise UserError(f"could not start or join {where}: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}{hint}") from None
    return True


class TokenRefused(Exception):
    """A cluster that checks a token, joined without it or with another one."""


def _join(address: str) -> None:
    """Join a running cluster. Ray's C++ client logs a line to fd 2 for each of its 20 tries when the cluster refuses
    the token, then raises a ConnectionError that does not say why: its lines are held back, and tell which."""
    import ray
    error = None
    with _held_stderr() as held:
        try:
            ray.init(address=address, **_COMMON)
        except ConnectionError as e:
            error = e
    if error is None:
        sys.stderr.write(held[0])                   # a join's own warnings, as they would have been shown
    elif "InvalidAuthToken" in held[0]:
        raise TokenRefused() from None
    else:
        raise error


@contextlib.contextmanager
def _held_stderr():
    """fd 2 (Python's and the C++ libraries') into a temporary file for the block -> [its text], after the block."""
    sys.stderr.flush()
    saved, held = os.dup(2), []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            held.append(tmp.read().decode(errors="replace"))


class StartTimedOut(Exception):
    """A local Ray that did not come up in time, twice."""


def _start_local(cfg) -> None:
    """A new local Ray on 127.0.0.1 for this stage (never a cluster found through RAY_ADDRESS or Ray's address
    file: "local"); a start-up timeout is retried once, after a pause and with a longer GCS wait."""
    import ray
    args = {"address": "local", "num_cpus": cfg.workers * cfg.cpus_per_worker,
            "num_gpus": cfg.workers * cfg.gpus_per_worker, "object_store_memory": LOCAL_OBJECT_STORE,
            "_node_ip_address": "127.0.0.1", **_COMMON}
    for attempt in (1, 2):
        before = _children()
        try:
            with loopback():
                ray.init(**args)
            _check_loopback()
            return
        except Exception as e:                          # Ray raises a bare Exception for this one
            if START_TIMEOUT not in str(e):
                raise
            with contextlib.suppress(Exception):
                ray.shutdown()
            _stop(_children() - before)      # the half-started node's processes (ray.init keeps no handle on them)
            if attempt == 2:
                wait = os.environ.get(GCS_WAIT)
                raise StartTimedOut(f"its node timed out during start-up twice (the second time with {GCS_WAIT}="
                                    f"{wait})") from None
        time.sleep(RETRY_PAUSE_S)
        os.environ.setdefault(GCS_WAIT, str(RETRY_GCS_WAIT_S))    # read at start-up; a user's own value wins


@contextlib.contextmanager
def loopback():
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (LOOPBACK_ENV) once, when it is imported; where ray was imported
    before `run_prompts` set it (a notebook, an in-process test), Ray took the default route's address for its node
    and bound its GCS, raylet and workers to every interface (seen: `::` and 192.0.2.2), whatever
    `_node_ip_address` said. So the constant it read is set for the start, then put back (a later join of a real
    cluster must resolve its own address)."""
    from ray._private import ray_constants
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _check_loopback() -> None:
    """The local Ray's node is on 127.0.0.1, or it is stopped and the stage refused (never a Ray on the network)."""
    import ray
    node = ray._private.worker.global_worker.node
    if node.node_ip_address != "127.0.0.1" or node.address_info.get("webui_url"):
        ray.shutdown()
        raise UserError(f"the local Ray started on {node.node_ip_address} (dashboard: "
                        f"{node.address_info.get('webui_url') or 'off'}), not on 127.0.0.1 with no dashboard: "
                        f"refused; join a cluster you started instead (executor.address, docs/scale.md)")


def _children() -> set:
    import psutil
    return set(psutil.Process().children(recursive=True))


def _stop(processes: set, wait_s: float = 10) -> None:
    """Terminate `processes`, then kill what is left after `wait_s`."""
    import psutil
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def run_prompts(stage: StageRun, work, prompt_ids: list[str], cfg) -> list[Any]:
    os.environ.update(QUIET_ENV)
    if cfg.address is None:
        os.environ.update(LOOPBACK_ENV)              # read when ray is imported
    import ray

    pin_mode = kernels.pinned_mode() or "native"
    threads = cfg.torch_threads or _own_threads()
    started = _start(cfg)
    actors: list = []
    try:
        actor_cls = ray.remote(Worker).options(
            num_cpus=cfg.cpus_per_worker, num_gpus=cfg.gpus_per_worker, max_restarts=cfg.max_retries,
            max_task_retries=cfg.max_retries, runtime_env={"env_vars": worker_env(pin_mode, threads)})
        blob = pickle.dumps(work)                       # paths and configs: small, re-sent on a restart
        n = max(1, min(cfg.workers, len(prompt_ids)))
        actors = [actor_cls.remote(str(stage.root), blob, pin_mode, threads) for _ in range(n)]
        where = _ready(actors, cfg.prompt_timeout_s)
        stage.executor = {"kind": "ray", "address": cfg.address, "workers": n, "cpus_per_worker": cfg.cpus_per_worker,
                          "gpus_per_worker": cfg.gpus_per_worker, "torch_threads": threads,
                          "max_retries": cfg.max_retries, "ray_version": ray.__version__,
                          "nodes": sorted({w["node"] for w in where}), "prompts": {}}
        values, pending, queue = [], deque(), deque(prompt_ids)
        root, config = str(stage.root), stage.config
        while queue or pending:
            while queue and len(pending) < IN_FLIGHT_PER_WORKER * n:
                pid = queue.popleft()
                actor = actors[(len(prompt_ids) - len(queue) - 1) % n]
                send = functools.partial(actor.run.remote, root, config, stage.model, pid)
                pending.append((pid, send, send()))
            pid, send, ref = pending.popleft()          # the run's order: the set-level files depend on it
            result = _get(stage, cfg, pid, send, ref)
            values.append(accept(stage, result))
            stage.executor["prompts"][pid] = result.where
        return values
    finally:
        for a in actors:
            with contextlib.suppress(Exception):       # already gone: nothing to stop
                ray.kill(a, no_restart=True)
        if started:
            ray.shutdown()


def _get(stage: StageRun, cfg, pid: str, send: Callable[[], Any], ref) -> PromptResult:
    """One prompt's result, within executor.prompt_timeout_s. A node lost mid-run (its raylet and object store gone)
    ends the calls on its actors in ActorUnavailableError until the cluster declares the node dead and Ray restarts
    the actors elsewhere (seen: the call sent again at once failed so, three times in a row, and the stage ended);
    Ray does not send such a call again itself. So the prompt is sent again to the same actor, a second apart,
    until it answers or the bound is spent (`send`: the same call again, a new reference); a result that was
    waiting in the lost node's object store (ObjectLostError) is sent again the same way. A worker writes nothing:
    running a prompt twice changes no byte. An actor that is dead for good (Ray's restarts, executor.max_retries,
    spent) or a wait past the bound is one line naming the prompt."""
    import ray
    import ray.exceptions as rex
    deadline = time.monotonic() + cfg.prompt_timeout_s
    while True:
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except rex.GetTimeoutError:
            raise UserError(f"stage {stage.stage}: prompt {pid} did not finish within executor.prompt_timeout_s="
                            f"{cfg.prompt_timeout_s} s on Ray") from None
        except (rex.ActorUnavailableError, rex.ObjectLostError) as e:
            if time.monotonic() + RESEND_PAUSE_S >= deadline:
                raise UserError(f"stage {stage.stage}: prompt {pid} did not finish within executor.prompt_timeout_s="
                                f"{cfg.prompt_timeout_s} s on Ray: its worker or node was lost and it was not back "
                                f"in time ({type(e).__name__})") from None
            time.sleep(RESEND_PAUSE_S)
            ref = send()
        except (rex.RayActorError, rex.ActorDiedError, rex.WorkerCrashedError, rex.NodeDiedError) as e:
            raise UserError(f"stage {stage.stage}: prompt {pid} failed on Ray after executor.max_retries="
                            f"{cfg.max_retries} retries: its worker died ({type(e).__name__})") from None


def _ready(actors: list, timeout_s: float) -> list[dict]:
    """Every actor constructed (its model loaded) within the bound, or one line saying which failed."""
    import ray
    import ray.exceptions as rex
    start = time.monotonic()
    try:
        return ray.get([a.ready.remote() for a in actors], timeout=timeout_s)
    except rex.GetTimeoutError:
        raise UserError(f"the Ray workers were not ready within executor.prompt_timeout_s={timeout_s} s "
                        f"({time.monotonic() - start:.0f} s): does the cluster have the CPUs and GPUs asked for?") \
            from None
    except rex.RayActorError as e:
        cause = str(e).strip().splitlines()
        raise UserError("a Ray worker failed to start: " + next((c for c in reversed(cause) if c.strip()), "?")) \
            from None
