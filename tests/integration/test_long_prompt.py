"""A 4096-token prompt through the whole chain (forward -> report, checks included) on tiny_qwen2,
all positions captured: every stage's peak memory stays a small multiple of one float32 [T, V].

Each stage runs as DVC runs it (a fresh `python -m stages.<name>`) and reports its own peak RSS
(`tests/helpers/stage_peak.py`; wait4's would include this pytest process's size). The bound is
generous on purpose (the tight figures, per stage and above the loaded model, are the bench's:
`nexttoken bench --only scale`):
before streaming, the logits stage alone held ~9.5 float32 copies of [T, V] (~24 GB here).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pipeline.store import paths
from tests.conftest import make_workspace
from tests.helpers import stage_peak
from tests.helpers.partitions import part

T_TARGET = 4096
STAGES = ("tokenize", "forward", "logits", "probs", "trajectories", "checks", "report")
BASE_MB = 1500          # interpreter, torch, transformers and the tiny model
BOUND_X = 3.0           # x 4*T*V bytes on top: generous (the bench's target is 2.5 above the loaded model)


def _peak_mb(stage: str, ws) -> float:
    """Run one stage in a fresh interpreter; its exit status must be 0; its own peak RSS in MB."""
    log = ws / f".{stage}.log"
    out = stage_peak.run(f"stages.{stage}", ws, {**os.environ, "TQDM_DISABLE": "1"}, log)
    assert out["rc"] == 0, f"{stage} failed ({out['rc']}):\n{log.read_text()[-3000:]}"
    return out["peak_mb"]


@pytest.mark.slow
def test_whole_chain_at_4096_tokens_all_positions_stays_bounded(tiny_workspace, tmp_path):
    ws = tmp_path / "ws"
    (ws / "prompts").mkdir(parents=True)
    # The reference prompt (25 tokens) repeated to just over T_TARGET tokens.
    text = json.loads(part(paths.TOKENIZE_SUMMARY, tiny_workspace).read_text())["prompt"]
    (ws / "prompts/long.txt").write_text(text * (T_TARGET // 24 + 1), encoding="utf-8")
    make_workspace(ws, ["model=tiny_qwen2", "prompt.file=prompts/long.txt", "prompt.text=null",
                        "capture.positions=all"])
    shutil.copytree(paths.stage_dir("prepare_model", tiny_workspace), paths.stage_dir("prepare_model", ws))
    peaks = {stage: _peak_mb(stage, ws) for stage in STAGES}
    facts = json.loads(part(paths.FORWARD_FACTS, ws).read_text())
    t, v = facts["n_positions"], facts["output_size"]
    assert t >= T_TARGET and facts["logit_positions"] == list(range(t))
    one_copy_mb = 4 * t * v / 2**20
    over = {s: round(p) for s, p in peaks.items() if p > BASE_MB + BOUND_X * one_copy_mb}
    assert not over, (f"peak RSS (MB) above {BASE_MB} + {BOUND_X} x 4*T*V ({one_copy_mb:.0f} MB), T={t}: {over}; "
                      f"all: { {s: round(p) for s, p in peaks.items()} }")
    checks = json.loads(paths.artifact(paths.METRICS, ws).read_text())
    assert checks["failed_error"] == 0, checks
