"""The forward stage refuses a pass that cannot fit before it loads the model: one line naming the
figure and what to change, exit status 2, nothing written (pipeline/model/memory.py)."""

from __future__ import annotations

from pipeline.model import loader, memory
from tests.conftest import copy_ws, snapshot
from tests.reliability.conftest import one_line_error, run_stage_here


def test_forward_refuses_before_loading_when_the_device_is_short_of_memory(tiny_workspace, tmp_path, monkeypatch):
    ws = copy_ws(tiny_workspace, tmp_path / "ws")
    before, loads = snapshot(ws), []
    need = 45 * 2**20         # tiny_qwen2 at 25 tokens on the CPU: 39 MB of weights + the capture (7.3 MB) + work
    monkeypatch.setattr(memory, "free_bytes", lambda device, spread=False: 20 * 2**20)
    monkeypatch.setattr(loader, "load_model", lambda *args, **kwargs: loads.append(args))
    line = one_line_error(run_stage_here("forward", ws, monkeypatch),
                          "nexttoken forward: error: not enough memory for the forward pass of this 25-token prompt",
                          "on cpu (weights 0.04", "but 0.02 GiB are free: use capture.positions=last",
                          "fewer capture.attention_layers", "a shorter prompt")
    assert float(line.split("it needs about ")[1].split()[0]) * 2**30 < need
    assert loads == [] and snapshot(ws) == before and not (ws / "artifacts/forward").exists()
