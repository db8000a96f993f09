"""diff and sweep over a two-prompt set (issue 17 item 8), in process on tiny_qwen2 (no DVC).

The session's single-prompt run (tiny_chain: the reference question, id temperature_question) and
a run of a set of two, composed with `prompt.set`: that prompt under the same id and a list that
invites a loop. The set-level metrics must be the aggregates of the per-prompt rows sweep shows,
and the diff must pair prompts by id, name the prompt only one run holds and report per prompt.
"""

from __future__ import annotations

import json
import shutil
import statistics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.store import paths
from pipeline.tools import rundiff, sweep
from tests.conftest import CHAIN, ON_CPU, REPO, TEST_STEPS, copy_ws, run_module

REF, LOOP = "temperature_question", "loop"


@pytest.fixture(scope="module")
def set_run(tiny_workspace, tiny_chain, tmp_path_factory):
    ws = copy_ws(tiny_workspace, tmp_path_factory.mktemp("set_run") / "ws")
    text = json.loads((paths.partition(paths.TOKENIZE_SUMMARY, REF, tiny_chain)).read_text(encoding="utf-8"))
    assert text["prompt_id"] == REF
    (ws / "prompts").mkdir(exist_ok=True)
    ref_text = next(json.loads(line)["text"] for line in
                    (REPO / "prompts/concepts.jsonl").read_text(encoding="utf-8").splitlines()
                    if json.loads(line)["id"] == REF)
    (ws / "prompts/pair.jsonl").write_text("\n".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) for i, t in
                                                     ((REF, ref_text), (LOOP, "1. 1. 1. 1. 1. 1. 1."))) + "\n",
                                           encoding="utf-8")
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, ON_CPU, "model=tiny_qwen2", "prompt=concepts",
               "prompt.set=prompts/pair.jsonl", check=True)
    for stage in ("tokenize", *CHAIN):
        run_module(f"stages.{stage}", ws, check=True)
    return ws


def _metrics(root, item) -> dict:
    return json.loads(paths.artifact(item, root).read_text())


def test_set_metrics_are_the_aggregates_of_the_prompt_rows_sweep_shows(set_run, tiny_chain):
    figures = sweep.prompt_figures(set_run)
    assert sorted(figures) == [LOOP, REF]
    assert figures[REF] == sweep.prompt_figures(tiny_chain)[REF]          # the prompt alone, the same row
    pm, tm = _metrics(set_run, paths.PROBS_METRICS), _metrics(set_run, paths.TRAJECTORIES_METRICS)
    entropies = [f["entropy"] for f in figures.values()]
    assert entropies[0] != entropies[1]                                   # two prompts that tell apart
    assert pm["entropy_median"] == pytest.approx(statistics.median(entropies), rel=1e-12)
    assert pm["entropy_mean"] == pytest.approx(sum(entropies) / 2, rel=1e-12)
    assert pm["kept_median"] == statistics.median(f["kept"] for f in figures.values())
    assert tm["n_prompts"] == 2
    for branch in ("greedy", "sample"):
        assert tm[f"{branch}_loop_rate"] == sum(f[f"{branch}_loop"] for f in figures.values()) / 2
    steps = [f["diverge"] for f in figures.values() if f["diverge"]]
    assert tm["diverge_mean"] == (sum(steps) / len(steps) if steps else 0)
    # the single-prompt run's sweep figures are its own prompt's: a set of one
    alone = _metrics(tiny_chain, paths.PROBS_METRICS)
    assert alone["entropy_median"] == pytest.approx(sweep.prompt_figures(tiny_chain)[REF]["entropy"], rel=1e-12)
    print("set metrics", pm, tm)

    # sweep_prompts: a row per prompt and the set line, taken from the experiment's set metrics
    params = __import__("yaml").safe_load((set_run / paths.PARAMS).read_text(encoding="utf-8"))
    shown = [{"rev": "base", "experiments": [{"name": "e1", "revs": [{"rev": "c0ffee", "data": {
        "params": {paths.PARAMS: {"data": params}},
        "metrics": {paths.artifact(item).as_posix(): {"data": _metrics(set_run, item)}
                    for item in (paths.PROBS_METRICS, paths.TRAJECTORIES_METRICS)}}}]}]}]
    df = sweep.table(sweep.experiment_rows(shown))
    table = sweep.prompt_table(df, lambda row: sweep.prompt_figures(set_run))
    assert table["prompt_id"].tolist() == [LOOP, REF, sweep.SET_ROW]
    line = table[table["prompt_id"] == sweep.SET_ROW].iloc[0]
    assert (line["entropy"], line["kept"], line["greedy_loop"]) == \
        (pm["entropy_median"], pm["kept_median"], tm["greedy_loop_rate"])
    assert table[table["prompt_id"] == REF].iloc[0]["entropy"] == figures[REF]["entropy"]


def test_diff_pairs_prompts_by_id_and_reports_per_prompt(set_run, tiny_chain, tmp_path):
    lines = rundiff.compare(tiny_chain, set_run, "diff")
    text = "\n".join(lines)
    assert lines[-1] == f"prompt {LOOP}: only in B"
    assert f"prompt {REF}:" not in text                                    # one pair, the same id: no header
    assert "logits: identical logits.parquet" in text                     # the prompt alone and in the set
    assert "  prompt metrics (probs/prompt_metrics.parquet): identical (3 row(s))" in lines
    runs = pq.read_table(paths.artifact(paths.TRAJECTORY_PROMPT_METRICS, tiny_chain)).num_rows   # every branch's run
    assert runs >= 4 and f"  prompt metrics (trajectories/prompt_metrics.parquet): identical ({runs} row(s))" in lines

    # a set against itself with one cell of one prompt changed: that prompt, that row, that column
    other = copy_ws(set_run, tmp_path / "other")
    path = paths.artifact(paths.PROBS_PROMPT_METRICS, other)
    rows = pq.read_table(path).to_pylist()
    hit = next(r for r in rows if r["prompt_id"] == LOOP and r["temperature"] == 1.0)
    hit["entropy"] += 0.5
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(path)), path)
    lines = rundiff.compare(set_run, other, "diff")
    at, ref_at = lines.index(f"prompt {LOOP}:"), lines.index(f"prompt {REF}:")   # sorted by id: loop first
    assert at < ref_at and not any("only in" in line for line in lines if line.startswith("prompt "))
    block, ref_block = lines[at:ref_at], lines[ref_at:]
    assert "  prompt metrics (probs/prompt_metrics.parquet): 1 of 3 row(s) differ" in block
    assert f"    T=1: entropy {hit['entropy'] - 0.5:.6g} | {hit['entropy']:.6g}" in block
    assert "  prompt metrics (probs/prompt_metrics.parquet): identical (3 row(s))" in ref_block
    shutil.rmtree(other)
