"""CUDA expectations (marked `gpu`, skipped without CUDA; the two-GPU ones skip with fewer than two).

The rest of the suite pins `capture.device=cpu` (tests/conftest.py) and compares with CPU
reloads; here the chain runs on the GPU and is compared with itself, as the checks stage does,
and a model split over two GPUs must capture, recompute and decode exactly as on one.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from bench import gpu_check
from pipeline.checks import recompute
from pipeline.checks.verdicts import max_abs
from pipeline.model import capture, decode, loader
from pipeline.numerics.sampling import SamplingSettings
from pipeline.store import paths
from tests.conftest import make_workspace, run_module
from tests.helpers.partitions import part

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
SPLIT = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
         "model.rotary_emb": 1, "lm_head": 1}


@pytest.fixture(scope="module")
def gpu_ws(tmp_path_factory):
    ws = make_workspace(tmp_path_factory.mktemp("cuda_ws"), ["model=tiny_qwen2"], device="cuda")
    for stage in ("prepare_model", "tokenize", "forward", "logits", "probs", "trajectories", "checks"):
        run_module(f"stages.{stage}", ws, check=True)
    return ws


def test_the_chain_on_a_gpu_records_it_and_passes_every_error_check(gpu_ws):
    name = torch.cuda.get_device_name(0)
    facts = json.loads(part(paths.FORWARD_FACTS, gpu_ws).read_text())
    assert facts["device"] == "cuda" and facts["gpu_name"] == name
    for stage in ("trajectories", "checks"):
        recorded = json.loads((gpu_ws / f"artifacts/{stage}/manifest.json").read_text())["facts"]
        assert (recorded["device"], recorded["gpu_name"]) == ("cuda", name), stage
    rows = {r["name"]: r for r in pq.read_table(gpu_ws / "artifacts/checks/checks.parquet").to_pylist()}
    assert [n for n, r in rows.items() if r["severity"] == "error" and r["verdict"] != "pass"] == []
    # same GPU for every computation: the kernel-bound checks stay errors ...
    assert rows["lm_head_recompute"]["severity"] == rows["step1_logits_greedy"]["severity"] == "error"
    # ... but generate draws from the CUDA generator, the decode loop from a CPU one
    assert rows["generate_parity_sample"]["severity"] == "report"


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return gpu_check.build_snapshot(gpu_check.settings(), tmp_path_factory.mktemp("tiny"))


def test_max_abs_compares_a_gpu_tensor_with_a_cpu_one():
    a = torch.randn(3, 1000, dtype=torch.bfloat16)
    b = a.clone()
    b[2, 999] += 1.0
    assert max_abs(a.cuda(), a) == 0.0 and max_abs(a.cuda(), b) == max_abs(a, b) > 0


def test_gpu_check_runs_on_the_gpu_and_compares_with_the_cpu(capsys):
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert f"({torch.cuda.get_device_name(0)})" in out and "vs cpu" in out and "CPU/GPU" in out


@two_gpus
def test_a_model_split_over_two_gpus_captures_recomputes_and_decodes_as_on_one(snapshot):
    conf, ids = gpu_check.settings(), torch.tensor([gpu_check.settings()["ids"]])
    spec = capture.CaptureSpec(attention_layers=(0, -1), positions="all")
    one = loader.load_model(snapshot, torch.bfloat16, "cuda:0", "eager", False)
    from transformers import AutoModelForCausalLM
    split = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.bfloat16, attn_implementation="eager",
                                                 device_map=SPLIT, local_files_only=True).eval()
    assert {str(p.device) for p in split.parameters()} == {"cuda:0", "cuda:1"}
    want, got = capture.run_capture(one, ids, spec), capture.run_capture(split, ids, spec)
    assert max(max_abs(got[k], want[k]) for k in want) == 0.0
    assert recompute.lm_head_recompute(split, got["final_norm_out"], got["logits"]) == 0.0
    assert set(recompute.layer0_attention_recompute(split, got).values()) == {0.0}
    for kv in (False, True):
        a = decode.run_branch(one, conf["ids"], SamplingSettings(0.0, 0, 1.0), 3, 0, kv, {gpu_check.EOS_ID})
        b = decode.run_branch(split, conf["ids"], SamplingSettings(0.0, 0, 1.0), 3, 0, kv, {gpu_check.EOS_ID})
        assert [s.token_id for s in a] == [s.token_id for s in b]
        assert decode.generate_reference(split, conf["ids"], SamplingSettings(0.0, 0, 1.0), 3, 0, kv_cache=kv,
                                         eos_ids={gpu_check.EOS_ID}).ids == [s.token_id for s in b]


@two_gpus
def test_capture_device_multi_spreads_the_weights_over_the_gpus(snapshot):
    model = loader.load_model(snapshot, torch.bfloat16, loader.resolve_device("multi"), "eager", False, spread=True)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert loader.device_record(model, loader.resolve_device("multi"))["gpu_name"]
