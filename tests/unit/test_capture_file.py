"""capture.safetensors written streamed and read without torch.

`forward.save_capture` now lets safetensors stream each tensor from its storage and then
sorts the header's metadata in place; the file must be byte for byte what the old writer
(the whole file built in memory by `safetensors.torch.save`, header re-serialised) wrote.
The torch-free reader (`store.safetensors_io`, `model.capture_file`) must give the values
safetensors' own loader gives, and name a truncated or foreign file.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save

from pipeline.errors import UserError
from pipeline.model import forward
from pipeline.model.capture import CaptureSpec, run_capture
from pipeline.model.capture_file import CapturedLogits
from pipeline.store import safetensors_io
from tests.unit.test_capture import _build


def _old_capture_bytes(result: forward.ForwardResult) -> bytes:
    """What save_capture wrote before it streamed (its code at 4de4265, verbatim but for names)."""
    meta = {"format": "nexttoken-capture", "names": json.dumps(list(result.tensors))}
    data = memoryview(save({k: v.contiguous() for k, v in result.tensors.items()}, metadata=meta))
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(bytes(data[8:8 + n]))
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data[8 + n:])


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def captured(request) -> forward.ForwardResult:
    """A real capture (bf16 activations, float attention mask, int64 ids) and one of every other dtype."""
    model = _build(request.param, torch.bfloat16)
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(3))
    tensors = run_capture(model, ids, CaptureSpec((0, -1), "all"))
    extra = {"x_f32": torch.randn(3, 5), "x_f16": torch.randn(2, 3).half(), "x_bool": torch.tensor([True, False]),
             "x_i32": torch.tensor([1, -2], dtype=torch.int32), "x_scalar": torch.tensor(2.5),
             "x_empty": torch.ones(0, 4)}
    return forward.ForwardResult({**tensors, **extra, "input_ids": ids}, {})


def test_streamed_capture_is_the_bytes_the_in_memory_writer_wrote(captured, tmp_path):
    path = tmp_path / "capture.safetensors"
    forward.save_capture(captured, path)
    assert path.read_bytes() == _old_capture_bytes(captured)


def test_the_torch_free_reader_gives_safetensors_values(captured, tmp_path):
    path = tmp_path / "capture.safetensors"
    forward.save_capture(captured, path)
    want = load_file(str(path))
    tensors, meta = safetensors_io.header(path)
    assert set(tensors) == set(want) and json.loads(meta["names"]) == list(captured.tensors)
    for name, t in want.items():
        got = safetensors_io.read(path, name)
        ref = t.float().numpy() if t.is_floating_point() else t.numpy()
        assert got.dtype == ref.dtype and np.array_equal(got, ref, equal_nan=True), name
        if t.ndim:
            rows = list(safetensors_io.rows(path, name))
            assert len(rows) == ref.reshape(-1, t.shape[-1]).shape[0]
            assert all(np.array_equal(r, e) for r, e in zip(rows, ref.reshape(-1, t.shape[-1])))
    raw = want["logits"].contiguous().view(torch.uint8).numpy().tobytes()
    import hashlib
    assert safetensors_io.sha256(path, "logits") == hashlib.sha256(raw).hexdigest()


def _facts(result: forward.ForwardResult) -> dict:
    logits, ids = result.tensors["logits"], result.tensors["input_ids"]
    return {"input_ids": ids[0].tolist(), "names": {"logits": {"shape": list(logits.shape)}},
            "logit_positions": list(range(ids.shape[1])), "compute_dtype": "bfloat16", "device": "cpu",
            "output_size": logits.shape[-1], "n_positions": ids.shape[1], "tokenizer_len": 990}


def test_captured_logits_rows_and_refusals(captured, tmp_path):
    path = tmp_path / "capture.safetensors"
    forward.save_capture(captured, path)
    facts = _facts(captured)
    logits = CapturedLogits.open(path, facts)
    rows = list(logits.rows())
    assert [p for p, _ in rows] == facts["logit_positions"]
    assert all(np.array_equal(r, e) for (_, r), e in zip(rows, captured.tensors["logits"][0].float().numpy()))
    with pytest.raises(UserError, match="come from different runs"):
        CapturedLogits.open(path, {**facts, "input_ids": facts["input_ids"][:-1] + [5]})
    with pytest.raises(UserError, match="logit rows but facts.json lists"):
        CapturedLogits.open(path, {**facts, "logit_positions": [0]})
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match="cut.safetensors is not a readable safetensors file .*the file has"):
        CapturedLogits.open(cut, facts)
    for bad in (b"\x08\x00\x00\x00", b"\xff" * 8 + b"{}", b"\x02\x00\x00\x00\x00\x00\x00\x00[]"):
        cut.write_bytes(bad)
        with pytest.raises(UserError, match="not a readable safetensors file"):
            safetensors_io.header(cut)
