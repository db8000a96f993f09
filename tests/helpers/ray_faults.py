"""Faults in Ray workers, for the executor's tests: a local cluster of two nodes on 127.0.0.1 whose
processes run `tests/helpers/ray_fault_site/sitecustomize.py`, and the plan file that tells them
which prompt to kill or pause (`plan`). The hook belongs to the tests: no production code reads it."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

ENV = "NEXTTOKEN_TEST_RAY_FAULT"
SITE = Path(__file__).resolve().parent / "ray_fault_site"
# Ray on loopback only: no usage report, and node addresses resolved to 127.0.0.1 (otherwise Ray
# picks the address of the interface with the default route)
LOCAL = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 100 * 1024 ** 2}


def env(plan_file: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    base = dict(os.environ if base is None else base)
    return {**base, **LOCAL, ENV: str(plan_file),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), base.get("PYTHONPATH")]))}


@contextlib.contextmanager
def cluster(plan_file: Path, nodes: int = 2):
    """A local Ray cluster (`ray.cluster_utils.Cluster`) of `nodes` one-CPU nodes, this process connected."""
    saved = dict(os.environ)
    os.environ.update(env(plan_file))             # the raylets (and so their workers) inherit it
    import ray  # after: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER on import
    from ray._raylet import AuthenticationMode, get_authentication_mode
    from ray.cluster_utils import Cluster

    from pipeline.executor.cluster import loopback
    if get_authentication_mode() == AuthenticationMode.TOKEN:
        # a local ray.init earlier in this process (test_ray_start) turned token auth on for the process (Ray's
        # config is per process and stays): the cluster's nodes must check tokens too, or its actors never start
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        # loopback: where an earlier test of this worker imported ray, it read the variable already, and the
        # head and this driver took the machine's interface address (ray.init then waited on it for ever)
        with loopback():
            c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
            for _ in range(nodes - 1):
                c.add_node(**NODE)
            ray.init(address=c.address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def plan(plan_file: Path, stage: str | None, prompt: str | None = None, mode: str = "kill-once",
         marker: Path | None = None) -> None:
    """Set the fault (stage None: none)."""
    if stage is None:
        plan_file.unlink(missing_ok=True)
        return
    plan_file.write_text(json.dumps({"stage": stage, "prompt": prompt, "mode": mode, "marker": str(marker)}))


def compose(ws: Path, set_file: str, *overrides: str) -> None:
    """`nexttoken compose` of the tests' tiny_qwen2 chain over prompts/`set_file`."""
    from tests.conftest import TEST_STEPS, run_module
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "capture.device=cpu", "model=tiny_qwen2",
               f"prompt.set=prompts/{set_file}", *overrides, check=True)


def outputs(ws: Path, stage: str) -> dict[str, str]:
    """A stage's output files and their sha256, from its manifest."""
    from pipeline.store.artifacts import read_manifest
    return {o["path"]: o["sha256"] for o in read_manifest(stage, ws)["outputs"]}


def tokenized_set(tiny_workspace: Path, dest: Path, n: int, set_file: str) -> Path:
    """A copy of tiny_workspace with the first `n` prompts of prompts/concepts.jsonl as prompts/`set_file`,
    composed and run through validate and tokenize (serial)."""
    from tests.conftest import REPO, copy_ws
    from tests.helpers.inprocess import run_chain
    ws = copy_ws(tiny_workspace, dest)
    lines = (REPO / "prompts/concepts.jsonl").read_text(encoding="utf-8").splitlines()[:n]
    (ws / "prompts").mkdir(exist_ok=True)
    (ws / "prompts" / set_file).write_text("\n".join(lines) + "\n", encoding="utf-8")
    compose(ws, set_file)
    run_chain(ws, ("validate", "tokenize"))
    return ws
