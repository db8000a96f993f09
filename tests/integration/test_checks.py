"""The checks stage on tiny_qwen2: a clean run passes every error check, and every check can fail.

One module workspace runs the chain and the checks stage once. Each "can fail" test changes
one input (a Parquet file written to tmp_path, or a copy of the captured tensors) and calls
the pipeline.checks function directly; two tests run the whole stage as a subprocess. That a
check catches a wrong *computation*, not only a changed file, is shown by
tests/reliability/test_mutants.py.
"""

from __future__ import annotations

import dataclasses
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

from pipeline import kernels
from pipeline.checks import lens, recompute, reference, suite, tables, trajectory, verdicts
from pipeline.config import prompt_set, schema
from pipeline.model import decode, loader
from pipeline.numerics import probs
from pipeline.store import logits_io, paths, provenance
from tests.conftest import copy_ws, run_module
from tests.helpers.partitions import part, rel

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
    return suite.load(paths.lookup(ws), ws, paths.run_prompt_ids(ws)[0])


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
    for required in ("tokenizer_retokenize", "tokenizer_round_trip", "tokenizer_bytes", "tokenizer_expected_ids",
                     "logits_file_rows", "logits_file_exact", "final_norm_recompute", "lm_head_recompute",
                     "layer0_attention_attn_out", "residual_adds_layer0", "residual_adds_layer1",
                     "future_attention_layer0", "future_attention_layer1", "capture_transparent",
                     "repeat_deterministic", "probs_fp64_table_T1", "probs_fp32_sum_T2", "probs_table_logits",
                     "probs_table_ranks", "filtered_sets_numpy", "filtered_sets_warpers", "filtered_rows",
                     "filtered_probs", "probs_prompt_metrics_rows", "probs_prompt_metrics_values",
                     "step1_logits_sample_kv", "greedy_tokens_argmax", "kv_cache_logits_sample",
                     "kv_cache_choices_greedy", "generate_parity_sample", "generate_parity_greedy_kv",
                     "generate_logits_sample_kv", "generate_logits_greedy", "trajectory_loops", "ref_token_ids",
                     "what_if_branches", "what_if_generate_parity", "what_if_generate_logits",
                     "ref_pieces", "ref_byte_split"):
        assert required in names, required
    assert all(" vs " in r["what"] for r in rows if r["severity"] == "error" and not r["name"].startswith("ref_")), \
        [r["what"] for r in rows if " vs " not in r["what"]]     # each says which two things it compares
    assert {r["severity"] for r in rows if r["name"].startswith(("kv_cache_", "probs_fp32_"))} == {"report"}
    metrics = json.loads((ws / "artifacts/checks/metrics.json").read_text())
    failing = [r["name"] for r in rows if r["verdict"] == "fail"]
    assert metrics == {"checks": len(rows), "passed": len(rows) - len(failing), "failed_error": 0,
                       "failed_report": len(failing), "failing": metrics["failing"], "failing_prompts": "none"}
    assert {r["prompt_id"] for r in rows} == set(paths.prompt_ids(paths.TOKENS, ws))      # the run's one prompt
    more = f" +{len(failing) - 3} more" if len(failing) > 3 else ""
    assert metrics["failing"] == (", ".join(failing[:3]) + more or "none")       # no errors: report ones in order
    manifest = json.loads((ws / "artifacts/checks/manifest.json").read_text())
    assert manifest["stage"] == "checks" and {"artifacts/checks/checks.parquet", "artifacts/checks/metrics.json"} \
        <= {o["path"] for o in manifest["outputs"]}
    assert rel(paths.STEP_LOGITS, ws) in {i["path"] for i in manifest["inputs"]}


def test_clean_run_measures_the_fp32_sums_and_the_kv_cache(ws, clean_run):
    rows = {r["name"]: r for r in pq.read_table(ws / "artifacts/checks/checks.parquet").to_pylist()}
    for t in ("0_5", "1", "2"):
        fp32, fp64 = rows[f"probs_fp32_sum_T{t}"], rows[f"probs_fp64_table_T{t}"]
        assert 1e-9 < fp32["measured"] < 1e-3 and fp32["tolerance"] == 2e-6 and fp32["severity"] == "report"
        assert 0 < fp64["measured"] <= 1e-13 and fp64["tolerance"] == 1e-12     # numpy vs torch: rounding only
    for b in ("sample", "greedy"):
        kv = rows[f"kv_cache_logits_{b}"]
        assert kv["tolerance"] == 1e-2 and kv["detail"].startswith("per step: ") and math.isfinite(kv["measured"])


def test_checks_stage_params_are_in_params_yaml(ws):
    from pipeline.store import graph
    assert schema.subset(schema.read_params(ws / paths.PARAMS), graph.PARAMS["checks"])


def test_a_failed_error_check_fails_the_stage_after_writing_results(ws, tmp_path):
    copy = tmp_path / "ws"
    shutil.copytree(ws, copy, symlinks=True)
    logits = part(paths.LOGITS, copy)

    def flip(v):          # position 3: no later table reads it, so only the file check can see it
        v[3 * V + 42] += 0.25
    rewrite(logits, tmp_path / "l.parquet", "logit", flip).replace(logits)
    # a producer that wrote a wrong number and recorded it faithfully: the manifest chain
    # holds, so only the check itself can catch it
    for manifest_path in (copy / "artifacts").glob("*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        for rec in manifest["outputs"] + manifest["inputs"]:
            if rec["path"] == rel(paths.LOGITS, copy):
                rec["sha256"] = provenance.sha256_file(logits)
        if manifest["stage"] == "tokenize":     # as if tokenize ran with the ids below (else it is stale)
            manifest["config"]["prompt"]["known"]["expected_token_ids"]["qwen2"][3] = 445
        manifest_path.write_text(json.dumps(manifest))
    params = yaml.safe_load((copy / paths.PARAMS).read_text())
    params["prompt"]["known"]["expected_token_ids"]["qwen2"][3] = 445   # the article says 444
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
    summary = json.loads((copy / "artifacts/checks/metrics.json").read_text())
    assert summary["failed_error"] == 1 and summary["failed_report"] >= 1
    assert summary["failing"].startswith("logits_file_exact")          # errors first
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
    assert m == {"checks": 2, "passed": 1, "failed_error": 0, "failed_report": 1, "failing": "b",
                 "failing_prompts": "none"}
    assert json.dumps(m, allow_nan=False)
    worst = [verdicts.Check(f"r{i}", "w", 1, 0, "report") for i in range(4)] + [verdicts.Check("e", "w", 1, 0, "error")]
    assert verdicts.metrics(worst)["failing"] == "e, r0, r1 +2 more"       # errors first, at most 3 names
    assert verdicts.metrics([ok])["failing"] == "none"
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


def test_device_difference_reads_the_cpu_kernels_each_side_recorded():
    """Two CPU computations differ in bits when their kernels do (AVX2 vs AVX-512 bf16): a cluster may mix CPUs,
    so the recorded kernels of each (a Ray prompt's own) decide; unrecorded on either side is not a difference."""
    avx2, avx512 = "ATen AVX2, flags avx2+fma", "ATen AVX512, flags avx2+fma+avx512f"
    here = ("this check", {"device": "cpu", "gpu_name": None, "cpu_kernels": avx2})
    assert suite.device_difference(("forward", {"device": "cpu", "gpu_name": None, "cpu_kernels": avx2}), here) == ""
    assert suite.device_difference(("forward", {"device": "cpu", "gpu_name": None, "cpu_kernels": avx512}), here) \
        == f"report, not error: forward ran on CPU kernels {avx512}, this check on {avx2}, which may round differently"
    assert suite.device_difference(("forward", {"device": "cpu", "gpu_name": None, "cpu_kernels": None}), here) == ""
    portable = {"mode": "portable", "aten_cpu_capability": "DEFAULT", "cpu_flags": ["avx2"]}
    assert kernels.cpu_key(portable) == kernels.cpu_key({**portable, "cpu_flags": ["avx2", "avx512f"]}) == "portable"
    ray_prompt = {"kernel_mode": "native", "aten_cpu_capability": "AVX512", "cpu_flags": ["avx2", "fma", "avx512f"]}
    assert kernels.cpu_key(ray_prompt) == avx512


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
    logits[0, :, 9] = -float("inf")                              # a masked id: allowed
    clean = suite.logits_finite(logits, [4, 5, 6])
    assert clean.passed and clean.measured == 0 and clean.severity == "error"
    assert clean.detail == "30 values, none NaN or +inf; 3 masked (-inf)"
    logits[0, 1, 7] = float("nan")
    logits[0, 2, 2:4] = float("inf")
    bad = suite.logits_finite(logits, [4, 5, 6])
    assert not bad.passed and bad.measured == 3
    assert bad.detail == "positions 5-6 (2 of 3); position 5: 1 ids (first: [7]); position 6: 2 ids (first: [2, 3])"
    logits[0, 0] = -float("inf")                                 # a whole position masked: no distribution
    assert suite.logits_finite(logits, [4, 5, 6]).measured == 13
    assert suite._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and suite._ranges([3]) == "3"


def test_logits_finite_counts_rows_across_its_64_row_chunks():
    logits = torch.zeros(1, 130, 5, dtype=torch.bfloat16)
    logits[0, 63, 1], logits[0, 64, 0], logits[0, 129, 4] = float("nan"), float("inf"), float("nan")
    c = suite.logits_finite(logits, list(range(130)))
    assert c.measured == 3 and c.detail.startswith("positions 63-64, 129 (3 of 130); position 63: 1 ids (first: [1])")
    assert c.detail.endswith("position 129: 1 ids (first: [4])")


def test_a_missing_stage_is_one_failed_error_check():
    c = suite.outputs_missing("probs")
    assert c.name == "probs_outputs" and c.severity == "error" and not c.passed
    assert "artifacts/probs is missing" in c.detail


# ---------------------------------------------------------------- tokenizer and capture
def test_tokenizer_checks_fail_on_wrong_ids(tokenizer, stored, cfg, ws):
    text, ids = cfg["prompt"].text, stored.token_ids
    wrong = ids[:5] + [ids[5] + 1] + ids[6:]
    tokenizer_json = ws / "artifacts/prepare_model/tokenizer.json"
    assert suite.tokenizer_retokenize(tokenizer_json, tokenizer, text, False, ids).passed
    bad = suite.tokenizer_retokenize(tokenizer_json, tokenizer, text, False, wrong)
    assert not bad.passed and bad.measured == 1 and "index 5" in bad.detail
    assert suite.tokenizer_retokenize(None, tokenizer, text, False, ids[:-1]).measured == 1   # one id short
    assert suite.tokenizer_round_trip(tokenizer, text, ids).passed
    assert suite.tokenizer_round_trip(tokenizer, text + "x", ids).measured == 1
    assert not suite.tokenizer_round_trip(tokenizer, text, wrong).passed
    expected = cfg["prompt"].known_here.expected_token_ids["qwen2"]
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


def test_stored_piece_bytes_are_checked_against_the_prompt_and_decode(tokenizer, stored, cfg):
    text = cfg["prompt"].text
    ok = suite.tokenizer_bytes(tokenizer, text, stored)
    assert ok.passed and ok.detail == f"{len(text.encode())} bytes"
    # " temperature" (position 6) stored as its byte-level stand-in characters: "Ġtemperature"
    standin = [b"\xc4\xa0temperature" if b == b" temperature" else b for b in stored.token_bytes]
    bad = suite.tokenizer_bytes(tokenizer, text, dataclasses.replace(stored, token_bytes=standin))
    assert bad.measured == 2 and bad.detail == "joined bytes, position 6"
    # the two halves of " 就" swapped: neither decodes alone, only the joined bytes show it
    halves = stored.token_bytes[:15] + stored.token_bytes[16:14:-1] + stored.token_bytes[17:]
    assert suite.tokenizer_bytes(tokenizer, text, dataclasses.replace(stored, token_bytes=halves)).detail == \
        "joined bytes"


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
    adds = by_name(suite.residual_adds(model, tensors))
    assert not adds["residual_adds_layer0"].passed and adds["residual_adds_layer1"].passed
    assert "resid_mid" in adds["residual_adds_layer0"].detail


def test_changed_mlp_out_of_the_last_layer_fails_its_residual_add(model, stored):
    tensors = tensors_with(stored, "blocks.1.mlp_out", (0, 24, 0), 100.0)
    adds = by_name(suite.residual_adds(model, tensors))
    assert not adds["residual_adds_layer1"].passed and adds["residual_adds_layer0"].passed


def test_changed_final_norm_out_fails_the_final_norm_and_lm_head_recomputes(model, stored):
    tensors = tensors_with(stored, "final_norm_out", (0, 24, 7), 3.0)
    got = by_name(suite.lm_head(model, tensors, "error"))
    assert got["lm_head_recompute"].measured > 0 and got["final_norm_recompute"].measured > 0
    assert all(c.measured == 0.0 for c in suite.lm_head(model, stored.tensors, "error"))
    # the last layer's output changed: only the final norm recompute sees it (the LM head reads final_norm_out)
    got = by_name(suite.lm_head(model, tensors_with(stored, "blocks.1.resid_post", (0, 3, 5), 50.0), "error"))
    assert not got["final_norm_recompute"].passed and got["lm_head_recompute"].passed


def test_weight_on_a_future_position_fails_future_attention(stored):
    tensors = tensors_with(stored, "blocks.1.attn_weights", (0, 2, 4, 9), 0.25)
    got = by_name(suite.future_attention(tensors))
    assert got["future_attention_layer1"].measured == 0.25 and got["future_attention_layer0"].passed


def counted_passes(model, drift: float = 0.0):
    """A forward hook on the LM head counting the passes; the n-th pass adds n * drift to the
    logits (drift != 0: a model that never gives the same bits twice, the capture's included).
    Remove the returned handle."""
    calls: list[int] = []

    def hook(module, args, output):
        calls.append(1)
        return output + len(calls) * drift if drift else output
    return calls, model.lm_head.register_forward_hook(hook)


def test_a_fresh_pass_equal_to_the_capture_is_the_one_pass_and_proves_the_repeat(model, stored):
    calls, handle = counted_passes(model)
    try:
        got = by_name(suite.fresh_forward(model, stored.tensors, "all", "error"))
    finally:
        handle.remove()
    assert len(calls) == 1                      # the capture is the other run: no second pass
    assert got["capture_transparent"].passed and got["repeat_deterministic"].passed
    assert got["repeat_deterministic"].detail.startswith("one pass")


def test_changed_stored_logits_fail_capture_transparency_and_take_a_second_pass(model, stored):
    tensors = tensors_with(stored, "logits", (0, 24, 100), 99.0)
    calls, handle = counted_passes(model)
    try:
        got = by_name(suite.fresh_forward(model, tensors, "all", "error"))
    finally:
        handle.remove()
    assert len(calls) == 2                      # the second pass shows the computation repeats here
    assert not got["capture_transparent"].passed and got["repeat_deterministic"].passed
    assert got["repeat_deterministic"].detail.startswith("two passes")


def test_a_nondeterministic_model_fails_repeat_determinism(model, stored):
    # Every pass adds one more than the one before: the fresh pass differs from the capture
    # (so a second pass runs), and the second pass from the first.
    calls, handle = counted_passes(model, drift=1.0)
    try:
        got = by_name(suite.fresh_forward(model, stored.tensors, "all", "error"))
    finally:
        handle.remove()
    assert len(calls) == 2
    assert not got["capture_transparent"].passed and not got["repeat_deterministic"].passed
    assert got["repeat_deterministic"].measured == pytest.approx(1.0, abs=0.1)   # +1, rounded in bf16
    assert got["repeat_deterministic"].detail.startswith("two passes")


# ---------------------------------------------------------------- probabilities
@pytest.fixture(scope="module")
def rows(stored) -> dict[int, np.ndarray]:
    return {24: stored.last_row()}


@pytest.fixture(scope="module")
def named(cfg) -> list[probs.NamedFilter]:
    return probs.filters(cfg["probs"], cfg["sampling"])


@pytest.fixture(scope="module")
def warpers_for(model):
    return lambda f: decode.generate_warpers(model, f.settings)


def rewrite_table(src: Path, dst: Path, edit) -> Path:
    """Copy table.parquet with `edit(pyarrow table) -> table` applied, one row group per position."""
    table = edit(pq.read_table(src))
    pq.write_table(table, dst, row_group_size=V)
    return dst


def test_fp64_sum_is_not_enough_probs_fp64_table_fails_on_1e10_relative_error_that_still_sums_to_one(
        stored, rows, tmp_path):
    """The acceptance case: two probabilities off by 1e-10 relative, the sum still 1 (to 1e-16): a
    sum check passes; the stored values against numpy's FP64 softmax do not."""
    order = np.argsort(-rows[24])
    a, b = int(order[0]), int(order[1])

    def off(v):
        delta = v[a] * 1e-10
        v[a] += delta                 # +1e-10 relative
        v[b] -= delta                 # the mass moved, not made
    bad = rewrite(stored.table, tmp_path / "table.parquet", "p_T1", off)
    stored_p, clean_p = pq.read_table(bad)["p_T1"].to_numpy(), pq.read_table(stored.table)["p_T1"].to_numpy()
    assert math.fsum(stored_p.tolist()) == pytest.approx(math.fsum(clean_p.tolist()), abs=1e-17)   # still sums to 1
    assert abs(math.fsum(stored_p.tolist()) - 1.0) < 1e-14
    got = by_name(tables.fp64_tables(bad, rows, (0.5, 1.0, 2.0)))
    t1 = got["probs_fp64_table_T1"]
    assert not t1.passed and t1.severity == "error" and t1.measured == pytest.approx(1e-10 * stored_p[a] / stored_p[b],
                                                                                    rel=1e-3)
    assert f"id {b}" in t1.detail and got["probs_fp64_table_T0_5"].passed and got["probs_fp64_table_T2"].passed
    assert all(c.passed for c in tables.fp64_tables(stored.table, rows, (0.5, 1.0, 2.0)))


def test_a_nan_or_a_missing_row_fails_the_fp64_table_and_fp32_is_a_report(stored, rows, tmp_path):
    row = rows[24].copy()
    row[5] = np.nan
    got = by_name(tables.fp64_tables(stored.table, {24: row}, (1.0,)))
    assert got["probs_fp64_table_T1"].measured == math.inf
    short = rewrite_table(stored.table, tmp_path / "t.parquet", lambda t: t.slice(0, V - 1))
    assert "rows missing" in tables.fp64_tables(short, rows, (1.0,))[0].detail
    fp32 = by_name(tables.fp32_sums(rows, (1.0,), 0.0))["probs_fp32_sum_T1"]
    assert fp32.severity == "report" and not fp32.passed                           # FP32 is never exact


def test_a_changed_logit_or_rank_in_table_parquet_fails_its_column_check(stored, rows, tmp_path):
    assert all(c.passed for c in tables.table_columns(stored.table, rows))

    def shift(v):
        v[100] += 1                    # rank 0-based here, say
    got = by_name(tables.table_columns(rewrite(stored.table, tmp_path / "r.parquet", "rank", shift), rows))
    assert got["probs_table_ranks"].measured == 1 and "first id 100" in got["probs_table_ranks"].detail
    assert got["probs_table_logits"].passed

    def bump(v):
        v[7] += 0.5
    got = by_name(tables.table_columns(rewrite(stored.table, tmp_path / "l.parquet", "logit", bump), rows))
    assert got["probs_table_logits"].measured == 1 and got["probs_table_ranks"].passed


def test_a_changed_kept_probability_fails_filtered_probs(stored, rows, named, warpers_for, tmp_path):
    got = by_name(tables.filtered(stored.filtered, rows, named, warpers_for))
    assert all(c.passed for c in got.values()), got
    k2 = pq.read_table(stored.filtered)["filter"].to_pylist().index("top_k_2")

    def bump(v):
        v[k2] += 1e-9
    got = by_name(tables.filtered(rewrite(stored.filtered, tmp_path / "f.parquet", "prob_after", bump), rows, named,
                                  warpers_for))
    assert got["filtered_probs"].measured > 1e-9 and "top_k_2@24 prob_after" in got["filtered_probs"].detail
    assert got["filtered_sets_numpy"].passed and got["filtered_sets_warpers"].passed and got["filtered_rows"].passed


def test_a_top_p_set_with_an_extra_id_fails_both_set_derivations(stored, rows, named, warpers_for, tmp_path):
    table = pq.read_table(stored.filtered)
    p9 = [i for i, f in enumerate(table["filter"].to_pylist()) if f == "top_p_0.9"]
    kept = set(table["token_id"].to_pylist()[i] for i in p9)
    extra = next(int(i) for i in np.argsort(-rows[24], kind="stable") if int(i) not in kept)   # the next id
    row = {k: [v[p9[-1]]] for k, v in table.to_pydict().items()}
    row.update(token_id=[extra], kept_rank=[len(p9) + 1])
    bad = tmp_path / "f.parquet"
    pq.write_table(pa.concat_tables([table, pa.table(row, schema=table.schema)]), bad)
    got = by_name(tables.filtered(bad, rows, named, warpers_for))
    assert got["filtered_sets_numpy"].measured == 1 and "top_p_0.9@24" in got["filtered_sets_numpy"].detail
    assert got["filtered_sets_warpers"].measured == 1 and "1 ids differ" in got["filtered_sets_warpers"].detail


def test_a_wrong_setting_in_filtered_parquet_fails_filtered_rows(stored, rows, named, warpers_for, tmp_path):
    def t2(v):
        v[:] = 2.0
    got = by_name(tables.filtered(rewrite(stored.filtered, tmp_path / "f.parquet", "temperature", t2), rows, named,
                                  warpers_for))
    assert got["filtered_rows"].measured == len(named) and got["filtered_sets_numpy"].passed


# ---------------------------------------------------------------- trajectories
@pytest.fixture(scope="module")
def steps(stored) -> list[dict]:
    return pq.read_table(stored.steps).to_pylist()


def bump_step(src: Path, dst: Path, key: tuple[str, bool, int], token_id: int, delta: float) -> Path:
    """A copy of step_logits.parquet with one logit of step `key` (branch, kv_cache, step) moved by delta."""
    rows = logits_io.read_step_logits(src)
    for k, _, row in rows:
        if (k["branch"], k["kv_cache"], k["step"]) == key:
            row[token_id] += delta
    meta = {k: v for k, v in pq.read_schema(src).metadata.items() if k != logits_io.STEP_META_KEY}
    logits_io.write_step_logits(dst, [(p, r) for _, p, r in rows], [k for k, _, _ in rows], meta)
    return dst


@pytest.fixture(scope="module")
def step_rows(stored) -> dict:
    return trajectory.step_logit_rows(stored.step_logits)


@pytest.fixture(scope="module")
def one_row(model, stored) -> np.ndarray:
    return recompute.lm_head_rows(model, stored.tensors["final_norm_out"], 1)[0, -1].float().numpy()


def test_a_changed_step1_logit_fails_step1_logits_and_shows_in_the_kv_check(stored, steps, one_row, cfg, tmp_path):
    rows = trajectory.step_logit_rows(bump_step(stored.step_logits, tmp_path / "s.parquet", ("greedy", False, 1), 7,
                                                0.5))
    got = by_name(trajectory.step1_logits(rows, one_row, stored.last_row(), "error"))
    assert got["step1_logits_greedy"].measured == 0.5 and got["step1_logits_greedy_kv"].passed
    assert got["step1_logits_greedy_kv"].detail == "vs lm_head one row: max abs diff 0; vs the forward's logits " \
                                                   "row: max abs diff 0"
    assert got["step1_logits_greedy"].detail.startswith("vs lm_head one row: max abs diff 0.5 at id 7 ")
    kv = by_name(trajectory.kv_cache(steps, rows, cfg["checks"].kv_cache_atol))
    assert kv["kv_cache_logits_greedy"].measured == 0.5 and not kv["kv_cache_logits_greedy"].passed
    assert kv["kv_cache_logits_greedy"].severity == "report" and kv["kv_cache_logits_sample"].passed


def _with_token(steps: list[dict], branch: str, kv: bool, step: int, token: int) -> list[dict]:
    return [{**r, "token_id": token} if (r["branch"], r["kv_cache"], r["step"]) == (branch, kv, step) else r
            for r in steps]


def parity(model, stored, steps, step_rows, cfg, device="cpu") -> dict[str, verdicts.Check]:
    return by_name(trajectory.generate_parity(model, stored.token_ids, steps, step_rows, cfg["sampling"],
                                              loader.eos_ids(model), torch.device(device), "error"))


def test_a_changed_greedy_token_fails_argmax_and_generate_parity(model, stored, steps, step_rows, cfg):
    assert trajectory.greedy_argmax(steps, step_rows)[0].passed
    bad3 = _with_token(steps, "greedy", False, 3, 11)
    got = trajectory.greedy_argmax(bad3, step_rows)[0]
    assert got.measured == 1 and got.detail == "greedy step 3"
    got = parity(model, stored, _with_token(steps, "greedy", True, 3, 11), step_rows, cfg)
    assert got["generate_parity_greedy_kv"].measured == 1 and "index 2" in got["generate_parity_greedy_kv"].detail
    assert all(c.passed for n, c in got.items() if n != "generate_parity_greedy_kv")
    kv = by_name(trajectory.kv_cache(bad3, step_rows, cfg["checks"].kv_cache_atol))
    assert kv["kv_cache_choices_greedy"].measured == 1 and "3 steps compared" in kv["kv_cache_choices_greedy"].detail


def test_a_changed_sampled_token_or_step_logit_fails_generate_parity(model, stored, steps, step_rows, cfg, tmp_path):
    got = parity(model, stored, _with_token(steps, "sample", False, 2, 11), step_rows, cfg)
    assert got["generate_parity_sample"].measured == 1 and got["generate_parity_sample"].severity == "error"
    assert "index 1" in got["generate_parity_sample"].detail and got["generate_parity_sample_kv"].passed
    rows = trajectory.step_logit_rows(bump_step(stored.step_logits, tmp_path / "s.parquet", ("sample", True, 3), 5,
                                                -0.25))
    got = parity(model, stored, steps, rows, cfg)
    assert got["generate_logits_sample_kv"].measured == 0.25 and "per step: 0, 0, 0.25, 0" in \
        got["generate_logits_sample_kv"].detail
    assert [n for n, c in got.items() if not c.passed] == ["generate_logits_sample_kv"]


def test_a_wrong_loop_claim_or_token_count_in_prompt_metrics_fails_trajectory_loops(stored, steps, cfg):
    rows = pq.read_table(stored.prompt_metrics[0]).to_pylist()
    assert trajectory.loops(rows, steps)[0].passed and len(rows) == 4 + cfg["sampling"].what_if  # + what-if runs
    greedy = [r["token_id"] for r in sorted(steps, key=lambda r: r["step"]) if (r["branch"], r["kv_cache"]) ==
              ("greedy", False)]
    looping = steps
    for step in range(3, len(greedy) + 1):                         # every step after the second: b again
        looping = _with_token(looping, "greedy", False, step, greedy[1])
    claim = {"loop": True, "loop_start": 2, "loop_period": 1}       # ids a, b, b, ..., b: period 1 from step 2
    right = [{**r, **claim} if (r["branch"], r["kv_cache"]) == ("greedy", False) else r for r in rows]
    assert trajectory.loops(right, looping)[0].passed
    got = trajectory.loops(rows, looping)[0]                                   # the stored "no loop" is now wrong
    assert (got.measured, got.detail, got.severity) == (1, "greedy", "error")
    for wrong in ({"loop_start": 3}, {"loop_start": 1}, {"loop_period": 2}, {"loop_start": None}):
        bad = [{**r, **wrong} if (r["branch"], r["kv_cache"]) == ("greedy", False) else r for r in right]
        assert trajectory.loops(bad, looping)[0].detail == "greedy", wrong
    fewer = [{**r, "n_new": r["n_new"] - 1} if r["branch"] == "sample" and r["kv_cache"] else r for r in rows]
    assert trajectory.loops(fewer, steps)[0].detail == "sample_kv"
    missing = [r for r in rows if (r["branch"], r["kv_cache"]) != ("greedy", True)]
    assert trajectory.loops(missing, steps)[0].detail == "greedy_kv"          # a run missing from the table


def test_generate_parity_of_the_sample_branch_is_a_report_off_cpu(model, stored, steps, step_rows, cfg):
    # The device only decides the severity here (the model stays on CPU): on CUDA generate
    # draws from the device RNG, the decode loop from a CPU generator.
    got = parity(model, stored, steps, step_rows, cfg, "cuda")
    assert got["generate_parity_sample"].severity == "report" and "device RNG" in got["generate_parity_sample"].what
    assert got["generate_parity_greedy"].severity == "error"


# ---------------------------------------------------------------- reference figures on real artifacts
def test_tokenizer_part_of_the_reference_runs_and_passes_for_tiny_qwen2(stored, model, tokenizer, cfg):
    got = by_name(reference.run(stored, model, tokenizer, cfg, []))
    assert set(got) == {"ref_prompt", "ref_token_ids", "ref_pieces", "ref_byte_split"}
    assert all(c.passed for c in got.values())


def test_full_reference_comparison_runs_on_tiny_artifacts(stored, model, tokenizer, cfg, ws, clean_run):
    # tiny_qwen2 is not the reference model: the run figures are gathered and compared, and
    # the model-size figures fail (as errors), naming what differs.
    ref = reference.load_reference("seed_article")
    cfg = {**cfg, "prompt": prompt_set.for_config(cfg["prompt"], ws).prompts[0]}    # as the checks stage passes it
    results = suite.run_all(stored, model, tokenizer, cfg, torch.device("cpu"), loader.eos_ids(model))
    measured = {"prompt": cfg["prompt"].text,
                "tokenize": reference.gather_tokenizer(stored.token_ids, stored.token_text, tokenizer, " 就"),
                **reference.gather_run(stored, model, tokenizer, cfg, results, ref)}
    got = by_name(reference.compare(measured, ref, "all"))
    assert got["ref_shape_num_hidden_layers"].detail == "got 2, reference 28" and not got["ref_tokenizer_len"].passed
    assert got["ref_shape_logits"].passed and got["ref_lm_head_recompute"].passed and got["ref_token_ids"].passed
    # the kept count, against the warpers generate builds, on the stored logits
    scores = decode.generate_warpers(model, decode.SamplingSettings(top_p=0.9))(
        None, torch.from_numpy(stored.last_row()).reshape(1, -1))
    assert measured["filters"]["top_p_0.9_kept_count"] == int(torch.isfinite(scores).sum())
    # the same verdicts as the stage's own run (a subprocess) wrote (it adds the lens checks, pipeline.checks.lens)
    snapshot = loader.snapshot_dir(paths.stage_dir("prepare_model", ws),
                                   json.loads(paths.artifact(paths.SOURCE, ws).read_text()))
    results += lens.run(stored, model, snapshot, "bfloat16")
    written = {r["name"]: r["verdict"] for r in pq.read_table(ws / "artifacts/checks/checks.parquet").to_pylist()}
    assert {c.name: c.verdict for c in results} == {n: v for n, v in written.items() if not n.startswith("ref_")}
