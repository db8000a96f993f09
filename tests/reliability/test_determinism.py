"""Determinism of the written bytes (the runs themselves are compared in test_dvc_faults.py, slow).

safetensors writes a file's `__metadata__` from a Rust HashMap, in an order that changes
from one call to the next: the same capture saved twice could differ in its bytes (and so
in its sha256 and DVC hash). The capture writer sorts the header's metadata.
"""

from __future__ import annotations

import torch

from pipeline.model import forward
from pipeline.store import provenance


def test_the_same_capture_is_written_to_the_same_bytes(tmp_path):
    result = forward.ForwardResult({"embed": torch.arange(12, dtype=torch.bfloat16).reshape(1, 3, 4),
                                    "logits": torch.linspace(-1, 1, 30).reshape(1, 3, 10).bfloat16(),
                                    "input_ids": torch.tensor([[1, 2, 3]])}, {})
    hashes = set()
    for i in range(12):               # with HashMap order, 12 identical writes in a row: p < 1e-3
        forward.save_capture(result, tmp_path / f"c{i}.safetensors")
        hashes.add(provenance.sha256_file(tmp_path / f"c{i}.safetensors"))
    assert len(hashes) == 1
    from safetensors.torch import load_file
    back = load_file(str(tmp_path / "c0.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in result.tensors.items())
