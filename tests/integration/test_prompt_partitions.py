"""Every stage loops over the run's prompts, one partition each (issue 17 items 2 and 3).

`prompt_set.for_config` still gives a set of one, so the second prompt is made by hand: the
session run's tokenize partition copied under another id and recorded in tokenize's manifest,
as a tokenize stage over a two-prompt set would have written it. forward -> trajectories then
run over both prompts (one model load per stage), and each prompt's files hold exactly the
numbers the single-prompt run holds: a prompt alone and inside a set give the same content.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.numerics import probs
from pipeline.store import paths, provenance
from pipeline.store.artifacts import read_dataset, read_parquet, tables_stored
from pipeline.tools import audit
from tests.conftest import CHAIN, copy_ws, run_module

TWIN = "twin.2"


def _content(path) -> str:
    """What identical means: the tensors / table content (metadata aside), else the bytes."""
    return provenance.logical_hash(path) or provenance.sha256_file(path)


@pytest.fixture(scope="module")
def two_prompts(tiny_workspace, tmp_path_factory) -> Path:
    """tiny_workspace with a second prompt (a copy of the first under the id TWIN), forward -> trajectories run
    over both (read-only: the report test works on a copy)."""
    ws = copy_ws(tiny_workspace, tmp_path_factory.mktemp("two_prompts") / "ws")
    (pid,) = paths.prompt_ids(paths.TOKENS, ws)
    manifest = json.loads(paths.manifest_path("tokenize", ws).read_text())
    for item in (paths.TOKENS, paths.TOKENIZE_SUMMARY):
        twin = paths.partition(item, TWIN, ws)
        twin.parent.mkdir(parents=True)
        shutil.copy2(paths.partition(item, pid, ws), twin)
        if item == paths.TOKENIZE_SUMMARY:            # the id tokenize records for the prompt
            twin.write_text(json.dumps({**json.loads(twin.read_text(encoding="utf-8")), "prompt_id": TWIN}),
                            encoding="utf-8")
        manifest["outputs"].append(provenance.file_record(twin, ws))
    paths.manifest_path("tokenize", ws).write_text(json.dumps(manifest, indent=2))
    for stage in CHAIN:
        run_module(f"stages.{stage}", ws, check=True)
    return ws


def test_two_prompts_run_in_one_pass_each_equal_to_the_prompt_alone(two_prompts, tiny_chain):
    ws = two_prompts                                 # read only (the audit writes nothing)
    (pid,) = paths.prompt_ids(paths.TOKENS, tiny_chain)
    per_prompt = [i for i in paths.PER_PROMPT if i[0] in CHAIN]
    # a set (probs.table auto) derives the full-vocabulary tables the prompt alone stores: what a reader gets in
    # their place is the prompt alone's table, value for value
    probs_manifest = json.loads(paths.manifest_path("probs", ws).read_text())
    assert not tables_stored(probs_manifest)
    for item in probs.DERIVABLE:
        assert paths.prompt_ids(item, ws) == [] and (paths.dataset(item, ws) / probs.DERIVED_NOTE).is_file(), item
        alone = read_parquet(paths.partition(item, pid, tiny_chain))
        for p in (pid, TWIN):
            assert probs.read_table(paths.lookup(ws), p, probs_manifest, item).equals(alone), (item, p)
    per_prompt = [i for i in per_prompt if i not in probs.DERIVABLE]
    for item in per_prompt:
        assert paths.prompt_ids(item, ws) == sorted([pid, TWIN]), item
        alone = _content(paths.partition(item, pid, tiny_chain))
        for p in (pid, TWIN):
            assert _content(paths.partition(item, p, ws)) == alone, (item, p)
    outputs = {o["path"] for s in CHAIN for o in json.loads(paths.manifest_path(s, ws).read_text())["outputs"]}
    assert {paths.partition(i, p).as_posix() for i in per_prompt for p in (pid, TWIN)} <= outputs

    # the run-level per-prompt tables hold one block of rows per prompt, each the prompt alone's
    for item in (paths.PROBS_PROMPT_METRICS, paths.TRAJECTORY_PROMPT_METRICS):
        alone = read_parquet(paths.artifact(item, tiny_chain)).drop_columns(["prompt_id"]).to_pylist()
        both = read_parquet(paths.artifact(item, ws))
        assert sorted(set(both["prompt_id"].to_pylist())) == sorted([pid, TWIN]), item
        for p in (pid, TWIN):
            rows = both.filter(pc.field("prompt_id") == p).drop_columns(["prompt_id"]).to_pylist()
            assert rows == alone, (item, p)

    # the set reads as one table; a filter on prompt_id reads one prompt's rows
    whole = read_dataset(paths.LOGITS, ws)
    one = read_dataset(paths.LOGITS, ws, filter=pc.field("prompt_id") == TWIN)
    assert whole.num_rows == 2 * one.num_rows and set(one["prompt_id"].to_pylist()) == {TWIN}
    # the audit re-derives probs per partition
    result = audit.audit_folder(ws, "two prompts")
    assert any("re-derived" in n and "(2 prompt(s))" in n for n in result.notes), result.lines()
    assert result.clean, result.lines()


# ---------------------------------------------------------------- the report of a set (item 6)
def _checks_by_prompt(ws: Path, pid: str) -> None:
    """A checks.parquet in the checks stage's schema with prompt_id (first column): pid 2 pass, TWIN 1 pass and
    1 fail, one run-wide row; as the checks stage over a set writes it."""
    rows = [(pid, "lm_head_recompute", "pass"), (pid, "fp64_sum", "pass"), (TWIN, "lm_head_recompute", "pass"),
            (TWIN, "fp64_sum", "fail"), (None, "environment", "pass")]
    table = pa.Table.from_pylist([{"prompt_id": p, "name": n, "what": "x vs y", "measured": 0.0, "tolerance": 0.0,
                                   "verdict": v, "severity": "error", "detail": p or "run-wide"} for p, n, v in rows])
    paths.stage_dir("checks", ws).mkdir(parents=True, exist_ok=True)
    pq.write_table(table, paths.artifact(paths.CHECKS, ws))


def _set_key(ws: Path, value: str | None) -> None:
    """report.prompt_id in the report stage's validated config: the stage reads that file alone. (Through
    params.yaml, validate would check the id against the configured prompt, and the TWIN of this workspace
    is a prompt of its artifacts only: here the report stage's own check against the run's artifacts.)"""
    file = paths.validated("report", ws)
    cfg = json.loads(file.read_text(encoding="utf-8"))
    cfg["report"]["prompt_id"] = value
    file.write_text(json.dumps(cfg), encoding="utf-8")


def test_report_of_a_set_lists_every_prompt_and_details_the_chosen_one(two_prompts, tmp_path):
    ws = copy_ws(two_prompts, tmp_path / "ws")
    pid = next(p for p in paths.prompt_ids(paths.TOKENS, ws) if p != TWIN)
    _checks_by_prompt(ws, pid)

    _set_key(ws, "nope")              # an id the run lacks: one line naming the allowed ids, nothing written
    proc = run_module("stages.report", ws)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"nexttoken report: error: report.prompt_id='nope' is not allowed: null or one of the run's prompt ids: "
        f"{', '.join(sorted([pid, TWIN]))}"]
    assert not paths.stage_dir("report", ws).exists()

    _set_key(ws, TWIN)
    run_module("stages.report", ws, check=True)
    md = paths.artifact(paths.REPORT, ws).read_text(encoding="utf-8")
    assert md.startswith(f"# Next-token report: tiny_qwen2 on prompt set {pid} (2 prompts; detail: {TWIN}, ")
    overview = re.search(r"^## Prompts of this run \(2\)\n(.*?)(?=^## )", md, flags=re.M | re.S).group(1)
    lines = {ln.split(" | ")[0][2:]: ln for ln in overview.splitlines() if ln.startswith("| `")}
    assert set(lines) == {f"`{pid}`", f"`{TWIN}` (detail below)"}
    # the numbers of prompt_metrics.parquet at T = 1 and the nucleus of top_p_0.9, the same for both copies
    t1 = read_parquet(paths.artifact(paths.PROBS_PROMPT_METRICS, ws)).filter(pc.field("temperature") == 1.0)
    for row in t1.to_pylist():
        cells = lines[f"`{row['prompt_id']}`" + (" (detail below)" if row["prompt_id"] == TWIN else "")].split(" | ")
        assert cells[3].startswith(f"{row['top1_id']} ") and cells[5] == f"{row['entropy']:.4f}"
        assert cells[6] == str(row["top_p_0.9_kept"])
    assert lines[f"`{pid}`"].endswith("| 2 / 0 |") and lines[f"`{TWIN}` (detail below)"].endswith("| 1 / **1** |")
    # the detail is the chosen prompt's: its partitions cited, its checks and the run-wide one, not the other's
    detail = md[md.index("## 1. "):]
    assert f"prompt_id={TWIN}/" in detail and f"prompt_id={pid}/" not in detail
    checks = detail[detail.index("## 11. "):]
    assert "3 checks: 2 pass, 1 fail" in checks and "run-wide" in checks and f"| {pid} |" not in checks
    # the figures across prompts, with both prompts' numbers
    for name in ("set_nucleus", "set_next_token", "set_loops"):
        assert f"plots/{name}.png" in md
        assert (paths.stage_dir("report", ws) / "plots" / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    nucleus = (paths.stage_dir("report", ws) / "plots" / "set_nucleus.csv").read_text(encoding="utf-8")
    assert {ln.split(",")[1] for ln in nucleus.splitlines()[1:]} == {pid, TWIN}
    loops = (paths.stage_dir("report", ws) / "plots" / "set_loops.csv").read_text(encoding="utf-8").splitlines()
    assert [ln.split(",")[2] for ln in loops[1:]] == ["2"] * (len(loops) - 1)      # each branch: 2 prompts
