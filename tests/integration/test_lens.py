"""The lens stage on real toy models: tiny_qwen2 (the session's chain), capture.positions=last, and the
gpt2 and olmo2 families (`model=tiny model.source.family=X`), each with the lens checks passing."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.checks import lens as lens_checks
from pipeline.checks import suite
from pipeline.model import loader
from pipeline.store import paths
from pipeline.store.artifacts import read_json, read_safetensors
from tests.conftest import REPO, TEST_STEPS, copy_ws, make_workspace, run_module
from tests.helpers.inprocess import cwd, run_chain
from tests.helpers.partitions import part

CHECKS = ["lens_final_layer_exact", "lens_final_layer_kl", "lens_numpy_top1", "lens_numpy_recompute"]


def _lens_checks(ws):
    """The checks stage's lens checks on ws's one prompt (model loaded as the checks stage loads it)."""
    pid = paths.run_prompt_ids(ws)[0]
    stored = suite.load(paths.lookup(ws), ws, pid)
    source = read_json(paths.artifact(paths.SOURCE, ws))
    snapshot = loader.snapshot_dir(paths.stage_dir("prepare_model", ws), source)
    model = loader.load_model(snapshot, torch.bfloat16, "cpu", "eager", False)
    return lens_checks.run(stored, model, snapshot, "bfloat16")


def _tables(ws):
    return pd.read_parquet(part(paths.LENS, ws)), pd.read_parquet(part(paths.LENS_SUMMARY, ws))


def _assert_consistent(ws, n_layers: int, positions: list[int], top_k: int = 10):
    t, s = _tables(ws)
    capture = read_safetensors(part(paths.CAPTURE, ws))
    assert len(t) == (n_layers + 1) * len(positions) * top_k and len(s) == (n_layers + 1) * len(positions)
    assert sorted(t.layer.unique()) == list(range(n_layers + 1)) and sorted(t.position.unique()) == positions
    final = t[t.layer == n_layers]
    logits = capture["logits"][0].float()
    for r, p in enumerate(positions):           # layer L = the model's own logits, its top-k by torch
        rows = final[final.position == p]
        want = torch.argsort(logits[r], descending=True, stable=True)[:top_k]
        assert rows.token_id.tolist() == want.tolist() and rows.logit.tolist() == logits[r][want].tolist()
    assert (s[s.layer == n_layers].kl_final == 0).all() and (s[s.layer == n_layers].final_top1_rank == 1).all()
    assert np.isfinite(s[["entropy", "kl_final", "final_top1_prob"]].to_numpy()).all()
    checks = _lens_checks(ws)
    assert [c.name for c in checks] == CHECKS and all(c.passed for c in checks), \
        [(c.name, c.measured, c.detail) for c in checks]
    return t, s


def test_tiny_qwen2_lens(tiny_chain):
    t, s = _assert_consistent(tiny_chain, 2, list(range(25)))
    # probabilities are FP64 over the full output size: the top-k rows never sum past 1
    assert (t.groupby(["layer", "position"]).prob.sum() <= 1 + 1e-12).all()
    manifest = read_json(paths.manifest_path("lens", tiny_chain))
    assert manifest["facts"]["layer0"] == "blocks.0.resid_pre" and manifest["config"]["lens"] == {"top_k": 10}


def test_positions_last_has_one_position_from_a_full_length_final_norm(tiny_workspace, tmp_path):
    ws = copy_ws(tiny_workspace, tmp_path / "ws")
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "model=tiny_qwen2", "capture.device=cpu",
               "capture.positions=last", "lens.top_k=3", check=True)
    run_chain(ws, ("forward", "lens"))
    capture = read_safetensors(part(paths.CAPTURE, ws))
    # what is stored: the residuals and the final norm's output at every position, logits at the last only
    assert capture["final_norm_out"].shape[1] == 25 and capture["blocks.1.resid_post"].shape[1] == 25
    assert capture["logits"].shape[1] == 1
    _assert_consistent(ws, 2, [24], top_k=3)


@pytest.mark.parametrize("family", ["gpt2", "olmo2"])
def test_family_lens(family, tmp_path):
    ws = make_workspace(tmp_path / "ws", ["model=tiny", f"model.source.family={family}"])
    shutil.copytree(REPO / "prompts", ws / "prompts")
    with cwd(ws):
        run_chain(ws, ("validate", "prepare_model", "tokenize", "forward", "lens"))
    n = read_json(part(paths.FORWARD_FACTS, ws))["num_layers"]
    _assert_consistent(ws, n, list(range(25)))
    if family == "gpt2":        # layer 0 is the residual stream itself: embed + the position embeddings
        capture = read_safetensors(part(paths.CAPTURE, ws))
        assert not torch.equal(capture["blocks.0.resid_pre"], capture["embed"])
