"""`python -m bench` (`nexttoken bench` in a checkout): the structure of bench.json and the
measuring helpers. No timing assertions: times depend on the machine and its neighbours; only
shapes, presence and finiteness are tested."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from bench import bench, chain_scale, scale
from pipeline.errors import UserError
from tests.conftest import REPO, run_module

TARGETS = {"capture_vs_plain": 1.10, "parquet_vs_pandas": 0.5, "parquet_size_vs_pandas": 0.6,
           "chain_vs_baseline": 1.2, "capture_vs_nnsight_time": 1.0, "capture_vs_nnsight_peak_rss": 1.0,
           "dvc_repro_vs_in_process[tiny_qwen2]": 1.5, "chain_peak_vs_4TV[tiny_qwen2]": 2.5,
           "chain_own_work_cpu_exponent[tiny_qwen2]": 1.1, "chain_max_extra_memory_exponent[tiny_qwen2]": 1.1}
INFORMATION = ("plain_all_vs_plain_last", "parquet_size_vs_bf16", "parquet_vs_numpy", "parquet_vs_npz_compressed",
               "parquet_uncompressed_vs_numpy", "chain_vs_baseline_cpu_time", "chain_without_checks_vs_baseline",
               "equivalence_vs_forward",
               "chain_cpu_exponent[tiny_qwen2]", "plain_forward_cpu_exponent[tiny_qwen2]")


# ---------------------------------------------------------------- helpers (fast)
def test_alternate_flips_the_order_every_repetition():
    calls = []
    times = bench.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert set(times) == {"a", "a.cpu", "b", "b.cpu"} and all(len(t) == 3 for t in times.values())


def test_paired_ratio_is_the_median_of_per_pair_ratios():
    assert bench.paired_ratio({"x": [2.0, 3.0, 100.0], "y": [1.0, 1.0, 10.0]}, "x", "y") == 3.0


def test_fit_exponent_recovers_power_laws():
    xs = [32, 256, 1024, 4096]
    assert chain_scale.fit_exponent(xs, [5 * x for x in xs]) == pytest.approx(1.0)
    assert chain_scale.fit_exponent(xs, [x ** 2 for x in xs]) == pytest.approx(2.0)
    assert math.isnan(chain_scale.fit_exponent([32], [1.0]))
    assert math.isnan(chain_scale.fit_exponent(xs, [1.0, 0.0, 1.0, 2.0]))     # log of 0: not a fit


def _synthetic_run(t: int) -> dict:
    """A chain-scale run whose model stages grow as T^2 and the others as T, plus constants."""
    stages = {s: {"wall_s": 1.0, "cpu_s": (1e-6 * t * t if s in chain_scale.MODEL_STAGES else 1e-3 * t) + 0.0,
                  "peak_mb": 500.0 + 0.01 * t, "rc": 0} for s in chain_scale.STAGES}
    own = sum(stages[s]["cpu_s"] for s in chain_scale.OWN_WORK)
    return {"length": t, "T": t, "V": 100, "positions": "all", "stages": stages, "loaded_mb": 400.0,
            "plain_forward_s": 1e-6 * t * t, "plain_forward_cpu_s": 1e-6 * t * t, "chain_wall_s": 7.0,
            "chain_cpu_s": sum(st["cpu_s"] for st in stages.values()), "own_work_cpu_s": own,
            "max_extra_mb": 100.0 + 0.01 * t, "four_tv_mb": 4 * t * 100 / 2**20,
            "peak_vs_4tv": (100.0 + 0.01 * t) / (4 * t * 100 / 2**20), "checks_rc": 0}


def test_chain_scale_fits_separate_the_pipelines_own_work_from_the_models():
    runs = [_synthetic_run(t) for t in (256, 1024, 4096)]
    section = {"model": "m", "runs": {"all": runs}, "fits": {"all": chain_scale.fits(runs)}}
    f = section["fits"]["all"]["all"]
    assert f["own_work_cpu"] == pytest.approx(1.0) and f["forward_cpu"] == pytest.approx(2.0)
    assert f["chain_cpu"] > 1.3 and f["max_extra_memory"] < 1.0
    res = bench.Results()
    chain_scale.record_ratios(res, section)
    assert res.ratios["chain_own_work_cpu_exponent[m]"]["pass"] is True
    assert res.ratios["chain_peak_vs_4TV[m]"]["value"] == runs[-1]["peak_vs_4tv"]     # the longest prompt
    assert res.ratios["chain_cpu_exponent[m]"]["target"] is None
    text = chain_scale.table(section)
    assert "chain scale m (positions=all)" in text and "4096" in text and "slope" in text and "from 2nd" in text


def test_table_marks_pass_miss_and_information():
    res = bench.Results()
    res.ratio("fast", 0.9, 1.1, "x")
    res.ratio("slow", 2.0, 1.2, "y")
    res.ratio("size", 0.8, None, "z")
    text = bench.table(res.ratios)
    assert "PASS" in text.splitlines()[2] and "MISS" in text.splitlines()[3] and "info" in text.splitlines()[4]
    assert res.ratios["slow"] == {"value": 2.0, "target": 1.2, "pass": False, "what": "y", "note": ""}


def test_write_json_is_atomic(tmp_path):
    out = tmp_path / "artifacts" / "bench" / "bench.json"
    bench.write_json(out, {"a": 1})
    assert json.loads(out.read_text()) == {"a": 1}
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]     # no temp file left behind


def test_missing_model_names_the_command_to_run(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    with pytest.raises(UserError, match="dvc repro prepare_model"):
        bench.Workspace.open(tmp_path)


def test_a_model_other_than_params_yaml_names_is_refused(tiny_workspace, tmp_path):
    (tmp_path / "params.yaml").write_text((tiny_workspace / "params.yaml").read_text().replace(
        "name: tiny_qwen2", "name: some_other_model", 1))
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "prepare_model").symlink_to(tiny_workspace / "artifacts" / "prepare_model")
    with pytest.raises(UserError, match="tiny_qwen2.*some_other_model"):
        bench.Workspace.open(tmp_path)


def test_a_prompt_set_is_refused_in_one_line(tiny_workspace, tmp_path):
    """The bench compares one prompt's chain with the plain-script baseline: a set is named, not a traceback."""
    params = yaml.safe_load((tiny_workspace / "params.yaml").read_text())
    params["prompt"] |= {"text": None, "set": "prompts/concepts.jsonl"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True))
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "prepare_model").symlink_to(tiny_workspace / "artifacts" / "prepare_model")
    with pytest.raises(UserError) as err:
        bench.Workspace.open(tmp_path)
    assert str(err.value).startswith("prompt.set='prompts/concepts.jsonl' is not allowed: null: the bench compares")


def test_unknown_section_is_refused(tmp_path):
    with pytest.raises(UserError, match="--only 'nope'"):
        bench.run(tmp_path, quick=True, only="nope")


def test_logits_io_section_measures_the_zstd_file_and_its_uncompressed_floor(tmp_path):
    logits = (torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    res = bench.Results()
    bench.bench_logits_io(logits, bench.Plan.make(quick=True), res, tmp_path)
    s = res.sections["logits_io"]
    assert s["read_back_exact"] is True and s["shape"] == [4, 3000] and "BYTE_STREAM_SPLIT" in s["encodings"]
    # the floor is the same layout without compression: bigger, never smaller than the zstd file
    assert s["uncompressed_parquet_bytes"] > s["parquet_bytes"]
    for name in ("parquet", "pandas", "numpy", "parquet_uncompressed", "parquet_write", "parquet_read"):
        assert s[name]["median_s"] > 0, name
    assert res.ratios["parquet_vs_pandas"]["target"] == 0.5 and res.ratios["parquet_size_vs_pandas"]["target"] == 0.6
    assert res.ratios["parquet_size_vs_pandas"]["value"] == s["parquet_bytes"] / s["pandas_parquet_bytes"]
    assert res.ratios["parquet_vs_numpy"]["target"] is None
    floor = res.ratios["parquet_uncompressed_vs_numpy"]
    assert floor["target"] is None and floor["pass"] is None and floor["value"] > 0 and "zstd" in floor["note"]


def test_importtime_counts_top_level_imports_once_and_names_the_heavy_packages():
    # as under `python -X importtime -m stages.forward`: torch and transformers nested in the stage's own modules
    text = """import time: self [us] | cumulative | imported package
import time:       196 |        196 |   _io
import time:      1789 |      21086 | site
stage progress line
import time:       500 |       2500 |       torch._C
import time:      9000 |    2500000 |     torch
import time:      1000 |     900000 |     transformers
import time:      3000 |    3403000 |   pipeline.model.loader
import time:       400 |    3500000 | pipeline.model.forward
import time:       700 |     400000 | pyarrow.parquet
import time: 12 | garbled
"""
    got = scale.parse_importtime(text)
    # 21086 + 3500000 + 400000 us: nested imports are inside their parents' cumulative times
    assert got["import_s"] == 3.921 and got["modules"] == 8 and got["unparsed_lines"] == 1
    assert got["heavy"] == ["torch", "transformers", "pyarrow"]
    assert got["heavy_s"] == {"torch": 2.5, "transformers": 0.9}      # pyarrow.parquet is not pyarrow's own line
    assert [t["module"] for t in got["top"]] == ["pipeline.model.forward", "pyarrow.parquet", "site"]
    rows = scale.importtime_table({"tiny": {"stage_imports": {"forward": {**got, "wall_s": 4.0},
                                                              "lens": {"error": "exit 2: no capture"}}}}).splitlines()
    assert rows[-2].split() == ["forward", "3.92", "4.00", "8", "2.50", "0.90", "pyarrow"]
    assert rows[-1].split() == ["lens", "failed:", "exit", "2:", "no", "capture"]


def test_dvc_command_runs_every_stage_after_prepare_model_or_the_named_ones():
    assert scale.dvc_command(None) == ["dvc", "repro", "--force", "--downstream", "tokenize"]
    assert scale.dvc_command(("tokenize",)) == ["dvc", "repro", "--force", "--single-item", "tokenize"]


# ---------------------------------------------------------------- the quick run (slow: dvc in a temp clone)
ATTENTION_FUNCTION_ONLY = ["blocks.0.attn.k_rot", "blocks.0.attn.mask", "blocks.0.attn.q_rot", "blocks.0.attn.z"]


def test_nnsight_saves_the_same_tensors_as_capture(tiny_workspace):
    """The contender is fair: every tensor it saves is capture's, bit for bit, under capture's
    name; capture records only the attention function's internals beyond it."""
    pytest.importorskip("nnsight", reason="nnsight is the `bench` extra: pip install -e '.[bench]'")
    import torch

    from pipeline.model import capture, loader
    model = loader.load_model(tiny_workspace / "artifacts/prepare_model", torch.bfloat16, "cpu", "eager", False)
    ids, layers = torch.tensor([[9707, 1879, 11, 1052, 374, 264]]), (0, 1)
    saved = bench.nnsight_contender(model, ids, layers)()
    cap = capture.run_capture(model, ids, capture.CaptureSpec(list(layers), "all"))
    assert sorted(set(cap) - set(saved)) == ATTENTION_FUNCTION_ONLY and set(saved) <= set(cap)
    assert [k for k, v in saved.items() if not torch.equal(v, cap[k])] == []


@pytest.fixture(scope="module")
def quick_result(tiny_workspace, tmp_path_factory) -> tuple[Path, dict, str]:
    """`nexttoken bench --quick` in a copy of the tiny workspace (the fixture stays read-only)."""
    ws = tmp_path_factory.mktemp("bench_ws")
    shutil.copy(tiny_workspace / "params.yaml", ws / "params.yaml")
    shutil.copytree(tiny_workspace / "artifacts" / "prepare_model", ws / "artifacts" / "prepare_model")
    # `python -m bench` in another folder: the checkout's bench/ on the path, the workspace as cwd
    proc = run_module("bench", ws, "--quick", check=True, timeout=1800,
                      env={"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    return ws, json.loads((ws / bench.OUTPUT).read_text()), proc.stdout


@pytest.mark.slow
def test_quick_bench_records_every_ratio_with_its_target(quick_result):
    _, result, _ = quick_result
    ratios = result["ratios"]
    for name, target in TARGETS.items():
        if name.startswith("capture_vs_nnsight") and "memory" not in result["sections"]["nnsight"]:
            continue                      # nnsight not installed: recorded as such
        assert ratios[name]["target"] == target, name
        # a growth exponent may be ~0 (or just below) for a flat curve at the quick lengths
        assert math.isfinite(ratios[name]["value"]) and ("exponent" in name or ratios[name]["value"] > 0), name
        assert ratios[name]["pass"] == (ratios[name]["value"] <= target)
    for name in INFORMATION:
        assert ratios[name]["target"] is None and ratios[name]["pass"] is None
        assert math.isfinite(ratios[name]["value"]), name
        # A growth exponent may be ~0 (or just below) for a flat curve; a ratio of times may not.
        assert "exponent" in name or ratios[name]["value"] > 0, name


@pytest.mark.slow
def test_quick_bench_sections_hold_what_the_ratios_come_from(quick_result):
    _, result, _ = quick_result
    s = result["sections"]
    assert result["quick"] is True and result["model"] == "tiny_qwen2"
    assert s["capture"]["bit_identical_logits"] is True
    assert s["logits_io"]["read_back_exact"] is True and "BYTE_STREAM_SPLIT" in s["logits_io"]["encodings"]
    assert s["logits_io"]["uncompressed_parquet_bytes"] > s["logits_io"]["parquet_bytes"]
    assert set(s["chain"]["per_stage_s"]) == set(bench.CHAIN_STAGES)
    dvc = s["dvc"]["tiny_qwen2"]
    assert dvc["rc"] == 0 and set(dvc["per_stage"]) == {"tokenize", "forward"}
    assert dvc["extra_breakdown"]["python_start_and_imports_s"] > 0
    # -X importtime per stage: the logits stage computes nothing with torch and must not import it
    imports = dvc["stage_imports"]
    assert set(imports) == {"logits", "forward"} and "torch" in imports["forward"]["heavy"], imports
    assert "torch" not in imports["logits"]["heavy"] and "pyarrow" in imports["logits"]["heavy"], imports
    assert imports["logits"]["import_s"] > 0 and imports["forward"]["import_s"] <= imports["forward"]["wall_s"]
    assert imports["forward"]["heavy_s"]["torch"] > 0 and imports["logits"]["unparsed_lines"] == 0
    assert "available" in s["nnsight"]["transformer_lens"]
    if "memory" in s["nnsight"]:          # nnsight installed (`.[bench]`, as `make test` does)
        assert s["nnsight"]["same_logits"] is True and s["nnsight"]["nnsight_tensors_differing_from_capture"] == []
    runs = s["scale"]["tiny_qwen2"]["runs"]["all"]
    assert [r["length"] for r in runs] == [16, 64] and runs[0]["T"] < runs[1]["T"]
    for r in runs:
        assert set(r["stages"]) == set(chain_scale.STAGES) and r["checks_rc"] == 0
        assert all(st["wall_s"] > 0 and st["cpu_s"] > 0 and st["peak_mb"] > 0 for st in r["stages"].values())
        assert r["four_tv_mb"] == pytest.approx(4 * r["T"] * 152064 / 2**20, abs=0.1)
    kernels = s["kernels"]
    if "skipped" not in kernels:          # portable has a meaning here (x86-64 with AVX2 + FMA)
        for dtype in ("bfloat16", "float32"):
            runs = kernels[dtype]["runs"]
            assert runs["portable"][0]["kernel_path"].startswith("portable; ATen AVX2, 2 threads")
            assert runs["native"][0]["kernel_path"].startswith("native;") and runs["native"][0]["dtype"] == dtype
            assert result["ratios"][f"portable_vs_native[{dtype}]"]["value"] > 0


@pytest.mark.slow
def test_quick_bench_prints_ratios_and_the_scale_table(quick_result):
    ws, result, stdout = quick_result
    for name in result["ratios"]:
        assert name in stdout
    assert "chain scale tiny_qwen2 (positions=all)" in stdout and "slope" in stdout
    assert "stage imports (tiny_qwen2: python -X importtime" in stdout and "\nlogits " in stdout
    assert "wrote artifacts/bench/bench.json" in stdout
    assert not list((ws / "artifacts" / "bench").glob(".bench-*"))


@pytest.mark.slow
def test_one_section_only(tiny_workspace, tmp_path):
    shutil.copy(tiny_workspace / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(tiny_workspace / "artifacts" / "prepare_model", tmp_path / "artifacts" / "prepare_model")
    result = bench.run(tmp_path, quick=True, only="logits_io")
    assert set(result["ratios"]) == {"capture_vs_plain", "plain_all_vs_plain_last", "parquet_vs_numpy",
                                     "parquet_vs_pandas", "parquet_size_vs_pandas",
                                     "parquet_vs_npz_compressed", "parquet_size_vs_bf16",
                                     "parquet_uncompressed_vs_numpy"}
    assert set(result["sections"]) == {"capture", "logits_io", "workspace"} and result["complete"] is True
