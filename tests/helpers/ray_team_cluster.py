"""A Ray cluster of a real cluster's shape, for the executor's multi-node test (issue 49 item 3): a head with no
CPUs (no work runs there) and worker nodes, every node on 127.0.0.1, token authentication on
(`ray.cluster_utils.Cluster`: several raylets on one machine).

It runs in a process of its own (`python -m tests.helpers.ray_team_cluster SPEC`), so the token and Ray's
per-process config never touch the test's process; the environment it is started with (RAY_AUTH_MODE=token,
RAY_AUTH_TOKEN, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the fault hook of tests/helpers/ray_faults.py) is what its
raylets and their workers inherit. It prints one JSON line describing the cluster, then answers one JSON line per
command read on stdin: {"op": "remove", "node_id": ID} (the whole worker node: raylet, object store, workers,
agents, killed at once, as a machine that is lost), {"op": "stop"}. The test drives it (`TeamCluster`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

NODE = {"node_ip_address": "127.0.0.1", "object_store_memory": 100 * 1024 ** 2, "include_dashboard": False}


def _describe(node) -> dict:
    pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
    return {"node_id": node.node_id, "pids": pids}


def main(spec: dict) -> None:
    from ray.cluster_utils import Cluster

    from pipeline.executor.cluster import loopback
    with loopback():
        c = Cluster(initialize_head=True, shutdown_at_exit=True,
                    head_node_args={**NODE, "num_cpus": 0, "temp_dir": spec["temp_dir"]})
        workers = [c.add_node(**NODE, num_cpus=spec["cpus"]) for _ in range(spec["workers"])]
    c.wait_for_nodes()
    print(json.dumps({"address": c.address, "head": _describe(c.head_node),
                      "workers": [_describe(n) for n in workers]}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "remove":
                node = next(n for n in c.worker_nodes if n.node_id == cmd["node_id"])
                c.remove_node(node, allow_graceful=False)
                print(json.dumps({"removed": cmd["node_id"]}), flush=True)
            elif cmd["op"] == "stop":
                break
    finally:
        c.shutdown()
        with contextlib.suppress(Exception):
            c.head_node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)


class TeamCluster:
    """The cluster process, from the test's side: `address`, `head`, `workers` ({node_id, pids}), `remove(node_id)`,
    `processes()` (every live process of the cluster: the nodes' own and the workers under them), `stop()`."""

    def __init__(self, env: dict[str, str], temp_dir: Path, workers: int = 2, cpus: int = 2, timeout_s: float = 240):
        spec = {"workers": workers, "cpus": cpus, "temp_dir": str(temp_dir)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.ray_team_cluster", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=Path(__file__).resolve().parents[2])
        self.timeout_s = timeout_s
        info = self._answer()
        self.address, self.head, self.workers = info["address"], info["head"], info["workers"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the cluster process ended ({self.proc.wait(timeout=30)})")
        return json.loads(line)

    def remove(self, node_id: str) -> None:
        self.proc.stdin.write(json.dumps({"op": "remove", "node_id": node_id}) + "\n")
        self.proc.stdin.flush()
        assert self._answer() == {"removed": node_id}

    def processes(self) -> list[psutil.Process]:
        """The cluster process and everything under it (GCS, raylets, agents, Ray's workers)."""
        me = psutil.Process(self.proc.pid)
        return [me, *me.children(recursive=True)]

    def stop(self) -> None:
        left = self.processes() if self.proc.poll() is None else []
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for p in left:                          # only the processes this cluster started, by their ids
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=30)


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main(json.loads(sys.argv[1]))
