"""executor=ray (issue 29): a set's per-prompt work on Ray actors, on a local cluster of two nodes.

- The same bytes as `executor=serial`: every output sha256 of every stage's manifest, every file.
- A worker SIGKILLed mid-stage: Ray restarts it, the prompt is retried, the bytes are the same.
- Retries exhausted: the stage fails in one line naming the prompt, nothing partial in artifacts/.
- Ctrl-C of a stage that started its own local Ray: one line, Ray shut down, nothing partial.

The faults come from tests/helpers/ray_fault_site (a test-only hook in the workers' processes).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from pipeline.errors import UserError, interrupted
from pipeline.store import paths
from pipeline.store.artifacts import read_manifest
from tests.conftest import copy_ws, snapshot
from tests.helpers import ray_faults
from tests.helpers.inprocess import run_chain

pytestmark = pytest.mark.slow
PROMPTS = 4
MODEL_STAGES = ("forward", "probs", "trajectories", "lens", "checks")
AFTER_TOKENIZE = ("forward", "logits", "probs", "trajectories", "lens", "checks")


def _compose(ws, *overrides):
    ray_faults.compose(ws, "four.jsonl", *overrides)


def _outputs(ws, stage) -> dict[str, str]:
    return ray_faults.outputs(ws, stage)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    plan = tmp_path_factory.mktemp("ray_fault") / "plan.json"
    with ray_faults.cluster(plan) as c:
        yield c, plan


@pytest.fixture(scope="module")
def tokenized(tiny_workspace, tmp_path_factory):
    """tiny_workspace with a four-prompt set, tokenized (serial composition)."""
    return ray_faults.tokenized_set(tiny_workspace, tmp_path_factory.mktemp("ray_set") / "ws", PROMPTS, "four.jsonl")


@pytest.fixture(scope="module")
def serial(tokenized, tmp_path_factory):
    ws = copy_ws(tokenized, tmp_path_factory.mktemp("ray_serial") / "ws")
    run_chain(ws, AFTER_TOKENIZE)
    return ws


def _ray_ws(tokenized, dest, cluster, *overrides):
    ws = copy_ws(tokenized, dest)
    _compose(ws, "executor=ray", f"executor.address={cluster.address}", *overrides)
    return ws


def test_ray_gives_the_serial_bytes_and_records_where_each_prompt_ran(ray_cluster, serial, tokenized, tmp_path):
    cluster, plan = ray_cluster
    ray_faults.plan(plan, None)
    ws = _ray_ws(tokenized, tmp_path / "ws", cluster)
    run_chain(ws, AFTER_TOKENIZE)
    pids = paths.prompt_ids(paths.TOKENS, ws)
    assert len(pids) == PROMPTS
    for stage in AFTER_TOKENIZE:
        assert _outputs(ws, stage) == _outputs(serial, stage), stage
    for stage in MODEL_STAGES:
        ex = read_manifest(stage, ws)["executor"]
        assert ex["kind"] == "ray" and ex["workers"] == 2 and ex["address"] == cluster.address
        assert sorted(ex["prompts"]) == pids, stage
        assert len({w["node_id"] for w in ex["prompts"].values()}) == 2, f"{stage}: both nodes worked"
        for where in ex["prompts"].values():
            assert where["device"] == "cpu" and where["kernel_path"] and where["aten_cpu_capability"]
            assert where["torch_threads"] == torch.get_num_threads()     # the stage's own count, sent explicitly
        assert read_manifest(stage, serial)["executor"]["kind"] == "serial"
    # every file's bytes, not only the recorded sha256 (the manifests differ: times, executor)
    for f in sorted((serial / paths.ARTIFACTS).rglob("*")):
        rel = f.relative_to(serial)
        if f.is_file() and rel.parts[1] in AFTER_TOKENIZE and f.name != paths.MANIFEST:
            assert (ws / rel).read_bytes() == f.read_bytes(), rel


def test_a_worker_killed_mid_stage_is_restarted_and_the_bytes_are_the_same(ray_cluster, serial, tokenized, tmp_path):
    cluster, plan = ray_cluster
    ws = _ray_ws(tokenized, tmp_path / "ws", cluster)
    run_chain(ws, ("forward", "logits"))
    victim, marker = paths.prompt_ids(paths.TOKENS, ws)[2], tmp_path / "killed"
    ray_faults.plan(plan, "trajectories", victim, "kill-once", marker)
    try:
        run_chain(ws, ("trajectories",))
    finally:
        ray_faults.plan(plan, None)
    assert marker.exists(), "the fault never fired: nothing was killed"
    killed = int(marker.read_text())
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
    assert _outputs(ws, "trajectories") == _outputs(serial, "trajectories")
    assert read_manifest("trajectories", ws)["executor"]["prompts"][victim]["worker_pid"] != killed


def test_retries_exhausted_fail_in_one_line_naming_the_prompt_with_nothing_partial(ray_cluster, tokenized, tmp_path):
    cluster, plan = ray_cluster
    ws = _ray_ws(tokenized, tmp_path / "ws", cluster, "executor.max_retries=1")
    run_chain(ws, ("forward",))
    before = snapshot(ws)
    victim, marker = paths.prompt_ids(paths.TOKENS, ws)[1], tmp_path / "killed"
    ray_faults.plan(plan, "forward", victim, "kill-always", marker)
    try:
        with pytest.raises(UserError) as err:
            run_chain(ws, ("forward",))
    finally:
        ray_faults.plan(plan, None)
    message = str(err.value)
    assert "\n" not in message and f"prompt {victim}" in message and "executor.max_retries=1" in message, message
    assert len(marker.read_text().split()) == 2           # the first try and its one retry, each killed
    assert snapshot(ws) == before
    assert not list((ws / paths.STAGING).glob("forward-*"))


def _ray_processes() -> set[int]:
    names = ("raylet", "gcs_server", "ray::")
    out = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(n in cmd for n in names):
            out.add(p.info["pid"])
    return out


def test_ctrl_c_of_a_stage_on_its_own_local_ray_is_one_line_and_shuts_ray_down(ray_cluster, tokenized, tmp_path):
    _, plan = ray_cluster
    ws = copy_ws(tokenized, tmp_path / "ws")
    _compose(ws, "executor=ray", "executor.workers=1")      # address null: the stage starts its own Ray
    run_chain(ws, ("forward",))
    before, theirs = snapshot(ws), _ray_processes()
    victim, marker, own_plan = paths.prompt_ids(paths.TOKENS, ws)[1], tmp_path / "paused", tmp_path / "plan.json"
    ray_faults.plan(own_plan, "forward", victim, "pause", marker)
    proc = subprocess.Popen([sys.executable, "-m", "stages.forward"], cwd=ws, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ray_faults.env(own_plan))
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marker.exists(), f"the stage never reached prompt {victim}: {proc.communicate(timeout=60)}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == [interrupted("forward")], err
    assert snapshot(ws) == before
    deadline = time.monotonic() + 60
    while (left := _ray_processes() - theirs) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [" ".join(psutil.Process(p).cmdline()) for p in left if psutil.pid_exists(p)]
    assert not list((ws / paths.STAGING).glob("forward-*"))
