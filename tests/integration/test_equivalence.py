"""The equivalence stage on tiny_qwen2: rows reproduced by a plain transformers forward written here,
and its checks shown failing on a wrong row."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.checks import equivalence as checks
from pipeline.model import loader
from pipeline.model.capture import CaptureSpec
from pipeline.store import paths
from tests.conftest import copy_ws, run_module

VARIATIONS = ["batch_2", "float32", "threads_1", "kv_cache"]      # the in-process rows (kernels: a subprocess)


@pytest.fixture(scope="module")
def matrix_ws(tiny_chain, tmp_path_factory) -> Path:
    ws = copy_ws(tiny_chain, tmp_path_factory.mktemp("equivalence") / "ws")
    params = yaml.safe_load((ws / paths.PARAMS).read_text())
    params["equivalence"]["variations"] = VARIATIONS
    (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    run_module("stages.equivalence", ws, check=True)
    return ws


def _rows(ws: Path) -> dict[str, dict]:
    (pid,) = paths.prompt_ids(paths.EQUIVALENCE, ws)
    return {r["variation"]: r for r in pq.read_table(paths.partition(paths.EQUIVALENCE, pid, ws)).to_pylist()}


def _recorded(ws: Path):
    from safetensors.torch import load_file
    (pid,) = paths.prompt_ids(paths.CAPTURE, ws)
    facts = json.loads(paths.partition(paths.FORWARD_FACTS, pid, ws).read_text())
    return facts["input_ids"], load_file(str(paths.partition(paths.CAPTURE, pid, ws)))["logits"][0]


def _snapshot(ws: Path) -> Path:
    prepared = paths.stage_dir("prepare_model", ws)
    return loader.snapshot_dir(prepared, json.loads((prepared / "source.json").read_text()))


def _plain(snapshot: Path, rows: list[list[int]], dtype, pad: int = 0) -> torch.Tensor:
    """Logits of row 0 of a LEFT-padded batch (masked pads), position ids counted over the real tokens."""
    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=dtype, attn_implementation="eager").eval()
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pos = torch.tensor([[1] * (width - len(r)) + list(range(len(r))) for r in rows])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    return logits[0, width - len(rows[0]):]


def _figures(rec: torch.Tensor, var: torch.Tensor) -> dict:
    a, b = rec.double(), var.double()
    p, q = torch.softmax(a, -1), torch.softmax(b, -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    return {"max_abs_diff": float((a - b).abs().max()), "mean_abs_diff": float((a - b).abs().mean()),
            "top1_changed": torch.nonzero(a.argmax(-1) != b.argmax(-1)).flatten().tolist(),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def _same(row: dict, mine: dict):
    assert row["max_abs_diff"] == mine["max_abs_diff"]          # the same float64 numbers: exact
    assert row["mean_abs_diff"] == pytest.approx(mine["mean_abs_diff"], rel=1e-12)
    assert row["top1_changed"] == mine["top1_changed"]
    assert row["kl_mean"] == pytest.approx(mine["kl_mean"], rel=1e-9, abs=1e-15)
    assert row["kl_max"] == pytest.approx(mine["kl_max"], rel=1e-9, abs=1e-15)


def test_float32_row_is_a_plain_float32_forward(matrix_ws):
    ids, rec = _recorded(matrix_ws)
    mine = _figures(rec, _plain(_snapshot(matrix_ws), [ids], torch.float32))
    row = _rows(matrix_ws)["float32"]
    _same(row, mine)
    assert row["max_abs_diff"] > 0 and not row["bit_identical"]      # bf16 vs float32 differ, as measured
    assert row["first_differing_tensor"] is not None


def test_batch_of_2_row_is_a_plain_left_padded_forward(matrix_ws):
    ids, rec = _recorded(matrix_ws)
    params = yaml.safe_load((matrix_ws / paths.PARAMS).read_text())
    tok = AutoTokenizer.from_pretrained(_snapshot(matrix_ws))
    filler = tok(params["equivalence"]["fillers"][0], add_special_tokens=False)["input_ids"]
    assert len(filler) > len(ids)                                   # the prompt's row is padded
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    assert pad is not None
    mine = _figures(rec, _plain(_snapshot(matrix_ws), [ids, filler], torch.bfloat16, pad))
    _same(_rows(matrix_ws)["batch_2"], mine)


def test_every_row_and_the_manifest(matrix_ws):
    rows = _rows(matrix_ws)
    assert list(rows) == ["batch_2", "float32", "threads_1", "kv_cache_greedy", "kv_cache_sample"]
    assert rows["threads_1"]["bit_identical"] and rows["threads_1"]["max_abs_diff"] == 0.0    # measured: exact here
    facts = json.loads((matrix_ws / "artifacts/equivalence/manifest.json").read_text())["facts"]
    assert facts["variations"]["threads_1"]["threads"] == 1 and facts["variations"]["float32"]["dtype"] == "float32"
    assert facts["recorded"]["attention"] == "eager"
    table = pq.read_table(matrix_ws / paths.artifact(paths.EQUIVALENCE_CHECKS)).to_pylist()
    by_name = {c["name"]: c for c in table}
    assert by_name["equivalence_rederived_float32"]["verdict"] == "pass"
    assert by_name["equivalence_exact_threads_1"]["verdict"] == "pass"
    assert by_name["equivalence_float32"]["severity"] == "report"


def test_the_rederive_check_recomputes_the_row_and_fails_on_a_wrong_one(matrix_ws):
    """The float32 row by the check's own code gives the same figures; the same check on a row whose KL is
    off by 0.1% (or whose top-1 list is wrong) fails."""
    from pipeline.equivalence import matrix as m
    from pipeline.equivalence import variations as v
    ids, rec = _recorded(matrix_ws)
    rows = _rows(matrix_ws)
    s = v.Setup(_snapshot(matrix_ws), torch.bfloat16, torch.device("cpu"), "eager", CaptureSpec((), "all"),
                "native", False)
    recorded = v.Recorded(ids, list(range(len(ids))), {"logits": rec[None]}, ["logits"])
    cfg = type("Cfg", (), {"rederive": "float32"})()

    def verdict(row):
        return checks.rederived(m.Matrix(s, [[1]], 0, {"p": (recorded, [row])}, {}), cfg)[0]

    good = verdict(rows["float32"])
    assert good.passed and good.measured <= checks.TOLERANCE, good
    assert not verdict({**rows["float32"], "kl_mean": rows["float32"]["kl_mean"] * 1.001}).passed
    assert not verdict({**rows["float32"], "top1_changed": [3]}).passed
    assert not verdict({**rows["float32"], "max_abs_diff": rows["float32"]["max_abs_diff"] + 1e-6}).passed


def test_the_same_run_gives_the_same_bytes(matrix_ws, tmp_path):
    """No timing in the tables (the seconds are manifest facts): a second run writes the same files."""
    again = copy_ws(matrix_ws, tmp_path / "again")
    run_module("stages.equivalence", again, check=True)
    (pid,) = paths.prompt_ids(paths.EQUIVALENCE, matrix_ws)
    for path in (paths.partition(paths.EQUIVALENCE, pid), paths.partition(paths.VARIANT_LOGITS, pid),
                 paths.artifact(paths.EQUIVALENCE_CHECKS)):
        assert (again / path).read_bytes() == (matrix_ws / path).read_bytes(), path
    facts = json.loads((again / "artifacts/equivalence/manifest.json").read_text())["facts"]
    assert facts["variations"]["float32"]["seconds"] > 0 and facts["checks"] == 6


def test_an_exact_variation_that_is_not_exact_is_an_error():
    row = {"variation": "threads_1", "max_abs_diff": 0.0625, "mean_abs_diff": 1e-7, "top1_changed": [],
           "n_positions": 25, "kept_recorded": 438, "kept_variant": 438, "kept_jaccard": 1.0, "kl_mean": 1e-9,
           "kl_max": 1e-8, "bit_identical": False, "first_differing_tensor": "blocks.0.mlp_out", "note": ""}
    (c,) = checks.row_checks([row], exact=("threads_1",))
    assert c.severity == "error" and not c.passed and c.measured == 0.0625
    (same_values,) = checks.row_checks([{**row, "max_abs_diff": 0.0}], exact=("threads_1",))
    assert not same_values.passed          # equal values, other bits: still not exact
    (ok,) = checks.row_checks([{**row, "max_abs_diff": 0.0, "bit_identical": True}], exact=("threads_1",))
    assert ok.passed
    (found,) = checks.row_checks([row], exact=())
    assert found.severity == "report" and not found.passed
    assert replace(found, prompt_id="p").prompt_id == "p"


# ---------------------------------------------------------------- variant_logits.parquet (issue 30)
def _variant_file(ws: Path) -> Path:
    (pid,) = paths.prompt_ids(paths.VARIANT_LOGITS, ws)
    return paths.partition(paths.VARIANT_LOGITS, pid, ws)


def _next_token_figures(rec: np.ndarray, var: np.ndarray, positions: list[int]) -> dict:
    """The row's figures by this test's own code: numpy float64, top-p 0.9 by transformers' warper in float32."""
    from transformers import TopPLogitsWarper

    def logsoftmax(x):
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    def kept(row):
        return set(np.flatnonzero(np.isfinite(TopPLogitsWarper(0.9)(None, torch.from_numpy(row)[None])[0].numpy())))

    a, b = rec.astype(np.float64), var.astype(np.float64)
    lp, lq = logsoftmax(a), logsoftmax(b)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    ka, kb = kept(rec[-1].astype(np.float32)), kept(var[-1].astype(np.float32))
    return {"max_abs_diff": float(np.abs(a - b).max()), "mean_abs_diff": float(np.abs(a - b).mean()),
            "top1_changed": [p for p, x, y in zip(positions, a.argmax(-1), b.argmax(-1)) if x != y],
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "kl_last": float(kl[-1]),
            "kept_recorded": len(ka), "kept_variant": len(kb), "kept_jaccard": len(ka & kb) / len(ka | kb),
            "kept_recorded_ids": sorted(ka), "kept_variant_ids": sorted(kb)}


def _reproduces(row: dict, mine: dict):
    _same(row, mine)
    assert row["kl_last"] == pytest.approx(mine["kl_last"], rel=1e-9, abs=1e-15)
    assert (row["kept_recorded"], row["kept_variant"], row["kept_jaccard"]) == \
        (mine["kept_recorded"], mine["kept_variant"], mine["kept_jaccard"])
    assert (list(row["kept_recorded_ids"]), list(row["kept_variant_ids"])) == \
        (mine["kept_recorded_ids"], mine["kept_variant_ids"])


def test_the_stored_variant_logits_reproduce_every_row(matrix_ws):
    """variant_logits.parquet holds each forward variation's logits at every recorded position, lossless, in
    its own dtype; from them and the capture this test's own code gives the row's figures; recorded in the
    manifest with its sha256; no rows for the kv_cache variation (its step logits are the trajectories')."""
    from pipeline.store import provenance, variant_logits
    ids, rec = _recorded(matrix_ws)
    rows, path = _rows(matrix_ws), _variant_file(matrix_ws)
    stored = variant_logits.read(path)
    assert list(stored) == ["batch_2", "float32", "threads_1"]
    facts = json.loads((matrix_ws / "artifacts/equivalence/manifest.json").read_text())
    for name, (dtype, positions, logits) in stored.items():
        assert dtype == facts["facts"]["variations"][name]["dtype"]
        assert positions == list(range(len(ids))) and logits.dtype == np.float32
        _reproduces(rows[name], _next_token_figures(rec.float().numpy(), logits, positions))
    widened = stored["float32"][2].view(np.uint32)
    assert (widened & 0xFFFF).any() and not (stored["batch_2"][2].view(np.uint32) & 0xFFFF).any()  # f32 vs bf16
    (out,) = [o for o in facts["outputs"] if o["path"].endswith(paths.VARIANT_LOGITS[1])]
    assert out["sha256"] == provenance.sha256_file(path)


def test_a_tampered_or_malformed_variant_logits_file_is_caught(matrix_ws, tmp_path):
    """The float32 variant's top logit at the last position moved by one float32 ulp (the file rewritten in
    the stage's own layout): the recomputation no longer gives the row, and a later stage's read refuses
    the file (its sha256 is not the manifest's); a file missing a token id is refused by the reader."""
    import pyarrow as pa

    from pipeline.errors import UserError
    from pipeline.store import variant_logits
    from pipeline.store.artifacts import StageRun
    ws = copy_ws(matrix_ws, tmp_path / "ws")
    path = _variant_file(ws)
    stored = variant_logits.read(path)
    dtype, positions, f32 = stored["float32"]
    f32 = f32.copy()
    top = int(f32[-1].argmax())
    f32[-1, top] = np.nextafter(f32[-1, top], np.float32(np.inf))
    variant_logits.write(path, [(name, torch.from_numpy(f32 if name == "float32" else rows).to(getattr(torch, d)))
                                for name, (d, _, rows) in stored.items()], positions, pq.read_schema(path).metadata)
    _, rec = _recorded(ws)
    tampered = variant_logits.read(path, variation="float32")["float32"][2]
    assert np.array_equal(tampered, f32)
    with pytest.raises(AssertionError):
        _reproduces(_rows(ws)["float32"], _next_token_figures(rec.float().numpy(), tampered, positions))
    (pid,) = paths.prompt_ids(paths.VARIANT_LOGITS, ws)
    with pytest.raises(UserError, match="was not produced by the recorded run of stage equivalence"):
        StageRun("report", ws, {}).use(paths.VARIANT_LOGITS, pid)
    short = tmp_path / "short.parquet"      # one (variation, position) row group without token id 5
    ids = np.delete(np.arange(10, dtype=np.int32), 5)
    pq.write_table(pa.table({"variation": ["float32"] * 9, "dtype": ["float32"] * 9,
                             "position": pa.array(np.zeros(9, np.int32)), "token_id": pa.array(ids),
                             "logit": pa.array(np.ones(9, np.float32))}), short)
    with pytest.raises(UserError, match="every token id once, in order"):
        variant_logits.read(short)
