"""The checks stage on tiny_qwen2: a clean run passes every error check, and every check can fail.

One module workspace runs the chain and the checks stage once. Each "can fail" test corrupts
one input (a Parquet file written to tmp_path, or a copy of the captured tensors) and calls
the pipeline.checks function directly; two tests run the whole stage as a subprocess.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from pipeline.checks import reference, suite, trajectory, verdicts
from pipeline.config import schema
from pipeline.model import loader
from pipeline.numerics import probs
from pipeline.store import paths, provenance
from tests.conftest import copy_ws, run_module

V = 152064


@pytest.fixture(scope="module")
def ws(tiny_chain, tmp_path_factory) -> Path:
    """A copy of the session's chain, where `clean_run` runs the checks stage."""
    return copy_ws(tiny_chain, tmp_path_factory.mktemp("checks_ws") / "ws")


@pytest.fixture(scope="module")
def clean_run(ws):
    return run_module("stages.checks", ws)


@pytest.fixture(scope="module")
def cfg(ws) -> dict:
    params = schema.read_params(ws / paths.PARAMS)
    return {n: schema.load_section(params, n) for n in ("model", "prompt", "capture", "probs", "sampling", "checks")}


@pytest.fixture(scope="module")
def stored(ws) -> suite.Stored:
    return suite.load(lambda item: paths.locate(item, ws), ws)


@pytest.fixture(scope="module")
def model(ws):
    return loader.load_model(ws / "artifacts/prepare_model", torch.bfloat16, "cpu", "eager", False)


@pytest.fixture(scope="module")
def tokenizer(ws):
    return loader.load_tokenizer(ws / "artifacts/prepare_model")


def by_name(results: list[verdicts.Check]) -> dict[str, verdicts.Check]:
    return {c.name: c for c in results}


def rewrite(src: Path, dst: Path, column: str, edit) -> Path:
    """Copy a Parquet file with `edit(numpy column)` applied, keeping its row groups (one per row)."""
    pf = pq.ParquetFile(src)
    table = pf.read()
    values = table[column].to_numpy(zero_copy_only=False).copy()
    edit(values)
    table = table.set_column(table.schema.get_field_index(column), column,
                             pa.array(values, table.schema.field(column).type))
    pq.write_table(table, dst, row_group_size=pf.metadata.row_group(0).num_rows)
    return dst


def tensors_with(stored: suite.Stored, name: str, index: tuple, value: float) -> dict:
    out = dict(stored.tensors)
    out[name] = stored.tensors[name].clone()
    out[name][index] = value
    return out


# ---------------------------------------------------------------- the clean run
def test_clean_run_passes_every_error_check_and_writes_results(ws, clean_run):
    assert clean_run.returncode == 0, clean_run.stderr
    rows = pq.read_table(ws / "artifacts/checks/checks.parquet").to_pylist()
    assert pq.read_schema(ws / "artifacts/checks/checks.parquet").names == verdicts.SCHEMA.names
    errors = [r for r in rows if r["severity"] == "error"]
    assert errors and all(r["verdict"] == "pass" for r in errors), [r for r in errors if r["verdict"] != "pass"]
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names)) and all(n.replace("_", "").isalnum() for n in names)
    for required in ("tokenizer_retokenize", "tokenizer_round_trip", "tokenizer_expected_ids", "logits_file_rows",
                     "logits_file_exact", "lm_head_recompute", "layer0_attention_attn_out", "residual_adds_layer0",
                     "residual_adds_layer1", "future_attention_layer0", "future_attention_layer1",
                     "capture_transparent", "repeat_deterministic", "probs_fp64_sum_T1", "probs_fp32_sum_T2",
                     "probs_table_recompute", "probs_keep_logit_order", "filtered_sets_recompute",
                     "filtered_renormalised_sum", "top_p_minimality", "step1_logits_sample_kv", "greedy_step1_argmax",
                     "kv_cache_logits_sample", "kv_cache_choices_greedy", "generate_parity_sample",
                     "generate_parity_greedy", "ref_token_ids", "ref_pieces", "ref_byte_split"):
        assert required in names, required
    assert {r["severity"] for r in rows if r["name"].startswith(("kv_cache_", "probs_fp32_"))} == {"report"}
    metrics = json.loads((ws / "artifacts/checks/metrics.json").read_text())
    s = metrics["summary"]
    assert s == {"checks": len(rows), "passed": sum(r["verdict"] == "pass" for r in rows), "failed_error": 0,
                 "failed_report": sum(r["verdict"] == "fail" for r in rows)}
    assert set(metrics["checks"]) == set(names)
    assert metrics["checks"]["lm_head_recompute"] == {"measured": 0.0, "tolerance": 0.0, "pass": True,
                                                      "severity": "error"}
    manifest = json.loads((ws / "artifacts/checks/manifest.json").read_text())
    assert manifest["stage"] == "checks" and {"artifacts/checks/checks.parquet", "artifacts/checks/metrics.json"} \
        <= {o["path"] for o in manifest["outputs"]}
    assert "artifacts/trajectories/step_logits.parquet" in {i["path"] for i in manifest["inputs"]}


def test_clean_run_measures_the_fp32_sums_and_the_kv_cache(ws, clean_run):
    rows = {r["name"]: r for r in pq.read_table(ws / "artifacts/checks/checks.parquet").to_pylist()}
    for t in ("0_5", "1", "2"):
        fp32, fp64 = rows[f"probs_fp32_sum_T{t}"], rows[f"probs_fp64_sum_T{t}"]
        assert fp32["measured"] > fp64["measured"] >= 0 and fp32["tolerance"] == 2e-6
        assert fp32["verdict"] == ("pass" if fp32["measured"] <= 2e-6 else "fail")
    for b in ("sample", "greedy"):
        kv = rows[f"kv_cache_logits_{b}"]
        assert kv["tolerance"] == 1e-2 and kv["detail"].startswith("per step: ") and math.isfinite(kv["measured"])


def test_checks_stage_params_are_in_params_yaml(ws):
    from pipeline.config import registry
    assert schema.subset(schema.read_params(ws / paths.PARAMS), registry.PARAMS["checks"])


def test_a_failed_error_check_fails_the_stage_after_writing_results(ws, tmp_path):
    copy = tmp_path / "ws"
    shutil.copytree(ws, copy, symlinks=True)
    logits = copy / "artifacts/logits/logits.parquet"

    def flip(v):          # position 3: no later table reads it, so only the file check can see it
        v[3 * V + 42] += 0.25
    rewrite(logits, tmp_path / "l.parquet", "logit", flip).replace(logits)
    # a producer that wrote a wrong number and recorded it faithfully: the manifest chain
    # holds, so only the check itself can catch it
    for manifest_path in (copy / "artifacts").glob("*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        for rec in manifest["outputs"] + manifest["inputs"]:
            if rec["path"] == "artifacts/logits/logits.parquet":
                rec["sha256"] = provenance.sha256_file(logits)
        manifest_path.write_text(json.dumps(manifest))
    params = yaml.safe_load((copy / paths.PARAMS).read_text())
    params["prompt"]["expected_token_ids"]["qwen2"][3] = 445          # the article says 444
    (copy / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True))
    proc = run_module("stages.checks", copy)
    assert proc.returncode == 1 and "error checks failed: logits_file_exact " in proc.stderr, proc.stderr
    rows = by_name([verdicts.Check(**{k: r[k] for k in ("name", "what", "measured", "tolerance", "severity",
                                                      "detail")})
                    for r in pq.read_table(copy / "artifacts/checks/checks.parquet").to_pylist()])
    assert verdicts.failed_errors(list(rows.values())) == ["logits_file_exact"]
    assert rows["logits_file_exact"].measured == 0.25 and "position 3" in rows["logits_file_exact"].detail
    # ids that do not decode to the prompt were written for another text: a report, not an error
    bad = rows["tokenizer_expected_ids"]
    assert not bad.passed and bad.measured == 1.0 and "index 3" in bad.detail and bad.severity == "report"
    summary = json.loads((copy / "artifacts/checks/metrics.json").read_text())["summary"]
    assert summary["failed_error"] == 1 and summary["failed_report"] >= 1
    assert (copy / "artifacts/checks/manifest.json").exists()


# ---------------------------------------------------------------- Check and results
def test_check_verdicts_names_and_metrics():
    ok = verdicts.Check("a_1", "w", 0.0, 0.0, "error")
    nan = verdicts.Check("b", "w", math.nan, 1.0, "report")
    assert ok.passed and ok.verdict == "pass" and not nan.passed and nan.verdict == "fail"
    with pytest.raises(ValueError):
        verdicts.Check("has space", "w", 0, 0, "error")
    with pytest.raises(ValueError):
        verdicts.Check("dotted.name", "w", 0, 0, "error")
    with pytest.raises(ValueError):
        verdicts.Check("x", "w", 0, 0, "warning")
    m = verdicts.metrics([ok, nan])
    assert m["summary"] == {"checks": 2, "passed": 1, "failed_error": 0, "failed_report": 1}
    assert m["checks"]["b"]["measured"] is None and json.dumps(m, allow_nan=False)
    assert verdicts.failed_errors([ok, nan]) == []
    with pytest.raises(ValueError):
        verdicts.to_table([ok, ok])
    assert verdicts.to_table([ok, nan]).column("verdict").to_pylist() == ["pass", "fail"]


def test_device_difference_needs_the_same_device_kind_and_gpu_model():
    cpu = ("this check", {"device": "cpu", "gpu_name": None})
    h200, h200_1 = ("forward", {"device": "cuda:0", "gpu_name": "NVIDIA H200"}), \
        ("this check", {"device": "cuda:1", "gpu_name": "NVIDIA H200"})
    rtx = ("trajectories", {"device": "cuda", "gpu_name": "NVIDIA GeForce RTX 3090"})
    assert suite.device_difference(("forward", {"device": "cpu", "gpu_name": None}), cpu) == ""
    assert suite.device_difference(h200, h200_1) == ""                # another GPU of the same model
    assert suite.device_difference(h200, cpu) == ("report, not error: forward ran on cuda (NVIDIA H200), this check "
                                                  "on cpu, whose kernels may round differently")
    assert "NVIDIA GeForce RTX 3090" in suite.device_difference(rtx, h200)
    # a GPU run that did not record its GPU model is not taken for this one
    assert "GPU model not recorded" in suite.device_difference(("forward", {"device": "cuda", "gpu_name": None}),
                                                               ("this check", {"device": "cuda", "gpu_name": None}))


def test_kernel_bound_checks_become_reports_saying_why_on_other_devices():
    made = [verdicts.Check("lm_head_recompute", "x", 0.5, 0, "error", "max abs diff"),
            verdicts.Check("capture_transparent", "x", 0.0, 0, "error")]
    cpu, h200 = ("this check", {"device": "cpu", "gpu_name": None}), ("forward", {"device": "cuda", "gpu_name": "H200"})
    assert suite.kernel_bound(made, cpu, cpu) == made
    got = suite.kernel_bound(made, h200, cpu)
    assert [c.severity for c in got] == ["report", "report"] and [c.measured for c in got] == [0.5, 0.0]
    assert got[0].detail == "max abs diff; " + got[0].device_note and "forward ran on cuda (H200)" in got[1].detail
    assert verdicts.failed_errors(got) == [] and verdicts.failed_errors(made) == ["lm_head_recompute"]


def test_a_reproduced_nan_is_equal_and_a_nan_on_one_side_is_not():
    """Recompute checks: NaN in both at the same place is reproduced (logits_finite is what
    fails on it); NaN on one side only, or a different value, is a difference."""
    a = np.array([1.0, np.nan, np.inf, -2.0], np.float32)
    assert verdicts.max_abs(a, a.copy()) == 0.0
    assert verdicts.max_abs(a, np.array([1.0, 0.0, np.inf, -2.0], np.float32)) == math.inf
    assert verdicts.max_abs(a, np.array([1.0, np.nan, np.inf, -1.5], np.float32)) == 0.5
    assert verdicts.max_abs(a, a[:3]) == math.inf
    t = torch.from_numpy(a).to(torch.bfloat16)
    assert verdicts.max_abs(t, t.clone()) == 0.0
    assert verdicts.max_abs(t, torch.tensor([1.0, 1.0, float("inf"), -2.0], dtype=torch.bfloat16)) == math.inf


def test_max_abs_walks_chunks_and_both_kinds_of_input(monkeypatch):
    """One implementation for arrays and tensors, chunk by chunk: a difference in any chunk,
    the last partial one included, is found; shapes that differ count inf, never raise."""
    monkeypatch.setattr(verdicts, "CHUNK", 7)
    a = np.arange(50, dtype=np.float32).reshape(5, 10)
    for where, by in (((0, 0), 0.25), ((3, 4), 2.0), ((4, 9), 0.5)):      # first, middle and last chunk
        b = a.copy()
        b[where] += by
        assert verdicts.max_abs(a, b) == by
        assert verdicts.max_abs(torch.from_numpy(a).to(torch.bfloat16), torch.from_numpy(b).to(torch.bfloat16)) == by
    t = torch.from_numpy(a).t()                                       # not contiguous
    assert verdicts.max_abs(t, t.contiguous()) == 0.0 and verdicts.max_abs(a, a.T) == math.inf
    assert verdicts.max_abs(np.empty(0), np.empty((0,))) == 0.0


def test_logits_finite_counts_and_names_positions():
    logits = torch.zeros(1, 3, 10, dtype=torch.bfloat16)
    clean = suite.logits_finite(logits, [4, 5, 6])
    assert clean.passed and clean.measured == 0 and clean.severity == "error" and "all finite" in clean.detail
    logits[0, 1, 7] = float("nan")
    logits[0, 2, 2:4] = float("inf")
    bad = suite.logits_finite(logits, [4, 5, 6])
    assert not bad.passed and bad.measured == 3
    assert bad.detail == "positions 5-6 (2 of 3); position 5: 1 ids (first: [7]); position 6: 2 ids (first: [2, 3])"
    assert suite._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and suite._ranges([3]) == "3"


def test_logits_finite_counts_rows_across_its_64_row_chunks():
    logits = torch.zeros(1, 130, 5, dtype=torch.bfloat16)
    logits[0, 63, 1], logits[0, 64, 0], logits[0, 129, 4] = float("nan"), float("-inf"), float("nan")
    c = suite.logits_finite(logits, list(range(130)))
    assert c.measured == 3 and c.detail.startswith("positions 63-64, 129 (3 of 130); position 63: 1 ids (first: [1])")
    assert c.detail.endswith("position 129: 1 ids (first: [4])")


def test_a_missing_stage_is_one_failed_error_check():
    c = suite.outputs_missing("probs")
    assert c.name == "probs_outputs" and c.severity == "error" and not c.passed
    assert "artifacts/probs is missing" in c.detail


# ---------------------------------------------------------------- tokenizer and capture
def test_tokenizer_checks_fail_on_wrong_ids(tokenizer, stored, cfg):
    text, ids = cfg["prompt"].text, stored.token_ids
    wrong = ids[:5] + [ids[5] + 1] + ids[6:]
    assert suite.tokenizer_retokenize(tokenizer, text, False, ids).passed
    bad = suite.tokenizer_retokenize(tokenizer, text, False, wrong)
    assert not bad.passed and bad.measured == 1 and "index 5" in bad.detail
    assert suite.tokenizer_retokenize(tokenizer, text, False, ids[:-1]).measured == 1   # one id short
    assert suite.tokenizer_round_trip(tokenizer, text, ids).passed
    assert suite.tokenizer_round_trip(tokenizer, text + "x", ids).measured == 1
    assert not suite.tokenizer_round_trip(tokenizer, text, wrong).passed
    expected = cfg["prompt"].expected_ids_for("qwen2")
    ok = suite.tokenizer_expected_ids(tokenizer, "qwen2", expected, text, ids)[0]
    assert ok.passed and ok.severity == "error"
    # The same text in other pieces ("LM" as "L" + "M"): the tokenizer would have changed: an error
    resplit = expected[:4] + tokenizer.convert_tokens_to_ids(["L", "M"]) + expected[5:]
    bad = suite.tokenizer_expected_ids(tokenizer, "qwen2", resplit, text, ids)[0]
    assert not bad.passed and bad.severity == "error" and bad.measured == 22 and "index 4" in bad.detail
    # Ids of another text (stale after a prompt.text override): reported, not an error
    stale = suite.tokenizer_expected_ids(tokenizer, "qwen2", expected, "Hello world", [9707, 1879])[0]
    assert not stale.passed and stale.severity == "report" and stale.measured == 25
    assert suite.tokenizer_expected_ids(tokenizer, "gemma3", None, text, ids) == []
    assert suite.capture_input_ids(stored.tensors, wrong).measured == 1


def test_one_flipped_logit_in_logits_parquet_fails_logits_file_exact(stored, tmp_path):
    def flip(v):
        v[24 * V + 9315] += 0.5
    bad = rewrite(stored.logits, tmp_path / "logits.parquet", "logit", flip)
    got = by_name(suite.logits_file(bad, stored.tensors["logits"], stored.logit_positions))
    assert got["logits_file_exact"].measured == 0.5 and "position 24" in got["logits_file_exact"].detail
    assert got["logits_file_rows"].passed


def test_missing_position_in_logits_parquet_fails_logits_file_rows(stored, tmp_path):
    table = pq.read_table(stored.logits)
    short = tmp_path / "logits.parquet"
    pq.write_table(table.slice(0, 24 * V), short, row_group_size=V)
    got = by_name(suite.logits_file(short, stored.tensors["logits"], stored.logit_positions))
    assert got["logits_file_rows"].measured == V + 1 and got["logits_file_exact"].passed


@pytest.mark.parametrize("name, index, check", [
    ("blocks.0.attn.q", (0, 3, 5), "layer0_attention_q"),
    ("blocks.0.attn.k", (0, 3, 5), "layer0_attention_k"),
    ("blocks.0.attn.v", (0, 3, 5), "layer0_attention_v"),
    ("blocks.0.attn.q_rot", (0, 1, 3, 5), "layer0_attention_q_rot"),
    ("blocks.0.attn.k_rot", (0, 1, 3, 5), "layer0_attention_k_rot"),
    ("blocks.0.attn_weights", (0, 1, 3, 2), "layer0_attention_attn_weights"),
    ("blocks.0.attn.z", (0, 3, 1, 5), "layer0_attention_z"),
    ("blocks.0.attn_out", (0, 3, 5), "layer0_attention_attn_out"),
])
def test_each_layer0_attention_step_can_fail(model, stored, name, index, check):
    got = suite.layer0_attention(model, tensors_with(stored, name, index, 7.0), "error")
    names = [c.name for c in got]
    bad = got[names.index(check)]
    assert not bad.passed and bad.measured > 0, bad
    # every step before the corrupted one still recomputes exactly: the failure is located
    assert all(c.passed for c in got[:names.index(check)]), got


def test_changed_attn_out_fails_layer0_attention_and_the_residual_add(model, stored):
    old = float(stored.tensors["blocks.0.attn_out"][0, 3, 5])
    tensors = tensors_with(stored, "blocks.0.attn_out", (0, 3, 5), old + 1.0)
    assert suite.layer0_attention(model, tensors, "error")[-1].measured == pytest.approx(1.0, abs=0.02)
    adds = by_name(suite.residual_adds(tensors, 2))
    assert not adds["residual_adds_layer0"].passed and adds["residual_adds_layer1"].passed
    assert "resid_mid" in adds["residual_adds_layer0"].detail


def test_changed_mlp_out_of_the_last_layer_fails_its_residual_add(stored):
    tensors = tensors_with(stored, "blocks.1.mlp_out", (0, 24, 0), 100.0)
    adds = by_name(suite.residual_adds(tensors, 2))
    assert not adds["residual_adds_layer1"].passed and adds["residual_adds_layer0"].passed


def test_changed_final_norm_out_fails_the_lm_head_recompute(model, stored):
    tensors = tensors_with(stored, "final_norm_out", (0, 24, 7), 3.0)
    bad = suite.lm_head(model, tensors, "error")
    assert bad.name == "lm_head_recompute" and bad.measured > 0 and not bad.passed
    assert suite.lm_head(model, stored.tensors, "error").measured == 0.0


def test_weight_on_a_future_position_fails_future_attention(stored):
    tensors = tensors_with(stored, "blocks.1.attn_weights", (0, 2, 4, 9), 0.25)
    got = by_name(suite.future_attention(tensors))
    assert got["future_attention_layer1"].measured == 0.25 and got["future_attention_layer0"].passed


def test_changed_stored_logits_fail_capture_transparency(model, stored):
    tensors = tensors_with(stored, "logits", (0, 24, 100), 99.0)
    got = by_name(suite.fresh_forward(model, tensors, "all", "error"))
    assert not got["capture_transparent"].passed and got["repeat_deterministic"].passed


def test_a_nondeterministic_model_fails_repeat_determinism(model, stored):
    calls = []

    def drift(module, args, output):      # each call adds one more: a model that never repeats itself
        calls.append(1)
        return output + (len(calls) - 1)
    handle = model.lm_head.register_forward_hook(drift)
    try:
        got = by_name(suite.fresh_forward(model, stored.tensors, "all", "error"))
    finally:
        handle.remove()
    assert got["capture_transparent"].passed and not got["repeat_deterministic"].passed
    assert got["repeat_deterministic"].measured == pytest.approx(1.0, abs=0.1)   # +1, rounded in bf16


# ---------------------------------------------------------------- probabilities
@pytest.fixture(scope="module")
def rows(stored) -> dict[int, np.ndarray]:
    return {24: stored.last_row()}


def test_non_finite_logits_fail_the_fp64_and_fp32_sums(rows):
    row = rows[24].copy()
    row[5] = np.nan
    got = by_name(suite.prob_sums({24: row}, (1.0,), 1e-12, 2e-6))
    assert math.isnan(got["probs_fp64_sum_T1"].measured) and not got["probs_fp64_sum_T1"].passed
    assert got["probs_fp64_sum_T1"].severity == "error" and got["probs_fp32_sum_T1"].severity == "report"
    clean = by_name(suite.prob_sums(rows, (1.0,), 1e-12, 0.0))
    assert clean["probs_fp64_sum_T1"].passed and not clean["probs_fp32_sum_T1"].passed   # FP32 is never exact


def test_a_changed_probability_in_table_parquet_fails_the_table_recompute(stored, rows, tmp_path):
    top = int(np.argmax(rows[24]))

    def bump(v):          # the top id: far from its neighbours, so the order stays intact
        v[top] -= 1e-9
    bad = rewrite(stored.table, tmp_path / "table.parquet", "p_T1", bump)
    got = by_name(suite.table_recompute(bad, rows, (0.5, 1.0, 2.0)))
    assert got["probs_table_recompute"].measured == pytest.approx(1e-9, rel=1e-6)
    assert "p_T1" in got["probs_table_recompute"].detail and got["probs_keep_logit_order"].passed


def test_a_probability_out_of_logit_order_fails_keep_logit_order(stored, rows, tmp_path):
    lowest = int(np.argmin(rows[24]))

    def swap(v):
        v[lowest] = 0.9
    got = by_name(suite.table_recompute(rewrite(stored.table, tmp_path / "t.parquet", "p_T2", swap), rows,
                                         (0.5, 1.0, 2.0)))
    assert got["probs_keep_logit_order"].measured >= 1 and "p_T2" in got["probs_keep_logit_order"].detail


def test_a_changed_kept_probability_fails_filtered_recompute_and_sum(stored, rows, cfg, tmp_path):
    flt = pq.read_table(stored.filtered)
    k2 = flt["filter"].to_pylist().index("top_k_2")

    def bump(v):
        v[k2] += 1e-9
    bad = rewrite(stored.filtered, tmp_path / "f.parquet", "prob_after", bump)
    got = by_name(suite.filtered(bad, rows, probs.filters(cfg["probs"], cfg["sampling"])))
    assert got["filtered_sets_recompute"].measured == 1 and "top_k_2@24" in got["filtered_sets_recompute"].detail
    assert got["filtered_renormalised_sum"].measured == pytest.approx(1e-9, rel=1e-3)
    assert got["top_p_minimality"].passed


def test_a_top_p_set_with_an_extra_id_is_not_minimal(stored, rows, cfg, tmp_path):
    table = pq.read_table(stored.filtered)
    p9 = [i for i, f in enumerate(table["filter"].to_pylist()) if f == "top_p_0.9"]
    kept = set(table["token_id"].to_pylist()[i] for i in p9)
    extra = next(int(i) for i in np.argsort(-rows[24]) if int(i) not in kept)    # the next most likely id
    row = {k: [v[p9[-1]]] for k, v in table.to_pydict().items()}
    row.update(token_id=[extra], kept_rank=[len(p9) + 1])
    bad = tmp_path / "f.parquet"
    pq.write_table(pa.concat_tables([table, pa.table(row, schema=table.schema)]), bad)
    got = by_name(suite.filtered(bad, rows, probs.filters(cfg["probs"], cfg["sampling"])))
    assert got["top_p_minimality"].measured == 1 and "top_p_0.9@24" in got["top_p_minimality"].detail
    assert not got["filtered_sets_recompute"].passed


# ---------------------------------------------------------------- trajectories
@pytest.fixture(scope="module")
def steps(stored) -> list[dict]:
    return pq.read_table(stored.steps).to_pylist()


def test_a_changed_step1_logit_fails_step1_logits_and_shows_in_the_kv_check(stored, steps, cfg, tmp_path):
    table = pq.read_table(stored.step_logits, columns=["branch", "kv_cache", "step"])
    first = next(i * V for i in range(table.num_rows // V)
                 if (table["branch"][i * V].as_py(), table["kv_cache"][i * V].as_py(),
                     table["step"][i * V].as_py()) == ("greedy", False, 1))

    def bump(v):
        v[first + 7] += 0.5
    rows = trajectory.step_logit_rows(rewrite(stored.step_logits, tmp_path / "s.parquet", "logit", bump))
    got = by_name(trajectory.step1_logits(rows, stored.last_row(), "error"))
    assert got["step1_logits_greedy"].measured == 0.5 and got["step1_logits_greedy_kv"].passed
    kv = by_name(trajectory.kv_cache(steps, rows, cfg["checks"].kv_cache_atol))
    assert kv["kv_cache_logits_greedy"].measured == 0.5 and not kv["kv_cache_logits_greedy"].passed
    assert kv["kv_cache_logits_greedy"].severity == "report" and kv["kv_cache_logits_sample"].passed


def _with_token(steps: list[dict], branch: str, kv: bool, step: int, token: int) -> list[dict]:
    return [{**r, "token_id": token} if (r["branch"], r["kv_cache"], r["step"]) == (branch, kv, step) else r
            for r in steps]


def test_a_changed_greedy_token_fails_argmax_and_generate_parity(model, stored, steps, cfg):
    rows, last = trajectory.step_logit_rows(stored.step_logits), stored.last_row()
    clean = by_name(trajectory.greedy_argmax(steps, rows, last))
    assert clean["greedy_step1_argmax"].passed and clean["greedy_tokens_argmax"].passed
    bad1 = _with_token(steps, "greedy", True, 1, 11)
    assert trajectory.greedy_argmax(bad1, rows, last)[0].measured == 1
    bad3 = _with_token(steps, "greedy", False, 3, 11)
    got = by_name(trajectory.greedy_argmax(bad3, rows, last))
    assert got["greedy_step1_argmax"].passed and got["greedy_tokens_argmax"].measured == 1
    assert "greedy step 3" in got["greedy_tokens_argmax"].detail
    bad3_kv = _with_token(steps, "greedy", True, 3, 11)
    parity = by_name(trajectory.generate_parity(model, stored.token_ids, bad3_kv, cfg["sampling"],
                                                       loader.eos_ids(model), torch.device("cpu")))
    assert parity["generate_parity_greedy"].measured == 1 and parity["generate_parity_sample"].passed
    kv = by_name(trajectory.kv_cache(bad3, rows, cfg["checks"].kv_cache_atol))
    assert kv["kv_cache_choices_greedy"].measured == 1 and "3 steps compared" in kv["kv_cache_choices_greedy"].detail


def test_a_changed_sampled_token_fails_generate_parity(model, stored, steps, cfg):
    bad = _with_token(steps, "sample", True, 2, 11)          # the KV-cache run: what generate does by default
    no_cache_changed = _with_token(steps, "sample", False, 2, 11)   # kv_cache_choices finds that one
    assert by_name(trajectory.generate_parity(model, stored.token_ids, no_cache_changed, cfg["sampling"],
                                                     loader.eos_ids(model), torch.device("cpu")))[
        "generate_parity_sample"].passed
    got = by_name(trajectory.generate_parity(model, stored.token_ids, bad, cfg["sampling"],
                                                    loader.eos_ids(model), torch.device("cpu")))
    assert got["generate_parity_sample"].measured == 1 and got["generate_parity_sample"].severity == "error"
    assert "index 1" in got["generate_parity_sample"].detail


def test_generate_parity_of_the_sample_branch_is_a_report_off_cpu(model, stored, steps, cfg):
    # The device only decides the severity here (the model stays on CPU): on CUDA generate
    # draws from the device RNG, the decode loop from a CPU generator.
    got = by_name(trajectory.generate_parity(model, stored.token_ids, steps, cfg["sampling"],
                                                    loader.eos_ids(model), torch.device("cuda")))
    assert got["generate_parity_sample"].severity == "report" and "device RNG" in got["generate_parity_sample"].what
    assert got["generate_parity_greedy"].severity == "error"


# ---------------------------------------------------------------- reference figures on real artifacts
def test_tokenizer_part_of_the_reference_runs_and_passes_for_tiny_qwen2(stored, model, tokenizer, cfg):
    got = by_name(reference.run(stored, model, tokenizer, cfg, []))
    assert set(got) == {"ref_prompt", "ref_token_ids", "ref_pieces", "ref_byte_split"}
    assert all(c.passed for c in got.values())


def test_full_reference_comparison_runs_on_tiny_artifacts(stored, model, tokenizer, cfg, ws):
    # tiny_qwen2 is not the reference model: the run figures are gathered and compared, and
    # the model-size figures fail (as errors), naming what differs.
    ref = reference.load_reference("seed_article")
    results = suite.run_all(stored, model, tokenizer, cfg, torch.device("cpu"), loader.eos_ids(model))
    measured = {"prompt": cfg["prompt"].text,
                "tokenize": reference.gather_tokenizer(stored.token_ids, stored.token_text, tokenizer, " 就"),
                **reference.gather_run(stored, model, tokenizer, cfg, results, ref)}
    got = by_name(reference.compare(measured, ref, "all"))
    assert got["ref_shape_num_hidden_layers"].detail == "got 2, reference 28" and not got["ref_tokenizer_len"].passed
    assert got["ref_shape_logits"].passed and got["ref_lm_head_recompute"].passed and got["ref_token_ids"].passed
    assert measured["filters"]["top_p_0.9_kept_count"] == pq.read_table(stored.filtered).to_pandas().query(
        "filter == 'top_p_0.9'").shape[0]
    assert all(c.passed for c in results if c.severity == "error")
