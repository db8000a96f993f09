"""pipeline.model.memory: the peak-memory estimate of a forward pass and the refusal before it.

The capture part is exact (it names the very tensors `run_capture` keeps), so it is held to
a real capture of tiny_qwen2 to the byte; the attention part is held to the hand-computed
figure of the issue (Qwen2.5-7B: heads * T^2 * 12 bytes in bf16), on its config alone.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import UserError
from pipeline.model import capture, loader, memory
from pipeline.store import paths
from tests.helpers.partitions import part

GIB = 2**30
# Qwen2.5-7B's config.json (the fields the estimate reads) and its weights in bf16 (7,615,616,512 parameters).
QWEN_7B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "vocab_size": 152064, "max_position_embeddings": 131072}
QWEN_7B_WEIGHTS = 7_615_616_512 * 2


@pytest.fixture(scope="module")
def snapshot(tiny_workspace):
    return tiny_workspace / "artifacts/prepare_model"


@pytest.fixture(scope="module")
def model(snapshot):
    return loader.load_model(snapshot, torch.bfloat16, "cpu", "eager", False)


@pytest.fixture(scope="module")
def ids(tiny_workspace) -> torch.Tensor:
    return torch.tensor([pq.read_table(part(paths.TOKENS, tiny_workspace))["token_id"].to_pylist()])


@pytest.mark.parametrize("layers, positions", [((0, -1), "all"), ((), "last"), ((1,), "last")])
def test_the_capture_estimate_is_the_capture_to_the_byte(snapshot, model, ids, layers, positions):
    spec = capture.CaptureSpec(attention_layers=layers, positions=positions)
    got = capture.run_capture(model, ids, spec)
    need = memory.estimate(snapshot, torch.bfloat16, ids.shape[1], spec)
    assert need.captured == sum(t.nbytes for t in got.values()) + ids.nbytes     # + input_ids, stored beside
    assert need.attention_captured == sum(t.nbytes for k, t in got.items() if k.endswith("attn_weights"))
    assert need.logits == got["logits"].nbytes and need.weights == sum(p.nbytes for p in model.parameters())
    # on the CPU the capture is the model's own tensors, kept: it adds to the device's share
    cpu = torch.device("cpu")
    assert need.on_device(cpu) == need.weights + need.attention + need.activations + need.captured
    assert need.on_device(torch.device("cuda")) == need.weights + need.attention + need.activations + need.logits


@pytest.fixture
def qwen_7b(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    monkeypatch.setattr(loader, "weights_bytes", lambda path, dtype: QWEN_7B_WEIGHTS)
    return tmp_path


def test_qwen2_5_7b_on_one_h200_is_refused_at_20k_tokens_naming_what_to_change(qwen_7b):
    spec = capture.CaptureSpec(attention_layers=(0, -1), positions="all")
    need = memory.estimate(qwen_7b, torch.bfloat16, 20_000, spec)
    assert need.attention == 28 * 20_000**2 * 12 + 20_000**2 * 2          # eager scores .. cast back, + the mask
    assert need.logits == 20_000 * 152064 * 2
    h200 = lambda place, spread: (139 if place.type == "cuda" else 500) * GIB
    with pytest.raises(UserError) as err:
        memory.guard(need, torch.device("cuda"), free=h200)
    line = str(err.value)
    assert "\n" not in line and line.startswith("not enough memory for the forward pass of this 20000-token prompt")
    assert "about 148.42 GiB on cuda" in line and "139.00 GiB are free" in line
    assert "(eager attention of one layer (28 heads x 20000^2) 125.91, weights 14.19, logits 5.66" in line
    assert line.endswith("use capture.positions=last (logits: 1 row instead of 20000), or a shorter prompt "
                         "(attention grows with its square)")
    # 16k tokens with logits for the last position only fit the GPU ...
    last = memory.estimate(qwen_7b, torch.bfloat16, 16_000, capture.CaptureSpec((0, -1), "last"))
    memory.guard(last, torch.device("cuda"), free=h200)
    # ... but not what the capture keeps (2 layers' attention weights, 28 layers' residual stream) in 32 GiB of RAM;
    # the weights pass through the CPU first (loaded there, then moved): 14 GiB of RAM are too few for them
    with pytest.raises(UserError, match=r"about 14\.19 GiB on cpu \(weights while loading 14\.19, capture 1\.08\) "
                                        r".* or capture\.device=multi \(accelerate loads the weights straight onto "):
        memory.guard(memory.estimate(qwen_7b, torch.bfloat16, 1000, capture.CaptureSpec((0, -1), "last")),
                     torch.device("cuda"), free=lambda place, spread: (139 if place.type == "cuda" else 14) * GIB)
    with pytest.raises(UserError) as err:
        memory.guard(last, torch.device("cuda"), free=lambda place, spread: (139 if place.type == "cuda" else 32) * GIB)
    assert str(err.value).endswith("it needs about 42.82 GiB on cpu (capture 42.82, weights while loading 14.19) but "
                                   "32.00 GiB are free: use fewer "
                                   "capture.attention_layers (their weights: 26.70 GiB), or a shorter prompt "
                                   "(attention grows with its square)")


def test_free_memory_is_asked_of_the_device():
    import psutil
    assert abs(memory.free_bytes(torch.device("cpu")) - psutil.virtual_memory().available) < 512 * 2**20
