"""End to end: a 3 x 2 sampling sweep on tiny_qwen2 through DVC's queue, then sweep, audit, diff.

In a temporary git clone of this working tree (tests/helpers/worktree.py, as tests/e2e/test_dvc_repro.py uses):
`dvc repro`, commit, queue six experiments and run them with two workers. The forward pass
must come from the cache in every experiment, and `nexttoken sweep / audit --rev / diff`
must work on experiments that were never checked out.
"""

from __future__ import annotations

import json
import re
import time

import pandas as pd
import pytest
import yaml
from rich.cells import cell_len

from pipeline.tools import revisions, sweep
from tests.helpers import shared
from tests.helpers.worktree import sh, wait_for_queue

pytestmark = pytest.mark.slow
TEMPERATURES, TOP_PS = (0.5, 1.0, 2.0), (0.9, 1.0)
SWEEP = ("-S", "model=tiny_qwen2", "-S", "sampling.temperature=0.5,1.0,2.0", "-S", "sampling.top_p=0.9,1.0")
FORWARD_REUSED = ("Stage 'forward' didn't change, skipping", "Stage 'forward' is cached - skipping run")
QUEUE_TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    started = time.monotonic()
    repo = shared.baseline_clone(tmp_path_factory.mktemp("sweep_clone") / "repo")    # run and committed
    try:
        sh(repo, "dvc", "exp", "run", "--queue", *SWEEP)
        sh(repo, "dvc", "queue", "start", "-j", "2")
        status = wait_for_queue(repo, QUEUE_TIMEOUT_S, poll_s=10)
        print(f"\nbaseline + 6 queued experiments: {time.monotonic() - started:.0f} s\n{status}")
        yield repo
    finally:   # never leave celery workers behind, whatever happened
        sh(repo, "dvc", "queue", "stop", "--kill", check=False)


@pytest.fixture(scope="module")
def shown(swept) -> dict[str, dict]:
    """Experiment name -> its `dvc exp show --json` record."""
    data = json.loads(sh(swept, "dvc", "exp", "show", "--json").stdout)
    return {e["name"]: e for b in data for e in b.get("experiments") or []}


def by_setting(shown: dict[str, dict]) -> dict[tuple[float, float], str]:
    out = {}
    for name, e in shown.items():
        s = e["revs"][0]["data"]["params"]["params.yaml"]["data"]["sampling"]
        out[(s["temperature"], s["top_p"])] = name
    return out


def test_six_experiments_ran_and_reused_the_forward_pass(swept, shown):
    assert len(shown) == 6 and set(revisions.experiments(swept)) == set(shown)
    assert {e["executor"]["state"] if e.get("executor") else "success" for e in shown.values()} == {"success"}
    assert set(by_setting(shown)) == {(t, p) for t in TEMPERATURES for p in TOP_PS}
    baseline = yaml.safe_load((swept / "params.yaml").read_text())["sampling"]
    for setting, name in by_setting(shown).items():
        log = sh(swept, "dvc", "queue", "logs", name).stdout
        assert any(msg in log for msg in FORWARD_REUSED), f"{name}: forward ran again:\n{log}"
        # Only the sampling stages re-run, and only where the setting is not the baseline's.
        rerun = setting != (baseline["temperature"], baseline["top_p"])
        for stage in ("probs", "trajectories"):
            assert (f"Running stage '{stage}'" in log) == rerun, f"{name} {setting}:\n{log}"


def test_exp_show_lists_the_sweep_metrics(swept, shown):
    stages = yaml.safe_load((swept / "dvc.yaml").read_text())["stages"]
    for name, e in shown.items():
        metrics = e["revs"][0]["data"]["metrics"]
        probs = metrics["artifacts/probs/metrics.json"]["data"]
        assert set(probs) == {"kept", "mass", "top_bits", "entropy", "entropy_median", "entropy_mean",
                              "kept_median"}, name
        traj = metrics["artifacts/trajectories/metrics.json"]["data"]
        assert set(traj) == {"sample", "greedy", "sample_loop", "greedy_loop", "diverge", "kv_diff", "n_prompts",
                             "greedy_loop_rate", "sample_loop_rate", "diverge_mean"}, name
        if "checks" in stages:
            checks = metrics["artifacts/checks/metrics.json"]["data"]
            assert checks["checks"] > 0 and checks["failing"], name


def test_exp_show_only_changed_fits_160_columns_with_the_swept_params(swept):
    """The sweep dashboard as the README gives it (DVC's hash columns of the changed artifacts, its
    Executor column and the set keys, a single prompt's own figures again, dropped): no column cut
    (DVC would print `…`), the swept params shown."""
    out = sh(swept, "dvc", "exp", "show", "--only-changed", "--drop",
             "^artifacts/|^prompts$|^Executor$|.*_(median|mean|rate)$|^n_prompts$", "--no-pager",
             env={"COLUMNS": "160"}).stdout
    assert max(cell_len(line) for line in out.splitlines()) <= 160, out     # terminal columns (CJK: two)
    header = out.splitlines()[1].split()
    for name in ("sampling.temperature", "sampling.top_p", "kept", "mass", "entropy", "sample"):
        assert name in header, f"{name} cut or hidden:\n{out}"       # DVC cuts a column to `…` when short of room


def test_sweep_writes_the_table_and_deterministic_plots(swept, tmp_path):
    proc = sh(swept, "nexttoken", "sweep")
    assert "wrote 6 experiments and their baseline" in proc.stdout
    assert proc.stdout.split()[:4] == ["exp", "kind", "temperature", "top_p"]      # the table, on the terminal
    out = swept / sweep.OUT
    table = pd.read_parquet(out / sweep.TABLE)
    assert len(table) == 7 and len(pd.read_csv(out / sweep.CSV)) == 7
    assert table.loc[0, "kind"] == "baseline" and table.loc[0, sweep.KEPT] > 0    # the baseline commit's own run
    df = table[table["kind"] == "experiment"]
    assert set(zip(df["sampling.temperature"], df["sampling.top_p"])) == {(t, p) for t in TEMPERATURES for p in TOP_PS}
    assert (df["model.name"] == "tiny_qwen2").all()
    full = df[df["sampling.top_p"] == 1.0]
    assert (full[sweep.KEPT] == 152064).all()                     # top_p = 1 keeps the whole vocabulary
    assert (df[df["sampling.top_p"] == 0.9][sweep.KEPT] < 152064).all()
    assert full.sort_values("sampling.temperature")[sweep.TOP].is_monotonic_decreasing
    for png in (sweep.KEPT_PLOT, sweep.TEMPERATURE_PLOT):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again"
    sh(swept, "nexttoken", "sweep", "--out", str(again))
    for name in (sweep.TABLE, sweep.KEPT_PLOT, sweep.TEMPERATURE_PLOT):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_audit_of_an_experiment_that_is_not_checked_out_is_clean(swept, shown):
    name = by_setting(shown)[(0.5, 0.9)]
    before = (swept / "params.yaml").read_bytes()
    proc = sh(swept, "nexttoken", "audit", "--rev", name, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == f"audit of experiment {name} ({shown[name]['revs'][0]['rev'][:7]})"
    assert proc.stdout.splitlines()[-1].startswith("verdict: CLEAN")
    assert (swept / "params.yaml").read_bytes() == before   # the workspace was not touched


def test_diff_of_two_experiments_names_the_swept_keys_and_the_divergence(swept, shown):
    a, b = by_setting(shown)[(0.5, 0.9)], by_setting(shown)[(2.0, 1.0)]
    out = sh(swept, "nexttoken", "diff", a, b).stdout
    keys = [line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("  config ")]
    assert keys == ["sampling.temperature", "sampling.top_p"], out
    assert "  config sampling.temperature: 0.5 | 2.0" in out
    assert "logits: identical logits.parquet" in out                 # the forward pass was shared
    assert re.search(r"^  sample: diverges at step \d+: A chose \d+ .* \| B chose \d+ ", out, re.M), out
    assert re.search(r"^  greedy: identical \(\d+ steps\)", out, re.M), out   # greedy ignores T and top_p
