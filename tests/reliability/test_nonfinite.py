"""Non-finite numbers: a tiny_qwen2 with a poisoned weight makes NaN / Inf logits.

The forward and logits stages record what the model computed (NaN included: it is the
finding); the probs and trajectories stages stop with one line naming the positions and
ids, and keep their previous outputs. What the checks stage does with such a run is
recorded by the last tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.store import paths
from tests.conftest import copy_ws, snapshot
from tests.helpers.partitions import part
from tests.reliability.conftest import one_line_error, rewrite_weights, run_stage_here, staging_left

POISONED_ID = 100          # one vocabulary row of the LM head
LAST = 24                  # the prompt has 25 tokens


def poison(ws: Path, how: str) -> None:
    """Change one weight of the prepared model (see `rewrite_weights`)."""
    def edit(tensors: dict) -> None:
        if how == "nan_lm_head_row":
            tensors["lm_head.weight"][POISONED_ID] = float("nan")
        else:                                               # inf in the final norm: every logit breaks
            tensors["model.norm.weight"][0] = float("inf")
    rewrite_weights(ws, edit)


@pytest.fixture(scope="module", params=["nan_lm_head_row", "inf_final_norm"])
def poisoned(request, chain_ws, tmp_path_factory) -> Path:
    """A complete clean run, then the poisoned model through forward and logits (which succeed)."""
    ws = copy_ws(chain_ws, tmp_path_factory.mktemp("poisoned") / request.param)
    poison(ws, request.param)
    shutil.rmtree(ws / "artifacts/lens")     # the clean run's lens is of the old model (the checks refuse it)
    mp = pytest.MonkeyPatch()
    try:
        for stage in ("forward", "logits"):
            out = run_stage_here(stage, ws, mp)
            assert out.code == 0, out.stderr
    finally:
        mp.undo()
    return ws


def test_forward_records_the_nonfinite_logits(poisoned):
    logits = load_file(str(part(paths.CAPTURE, poisoned)))["logits"][0]
    assert not torch.isfinite(logits).all()
    if poisoned.name == "nan_lm_head_row":
        assert torch.isnan(logits[:, POISONED_ID]).all() and torch.isfinite(logits[:, :POISONED_ID]).all()


def test_probs_stops_naming_the_position(poisoned, monkeypatch):
    before = snapshot(poisoned)
    line = one_line_error(run_stage_here("probs", poisoned, monkeypatch), "nexttoken probs: error: ",
                          f"logits at position {LAST} are not finite for ", "NaN/Inf")
    if poisoned.name == "nan_lm_head_row":
        assert f"for 1 ids (first: [{POISONED_ID}])" in line
    assert snapshot(poisoned) == before and staging_left(poisoned) == []


def test_trajectories_stop_naming_the_step_and_position(poisoned, monkeypatch):
    before = snapshot(poisoned)
    line = one_line_error(run_stage_here("trajectories", poisoned, monkeypatch), "nexttoken trajectories: error: ",
                          f"step 1: logits at position {LAST} are not finite for ", "no token chosen")
    if poisoned.name == "nan_lm_head_row":
        assert f"(first: [{POISONED_ID}])" in line
    assert snapshot(poisoned) == before and staging_left(poisoned) == []


def test_checks_stage_records_nonfinite_logits(poisoned, tmp_path, monkeypatch):
    """As DVC leaves it: probs and trajectories failed, so their outputs are gone.

    The checks stage still runs what it can: `logits_finite` fails naming the position (and
    the poisoned id), each missing stage is one failed `<stage>_outputs` check, every check
    that reads only forward/logits runs (a reproduced NaN is reproduced), and the stage writes
    its results and exits 1 naming the failed error checks.
    """
    ws = copy_ws(poisoned, tmp_path / "ws")
    for stage in ("probs", "trajectories"):
        shutil.rmtree(paths.stage_dir(stage, ws))
    out = run_stage_here("checks", ws, monkeypatch)
    assert out.code == 1, out.stderr
    import pyarrow.parquet as pq
    rows = {r["name"]: r for r in pq.read_table(ws / "artifacts/checks/checks.parquet").to_pylist()}
    finite = rows["logits_finite"]
    assert finite["verdict"] == "fail" and finite["severity"] == "error" and finite["measured"] > 0
    assert finite["detail"].startswith(f"positions 0-{LAST} ({LAST + 1} of {LAST + 1}); ")
    if poisoned.name == "nan_lm_head_row":
        assert finite["measured"] == 25 and f"(first: [{POISONED_ID}])" in finite["detail"]   # one id, 25 positions
    for stage in ("probs", "trajectories"):
        missing = rows[f"{stage}_outputs"]
        assert missing["verdict"] == "fail" and "did not complete" in missing["detail"]
    assert not any(n.startswith(("probs_table", "filtered_", "step1_", "kv_cache_", "generate_parity"))
                   for n in rows)
    for name in ("capture_input_ids", "logits_file_exact", "lm_head_recompute", "capture_transparent",
                 "repeat_deterministic", "tokenizer_retokenize"):
        assert rows[name]["verdict"] == "pass", rows[name]
    failed_line = out.stderr.strip().splitlines()[-1]
    assert "logits_finite" in failed_line and "probs_outputs" in failed_line
    manifest = json.loads(paths.manifest_path("checks", ws).read_text())
    assert manifest["facts"]["missing_stages"] == ["probs", "trajectories"]


def test_checks_stage_refuses_a_partial_stage_folder(poisoned, tmp_path, monkeypatch):
    """Only a whole missing stage folder is a stopped stage; a folder with a file gone is damage."""
    ws = copy_ws(poisoned, tmp_path / "ws")
    shutil.rmtree(paths.stage_dir("trajectories", ws))
    for f in paths.stage_dir("probs", ws).iterdir():
        if f != paths.dataset(paths.TABLE, ws):        # the table's partitions stay, the rest goes
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    out = run_stage_here("checks", ws, monkeypatch)
    one_line_error(out, "nexttoken checks: error: ", "artifacts/probs/")
    assert not paths.stage_dir("checks", ws).exists()
