"""Faults under DVC, in a temporary git clone of this working tree (slow).

- A fresh `dvc repro` gives data files byte-identical to the chain run by the fast tests
  in another workspace (two fresh sets of processes, same config).
- A stage killed (SIGKILL and SIGINT) while writing capture.safetensors or logits.parquet:
  no partial file under artifacts/, `dvc status` says the stage must re-run, and `dvc repro`
  then gives outputs identical to the uninterrupted run.
- Two experiments run at once (`dvc queue start -j 2`) give the data files of the same two
  run one after the other.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from pipeline.store import paths
from tests.conftest import ON_CPU
from tests.helpers import worktree
from tests.helpers.worktree import clone_worktree
from tests.reliability.conftest import data_hashes, is_data_file, staging_left
from tests.reliability.test_interrupted import POINTS, partial_file, start_paused

pytestmark = pytest.mark.slow
SEEDS = (1, 2)   # two experiments that re-run the trajectories stage (sampling.seed) and nothing else
# The data stages (prepare_model .. trajectories): checks and report re-verify and render them,
# at a cost these tests do not need.
TARGETS = ("probs", "trajectories", "lens")     # what the session chain (chain_ws) holds
sh = functools.partial(worktree.sh, timeout=1200)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    repo = clone_worktree(tmp_path_factory.mktemp("faults_clone"), decode_steps=4)
    sh(repo, "nexttoken", "compose", "model=tiny_qwen2", ON_CPU)    # as chain_ws, which it is compared with
    sh(repo, "dvc", "repro", *TARGETS)
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "tiny_qwen2 run")
    return repo


def test_fresh_chains_in_two_workspaces_are_byte_identical(clone, chain_ws):
    """Every data file of the fast tests' chain (prepare_model to trajectories) is in the clone, same bytes."""
    ours, theirs = data_hashes(clone), data_hashes(chain_ws)
    assert len(theirs) > 15 and {k: ours.get(k) for k in theirs} == theirs


@pytest.mark.parametrize("point", list(POINTS))
def test_killed_stage_under_dvc_reruns_to_identical_outputs(clone, point):
    stage = POINTS[point][0]
    baseline = data_hashes(clone)
    for sig in (signal.SIGKILL, signal.SIGINT):
        proc, pid = start_paused(clone, point, ["dvc", "repro", "--force", "--single-item", stage])
        partial_file(clone, point, pid)
        os.kill(pid, sig)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode != 0, out + err
        now = data_hashes(clone)
        assert all(baseline.get(k) == v for k, v in now.items()), "a partial or changed file under artifacts/"
        assert not any(k.startswith(f"artifacts/{stage}/") for k in now)    # DVC removed the outputs first
        status = sh(clone, "dvc", "status", "--with-deps", *TARGETS).stdout
        assert f"{stage}:" in status and "up to date" not in status, status
        if sig == signal.SIGKILL:      # no clean-up ran: its staging folder is left ...
            assert staging_left(clone) == [f"{stage}-{pid}"]
        else:                          # ... and the next run of the stage (this one) removed it
            assert "Traceback" not in err and f"nexttoken {stage}: interrupted" in err, err
            assert staging_left(clone) == []
    sh(clone, "dvc", "repro", *TARGETS)
    assert data_hashes(clone) == baseline
    assert staging_left(clone) == [] and "up to date" in sh(clone, "dvc", "status", "--with-deps", *TARGETS).stdout
    sh(clone, "git", "add", "-A")
    sh(clone, "git", "commit", "-qm", f"after {point}", check=False)


def _exp_refs(repo: Path) -> set[str]:
    """Commits of the experiments (refs/exps/<2 hex>/<38 hex>/<name>; not DVC's queue and exec refs)."""
    out = sh(repo, "git", "for-each-ref", "--format=%(objectname) %(refname)", "refs/exps").stdout
    return {line.split()[0] for line in out.splitlines()
            if re.fullmatch(r"refs/exps/[0-9a-f]{2}/[0-9a-f]{38}/[^/]+", line.split()[1])}


def _outputs(repo: Path, commit: str) -> tuple[int, dict[str, str]]:
    """(sampling.seed, md5 of every data file the commit's dvc.lock records, folders expanded)."""
    seed = yaml.safe_load(sh(repo, "git", "show", f"{commit}:params.yaml").stdout)["sampling"]["seed"]
    lock = yaml.safe_load(sh(repo, "git", "show", f"{commit}:dvc.lock").stdout)["stages"]
    files = {}
    for spec in lock.values():
        for out in spec.get("outs", []):
            if out["md5"].endswith(".dir"):
                listing = repo / ".dvc/cache/files/md5" / out["md5"][:2] / out["md5"][2:]
                files |= {f"{out['path']}/{e['relpath']}": e["md5"] for e in json.loads(listing.read_text())}
            else:
                files[out["path"]] = out["md5"]
    return seed, {k: v for k, v in files.items() if is_data_file(k)}


def test_two_experiments_at_once_equal_the_same_run_one_after_the_other(clone):
    sh(clone, "git", "add", "-A")
    sh(clone, "git", "commit", "-qm", "baseline for the queue", check=False)
    first = _exp_refs(clone)
    try:
        for seed in SEEDS:
            sh(clone, "dvc", "exp", "run", "--queue", "-S", "model=tiny_qwen2", "-S", ON_CPU, "-S",
               f"sampling.seed={seed}", "trajectories")
        sh(clone, "dvc", "queue", "start", "-j", "2")
        status = worktree.wait_for_queue(clone, 1200)
    finally:
        sh(clone, "dvc", "queue", "stop", "--kill", check=False)
    assert "Failed" not in status, status
    together = dict(_outputs(clone, c) for c in _exp_refs(clone) - first)
    for seed in SEEDS:                                      # the same experiments, one after the other
        before = _exp_refs(clone)
        sh(clone, "dvc", "exp", "run", "-S", "model=tiny_qwen2", "-S", ON_CPU, "-S", f"sampling.seed={seed}",
           "trajectories")
        (commit,) = _exp_refs(clone) - before
        seed_read, files = _outputs(clone, commit)
        assert seed_read == seed and files == together[seed], seed
    assert set(together) == set(SEEDS)
    steps = paths.partition(paths.STEPS, "temperature_question").as_posix()      # the default prompt's
    assert together[1][steps] != together[2][steps]     # the seed mattered: trajectories really re-ran
