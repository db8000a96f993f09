"""prompt_metrics.parquet of the session's tiny_qwen2 chain (no new run): read by pandas and
DuckDB, equal to summary.json's figures, recorded in the manifest, and passing its check."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from pipeline.checks import next_token
from pipeline.config import schema
from pipeline.numerics import probs
from pipeline.store import logits_io, paths, provenance
from tests.helpers.partitions import part, rel


@pytest.fixture(scope="module")
def ws(tiny_chain):
    return tiny_chain


@pytest.fixture(scope="module")
def summary(ws) -> dict:
    return json.loads(part(paths.PROBS_SUMMARY, ws).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def frame(ws):
    return pq.read_table(paths.artifact(paths.PROBS_PROMPT_METRICS, ws)).to_pandas()


def test_one_row_per_temperature_keyed_by_the_prompt_id(ws, frame):
    params = schema.read_params(ws / paths.PARAMS)
    named = probs.filters(schema.load_section(params, "probs"), schema.load_section(params, "sampling"))
    tok = json.loads(part(paths.TOKENIZE_SUMMARY, ws).read_text(encoding="utf-8"))
    assert list(frame.columns) == next_token.columns(named)
    assert frame["temperature"].tolist() == sorted(params["probs"]["temperatures"]) == [0.5, 1.0, 2.0]
    assert set(frame["prompt_id"]) == {tok["prompt_id"]} == {"temperature_question"}
    assert set(frame["position"]) == {tok["n_tokens"] - 1}
    assert pq.ParquetFile(paths.artifact(paths.PROBS_PROMPT_METRICS, ws)).metadata.num_row_groups == 1


def test_the_figures_are_summary_json_s(frame, summary):
    last = summary["positions"][-1]
    rows = {r["temperature"]: r for r in frame.to_dict("records")}
    for t in (t for t in summary["temperatures"] if t["position"] == last):
        r, top = rows[t["temperature"]], t["top"][0]
        assert (r["entropy"], r["top1_id"], r["top1_text"], r["top1_prob"]) == \
            (t["entropy_nats"], top["token_id"], top["text"], top["prob"])
        assert r["entropy"] == pytest.approx(t["entropy_bits"] * math.log(2), rel=1e-12)       # nats
    compared = 0
    for f in (f for f in summary["filters"] if f["position"] == last):   # each at its own temperature
        r = rows[f["temperature"] or 1.0]
        assert (r[f"{f['filter']}_kept"], r[f"{f['filter']}_mass"]) == (f["kept_count"], f["kept_mass"])
        compared += 1
    assert compared == 3 and rows[1.0]["top_k_2_kept"] == 2 and rows[1.0]["top_p_0.9_kept"] > 2
    # the nucleus grows with the temperature
    assert rows[0.5]["top_p_0.9_kept"] < rows[1.0]["top_p_0.9_kept"] < rows[2.0]["top_p_0.9_kept"]


def test_duckdb_reads_the_same_table(ws, frame):
    duckdb = pytest.importorskip("duckdb")
    path = paths.artifact(paths.PROBS_PROMPT_METRICS, ws).as_posix()
    got = duckdb.sql(f"""select prompt_id, temperature, top1_id, "top_p_0.9_kept", entropy
                         from read_parquet('{path}') where temperature = 1.0""").fetchall()
    want = frame[frame["temperature"] == 1.0]
    assert got == list(want[["prompt_id", "temperature", "top1_id", "top_p_0.9_kept", "entropy"]]
                       .itertuples(index=False, name=None))


def test_recorded_with_its_hash_and_its_input_and_metrics_json_unchanged(ws):
    m = json.loads(paths.manifest_path("probs", ws).read_text())
    table_rel = paths.artifact(paths.PROBS_PROMPT_METRICS).as_posix()
    out = next(o for o in m["outputs"] if o["path"] == table_rel)
    assert out["sha256"] == provenance.sha256_file(ws / table_rel)
    assert rel(paths.TOKENIZE_SUMMARY, ws) in {i["path"] for i in m["inputs"]}
    metrics = json.loads(paths.artifact(paths.PROBS_METRICS, ws).read_text())
    # the `dvc exp show` columns: the prompt's sweep figures, then the set's aggregates (a set of one here:
    # the prompt's own figures at T=1, from the table)
    assert list(metrics) == ["kept", "mass", "top_bits", "entropy", "entropy_median", "entropy_mean", "kept_median"]
    at_1 = next(r for r in pq.read_table(ws / table_rel).to_pylist() if r["temperature"] == 1.0)
    assert metrics["entropy_median"] == metrics["entropy_mean"] == at_1["entropy"] == metrics["entropy"]   # nats
    assert metrics["kept_median"] == at_1["sampling_kept"]


def test_its_check_passes_on_the_stored_table(ws, summary):
    params = schema.read_params(ws / paths.PARAMS)
    probs_cfg, sampling = schema.load_section(params, "probs"), schema.load_section(params, "sampling")
    tok = json.loads(part(paths.TOKENIZE_SUMMARY, ws).read_text(encoding="utf-8"))
    last = tok["n_tokens"] - 1
    got = next_token.check(paths.artifact(paths.PROBS_PROMPT_METRICS, ws), tok["prompt_id"], last,
                           logits_io.read_position(part(paths.LOGITS, ws), last),
                           probs_cfg.temperatures, probs.filters(probs_cfg, sampling),
                           paths.artifact(paths.VOCAB, ws))
    assert [c.name for c in got] == ["probs_prompt_metrics_rows", "probs_prompt_metrics_values"]
    assert all(c.passed for c in got), got
    print("probs_prompt_metrics_values measured", got[1].measured, got[1].detail)
