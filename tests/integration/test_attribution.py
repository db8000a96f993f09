"""The attribution stage on real toy models: tiny_qwen2 (the session's chain: both tables read back with
pandas, the logit recomputed here in numpy from the capture and the snapshot's weights, the checks), two
mutants of the fold failing the stage's sum check, and a family the split is not written for (gpt2:
recorded as not applicable, empty tables, the run goes on)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.numpy import load_file

from pipeline.model import input_attribution
from pipeline.numerics import logit_parts as lp
from pipeline.store import paths
from pipeline.store.artifacts import read_json, read_manifest, read_safetensors
from tests.conftest import copy_ws, make_workspace, run_module
from tests.helpers.inprocess import run_chain
from tests.helpers.partitions import part

PARTS_COLUMNS = ["position", "token_id", "component", "layer", "head", "contribution", "logit", "logit_fp64",
                 "bound"]
INPUTS_COLUMNS = ["target_position", "target_token_id", "source_position", "method", "attribution", "logit_input",
                  "logit_baseline"]
ERROR_CHECKS = {"attribution_logit_parts_sum", "attribution_residual_sum", "attribution_capture_exact"}


def _checks(ws) -> pd.DataFrame:
    return pd.read_parquet(paths.artifact(paths.ATTRIBUTION_CHECKS, ws)).set_index("name")


def _config(ws) -> dict:
    return json.loads((paths.stage_dir("prepare_model", ws) / "config.json").read_text())


@pytest.fixture(scope="module")
def attributed(tiny_chain, tmp_path_factory):
    """A copy of the session's tiny_qwen2 chain with the attribution stage run (read-only)."""
    ws = copy_ws(tiny_chain, tmp_path_factory.mktemp("attribution") / "ws")
    run_chain(ws, ("attribution",))
    return ws


def test_tiny_qwen2_attribution(attributed):
    ws, cfg = attributed, _config(attributed)
    parts_ = pd.read_parquet(part(paths.LOGIT_PARTS, ws))
    inputs = pd.read_parquet(part(paths.INPUTS, ws))
    assert list(parts_.columns) == PARTS_COLUMNS and list(inputs.columns) == INPUTS_COLUMNS
    tokens = pd.read_parquet(part(paths.TOKENS, ws))
    last = len(tokens) - 1
    capture = read_safetensors(part(paths.CAPTURE, ws))
    logits = capture["logits"][0, -1].double().numpy()
    # the top-5 candidates of the captured logits (logit descending, ties by lower id), ranked here by numpy
    want = np.lexsort((np.arange(logits.size), -logits))[:5].tolist()
    assert (parts_.position == last).all() and parts_.token_id.unique().tolist() == want
    n_layers, n_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    per = parts_.groupby("token_id", sort=False)
    assert (per.size() == 1 + n_layers * (n_heads + 1)).all()           # embed, every head, every MLP
    one = parts_[parts_.token_id == want[0]]
    assert one.component.iloc[0] == "embed" and one.component.iloc[-1] == f"blocks.{n_layers - 1}.mlp"
    assert one["head"].notna().sum() == n_layers * n_heads and one["layer"].isna().sum() == 1
    # the logit recomputed here, in numpy FP64, from the captured LM-head input and the snapshot's head
    head = load_file(paths.stage_dir("prepare_model", ws) / "model.safetensors")["lm_head.weight"]
    h = capture["final_norm_out"][0, last].double().numpy()
    # the head as the model ran it: the snapshot's float32 weights rounded to the capture's dtype (bf16)
    rows = torch.from_numpy(head[want]).to(capture["final_norm_out"].dtype).double().numpy()
    mine = rows @ h
    stored = per[["logit", "logit_fp64", "bound"]].first().loc[want]
    np.testing.assert_allclose(stored.logit_fp64.to_numpy(), mine, rtol=1e-12, atol=1e-12)
    assert stored.logit.tolist() == logits[want].tolist()              # the model's own logits, as captured
    total = per["contribution"].sum().loc[want].to_numpy()
    assert (np.abs(total - mine) <= stored.bound.to_numpy()).all()
    assert (stored.bound < np.abs(mine).max()).all()                   # a bound that can fail
    # input attribution: the top-1, every prompt position, both methods
    assert (inputs.target_position == last).all() and (inputs.target_token_id == want[0]).all()
    for method in input_attribution.METHODS:
        assert inputs[inputs.method == method].source_position.tolist() == list(range(last + 1))
    # the checks: the error ones pass; completeness is reported with its stated bound
    checks = _checks(ws)
    assert set(checks.index) >= ERROR_CHECKS
    assert (checks.loc[sorted(ERROR_CHECKS)].severity == "error").all()
    assert (checks.loc[sorted(ERROR_CHECKS)].verdict == "pass").all(), checks.detail.to_dict()
    ig = checks.loc["attribution_ig_completeness"]
    assert ig.severity == "report" and ig.tolerance == input_attribution.COMPLETENESS_REL
    ig_rows = inputs[inputs.method == "integrated_gradients"]
    difference = ig_rows.logit_input.iloc[0] - ig_rows.logit_baseline.iloc[0]
    assert ig.measured == pytest.approx(abs(ig_rows.attribution.sum() - difference) / abs(difference), rel=1e-9)
    facts = read_manifest("attribution", ws)["facts"]
    assert facts["logit_parts"] == "recorded" and facts["candidates"] == want and facts["top_k"] == 5


def _gemma_gain(weight, formula):                   # Gemma's norm formula (1 + w) on a Qwen norm: a wrong gain
    return 1.0 + weight.double()


def _unfrozen(parts_, scale, gain, rows):          # each part normalised by its own rms, not the stream's
    own = torch.sqrt((parts_ * parts_).mean(-1, keepdim=True) + 1e-6)
    return parts_ / own * gain @ rows.double().T


# Forgetting the norm's weight is no error on tiny_qwen2, whose norm weights are all 1 (a gain of 1): that
# mutant fails on toys with their norms moved away from 1 (tests/unit/test_logit_parts.py). Here, a wrong gain.
@pytest.mark.parametrize("name,mutant", [("norm_gain", _gemma_gain), ("fold", _unfrozen)],
                         ids=["wrong_norm_gain", "unfrozen_scale"])
def test_mutants_fail_the_stage(name, mutant, attributed, tmp_path, monkeypatch):
    ws = copy_ws(attributed, tmp_path / "ws")
    monkeypatch.setattr(lp, name, mutant)
    with pytest.raises(SystemExit) as exit_:
        run_chain(ws, ("attribution",))
    assert exit_.value.code == 1
    checks = _checks(ws)        # written before the stage failed
    assert checks.loc["attribution_logit_parts_sum"].verdict == "fail"
    assert checks.loc["attribution_residual_sum"].verdict == "pass"      # the stream is right: the fold is wrong


def test_a_family_the_split_does_not_apply_to_is_recorded_not_failed(tmp_path):
    ws = make_workspace(tmp_path / "ws", ["model=tiny", "model.source.family=gpt2"])
    run_chain(ws, ("prepare_model", "tokenize", "forward", "attribution"))
    parts_ = pd.read_parquet(part(paths.LOGIT_PARTS, ws))
    assert parts_.empty and list(parts_.columns) == PARTS_COLUMNS
    facts = read_manifest("attribution", ws)["facts"]
    assert facts["logit_parts"].startswith("not applicable: model_type 'gpt2' has ")
    checks = _checks(ws)
    assert (checks.severity == "report").all() and set(checks.index) == ERROR_CHECKS | {"attribution_ig_completeness"}
    inputs = pd.read_parquet(part(paths.INPUTS, ws))       # the input attribution applies to any family
    logits = read_safetensors(part(paths.CAPTURE, ws))["logits"][0, -1]
    assert (inputs.target_token_id == int(torch.argmax(logits))).all() and len(inputs) > 0


def test_an_unknown_prompt_is_named_before_any_work(attributed, tmp_path):
    ws = copy_ws(attributed, tmp_path / "ws")
    params = (ws / paths.PARAMS).read_text()
    (ws / paths.PARAMS).write_text(params.replace("attribution:\n  top_k: 5\n  ig_steps: 32\n  prompts: null",
                                                  "attribution:\n  top_k: 5\n  ig_steps: 32\n  prompts: [nope]"))
    before = read_json(paths.manifest_path("attribution", ws))
    proc = run_module("stages.attribution", ws)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "attribution.prompts='nope' is not allowed: null or a list of the run's prompt ids: " \
        in lines[0], proc.stderr
    assert read_json(paths.manifest_path("attribution", ws)) == before


def test_a_set_attributes_the_chosen_prompts_only(tmp_path):
    """Default: the report's detailed prompt (the first id); `attribution.prompts` another choice, each prompt's
    tables the same as when it was chosen alone."""
    ws = make_workspace(tmp_path / "ws", ["model=tiny_qwen2"])
    (ws / "prompts").mkdir()
    lines = [{"id": "b_second", "text": "The capital of France is"}, {"id": "a_first", "text": "Once upon a time"}]
    (ws / "prompts/two.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    compose = ("pipeline.tools.cli", ws, "compose", "model=tiny_qwen2", "capture.device=cpu", "--prompt-set",
               "prompts/two.jsonl")
    run_module(*compose, check=True)
    run_chain(ws, ("prepare_model", "tokenize", "forward", "attribution"))
    assert paths.prompt_ids(paths.LOGIT_PARTS, ws) == ["a_first"] == paths.prompt_ids(paths.INPUTS, ws)
    alone = pd.read_parquet(paths.partition(paths.LOGIT_PARTS, "a_first", ws))
    run_module(*compose, "attribution.prompts=[b_second,a_first]", check=True)
    run_chain(ws, ("attribution",))
    assert paths.prompt_ids(paths.LOGIT_PARTS, ws) == ["a_first", "b_second"]
    pd.testing.assert_frame_equal(pd.read_parquet(paths.partition(paths.LOGIT_PARTS, "a_first", ws)), alone)
    assert set(_checks(ws).prompt_id) == {"a_first", "b_second"}
