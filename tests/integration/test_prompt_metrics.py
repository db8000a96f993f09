"""trajectories/prompt_metrics.parquet on the session's tiny_qwen2 chain, read as pandas and DuckDB
read it, each row checked against the steps in steps.parquet (another file, by other code)."""

from __future__ import annotations

import json

import duckdb
import pyarrow.parquet as pq
import pytest

from pipeline.numerics.repetition import has_no_loop, is_loop
from pipeline.store import paths, provenance
from tests.helpers.partitions import part, rel


@pytest.fixture(scope="module")
def ws(tiny_chain):
    return tiny_chain


def _runs(ws) -> dict[tuple[str, bool], list[int]]:
    steps = pq.read_table(part(paths.STEPS, ws)).to_pandas().sort_values("step")
    return {(b, kv): g["token_id"].tolist() for (b, kv), g in steps.groupby(["branch", "kv_cache"])}


def _first_difference(a: list[int], b: list[int]) -> int:
    """Written here again: the step (from 1) where two id lists first differ, 0 when equal."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i] != b[i]:
            return i + 1
    return 0


def test_one_row_per_run_matching_its_steps(ws):
    table = pq.read_table(paths.artifact(paths.TRAJECTORY_PROMPT_METRICS, ws)).to_pandas()
    steps = pq.read_table(part(paths.STEPS, ws)).to_pandas()
    runs, prompt_id = _runs(ws), json.loads(part(paths.TOKENIZE_SUMMARY, ws).read_text())["prompt_id"]
    assert sorted(zip(table.branch, table.kv_cache)) == sorted(runs) and len(table) == 4 + 4    # + what-if runs
    assert (table.prompt_id == prompt_id).all() and prompt_id == "temperature_question"
    for row in table.itertuples():
        ids, last = runs[(row.branch, row.kv_cache)], steps[(steps.branch == row.branch) &
                                                             (steps.kv_cache == row.kv_cache)].sort_values("step")
        assert row.n_new == len(ids) and row.stop_reason == last["stop_reason"].iloc[-1]
        assert row.text == last["text_so_far"].iloc[-1]
        assert row.diverge is None or row.diverge != row.diverge if row.branch == "greedy" else \
            row.diverge == _first_difference(ids, runs[("greedy", row.kv_cache)])
        if row.loop:
            assert is_loop(ids, int(row.loop_start), int(row.loop_period))
        else:
            assert has_no_loop(ids) and row.loop_start != row.loop_start      # null, read by pandas as NaN
        pairs = list(zip(ids, ids[1:]))
        assert row.distinct_1 == len(set(ids)) / len(ids) and row.distinct_2 == len(set(pairs)) / len(pairs)


def test_duckdb_reads_the_table_and_its_nulls(ws):
    path = paths.artifact(paths.TRAJECTORY_PROMPT_METRICS, ws).as_posix()
    rows = duckdb.sql(f"select branch, kv_cache, n_new, diverge, loop, loop_start, loop_period, distinct_3 "
                      f"from read_parquet('{path}') order by branch, kv_cache").fetchall()
    runs = _runs(ws)
    assert [(b, kv) for b, kv, *_ in rows] == sorted(runs)
    for branch, kv, n_new, diverge, loop, start, period, distinct_3 in rows:
        assert n_new == len(runs[(branch, kv)]) and (diverge is None) == (branch == "greedy")
        assert (start is None) == (period is None) == (not loop)
        triples = list(zip(*(runs[(branch, kv)][i:] for i in range(3))))
        assert distinct_3 == len(set(triples)) / len(triples)
    assert duckdb.sql(f"select typeof(prompt_id), typeof(loop_start), typeof(distinct_2) "
                      f"from read_parquet('{path}') limit 1").fetchall() == [("VARCHAR", "INTEGER", "DOUBLE")]


def test_the_manifest_lists_it_with_its_hash_and_tokenize_json_as_an_input(ws):
    manifest = json.loads(paths.manifest_path("trajectories", ws).read_text())
    table = paths.artifact(paths.TRAJECTORY_PROMPT_METRICS).as_posix()
    out = next(o for o in manifest["outputs"] if o["path"] == table)
    assert out["sha256"] == provenance.sha256_file(paths.artifact(paths.TRAJECTORY_PROMPT_METRICS, ws))
    assert rel(paths.TOKENIZE_SUMMARY, ws) in {i["path"] for i in manifest["inputs"]}
