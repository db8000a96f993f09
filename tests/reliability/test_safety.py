"""Safety: no code from untrusted places, no pickle, no path out of the repository, no surprise download.

- trust_remote_code is false in every model config, true only when a config says so, and the
  manifests of prepare_model and forward record the value used;
- no pickle is ever loaded: the code never calls a pickle loader, models load from
  safetensors only (a snapshot holding only a pickle is refused), and no prepared snapshot
  holds a pickle file;
- a path in the config that leaves the repository is refused (prompt.file, a local
  model.source.hub_id, symlinks included; model.reference_figures is a plain name);
- with HF_HUB_OFFLINE unset and no network, preparing tiny_qwen2 never calls the hub, and a
  hub model is looked up in the local cache only unless NEXTTOKEN_ALLOW_DOWNLOAD=1.
"""

from __future__ import annotations

import ast
import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import schema
from pipeline.errors import UserError
from pipeline.model import loader, sources
from pipeline.store import paths
from tests.conftest import REPO, make_workspace
from tests.helpers import conf, validated
from tests.reliability.conftest import python_env

CODE = sorted([*(REPO / "pipeline").rglob("*.py"), *(REPO / "stages").glob("*.py")])
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".msgpack", ".h5", ".joblib", ".npy"}


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
            yield node, name, owner, {k.arg: k.value for k in node.keywords}


def _hub(hub_id: str, **more) -> schema.SourceConfig:
    return schema.parse(schema.SourceConfig, {"kind": "hub", "hub_id": hub_id, **more}, "model.source")


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


# ---------------------------------------------------------------- trust_remote_code
def test_trust_remote_code_is_off_in_every_model_config():
    for path in sorted((REPO / "conf/model").glob("*.yaml")):
        assert conf.option("model", path.stem)["trust_remote_code"] is False, path.name
    assert schema.ModelConfig.model_fields["trust_remote_code"].default is False


def test_code_never_turns_trust_remote_code_on_by_itself():
    found = [f"{p.name}:{node.lineno}" for p in CODE for node, name, _, kw in _calls(p)
             if "trust_remote_code" in kw and _is_true(kw["trust_remote_code"])]
    assert found == []
    for fn in (loader.load_tokenizer, loader.max_positions, loader.num_layers):
        assert fn.__defaults__[-1] is False, fn.__name__


# ---------------------------------------------------------------- pickle
# The one pickle load allowed, and why: a Ray actor unpickles the PromptWork its own stage process pickled (paths
# and configs, `pipeline.executor.cluster.Worker`), after it has pinned the kernels; the bytes travel inside Ray,
# which unpickles everything it carries anyway, and never come from a file or a model.
ALLOWED_PICKLE = {"cluster.py: pickle.loads("}


def test_no_pickle_loader_in_the_code():
    bad = []
    for p in CODE:
        text = p.read_text(encoding="utf-8")
        for pattern in (r"\bpickle\.loads?\(", r"\bcloudpickle\b", r"\bdill\.load", r"\bjoblib\.load\(",
                        r"\bread_pickle\(", r"allow_pickle\s*=\s*True", r"use_safetensors\s*=\s*False",
                        r"weights_only\s*=\s*False"):
            bad += [f"{p.name}: {m.group()}" for m in re.finditer(pattern, text)]
        for node, name, owner, kw in _calls(p):
            if name == "load" and owner == "torch" and not _is_true(kw.get("weights_only")):
                bad.append(f"{p.name}:{node.lineno}: torch.load without weights_only=True")
    assert [b for b in bad if b not in ALLOWED_PICKLE] == []
    cluster = (REPO / "pipeline/executor/cluster.py").read_text(encoding="utf-8")
    assert cluster.count("pickle.loads(") == 1 and "pickle.loads(work_bytes)" in cluster     # that one, only


def test_every_hf_load_is_local_and_model_loads_are_safetensors_only():
    for p in CODE:
        for node, name, owner, kw in _calls(p):
            if name != "from_pretrained":
                continue
            assert _is_true(kw.get("local_files_only")), f"{p.name}:{node.lineno}: from_pretrained may download"
            if "AutoModel" in owner and "gguf_file" not in kw:
                assert _is_true(kw.get("use_safetensors")), f"{p.name}:{node.lineno}: may load a pickle"


def test_a_snapshot_holding_only_a_pickle_is_refused(chain_ws, tmp_path):
    """The loader never falls back to pytorch_model.bin, even one that would run code when unpickled."""
    snap = tmp_path / "snap"
    shutil.copytree(chain_ws / "artifacts/prepare_model", snap)
    (snap / "model.safetensors").unlink()
    marker = tmp_path / "pickle-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    torch.save({"model.embed_tokens.weight": Payload()}, snap / "pytorch_model.bin",
               _use_new_zipfile_serialization=True)
    with pytest.raises(UserError, match="safetensors"):
        loader.load_model(snap, torch.float32, "cpu", "eager", False)
    assert not marker.exists()


def test_a_local_hub_model_without_safetensors_is_refused(tmp_path, monkeypatch):
    (tmp_path / "models/pickled").mkdir(parents=True)
    (tmp_path / "models/pickled/pytorch_model.bin").write_bytes(pickle.dumps({"w": 1}))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserError, match=r"no \*\.safetensors weights .*never pickle"):
        sources.prepare(_hub("models/pickled"), out, False, False)


def test_prepared_snapshots_hold_no_pickle(chain_ws):
    files = [p for p in (chain_ws / paths.ARTIFACTS).rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert [p.name for p in files if p.suffix in PICKLE_SUFFIXES] == []


# ---------------------------------------------------------------- paths
def test_local_model_directory_outside_the_repository_is_refused(chain_ws, tmp_path, monkeypatch):
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    shutil.copytree(chain_ws / "artifacts/prepare_model", outside)     # a loadable model, outside
    (repo / "models").mkdir(parents=True)
    (repo / "models/link").symlink_to(outside)
    monkeypatch.chdir(repo)
    for hub_id in ("models/link", "../outside", str(outside)):
        out = tmp_path / f"out-{abs(hash(hub_id))}"
        out.mkdir()
        with pytest.raises(UserError, match=r"model\.source\.hub_id=.* is not allowed: .*inside the repository"):
            sources.prepare(_hub(hub_id), out, False, False)
    shutil.copytree(outside, repo / "models/inside")                  # the control: inside, it works
    out = tmp_path / "out-inside"
    out.mkdir()
    record = sources.prepare(_hub("models/inside"), out, False, False)
    assert record["snapshot_dir"] == str((repo / "models/inside").resolve())


# ---------------------------------------------------------------- downloads
NO_NETWORK = """
import os, runpy, socket, sys
def refuse(what):
    def f(*a, **k):
        with open(".hub-calls", "a") as log:
            log.write(what + "\\n")
        raise RuntimeError(what + " attempted")
    return f
socket.socket.connect = refuse("socket.connect")
socket.create_connection = refuse("socket.create_connection")
socket.getaddrinfo = refuse("socket.getaddrinfo")
import huggingface_hub, huggingface_hub.file_download as fd, huggingface_hub._snapshot_download as sd
for mod in (huggingface_hub, fd, sd):
    for name in ("hf_hub_download", "snapshot_download", "try_to_load_from_cache"):
        if hasattr(mod, name):
            setattr(mod, name, refuse(name))
sys.argv = ["stages.prepare_model"]
runpy.run_module("stages.prepare_model", run_name="__main__")
"""


def test_tiny_prepare_never_calls_the_hub_and_records_trust_remote_code(tmp_path, chain_ws):
    ws = make_workspace(tmp_path / "ws", ["model=tiny_qwen2", "model.trust_remote_code=true"])
    env = {k: v for k, v in python_env().items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    assert validated.ensure(ws).returncode == 0        # as dvc repro runs validate first (it imports no hub code)
    proc = subprocess.run([sys.executable, "-c", NO_NETWORK], cwd=ws, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (ws / ".hub-calls").exists(), (ws / ".hub-calls").read_text()
    source = json.loads((ws / "artifacts/prepare_model/source.json").read_text())
    manifest = json.loads((ws / "artifacts/prepare_model/manifest.json").read_text())
    assert source["trust_remote_code"] is True and manifest["model"]["trust_remote_code"] is True
    assert manifest["config"]["model"]["trust_remote_code"] is True
    # the default run: off, and forward's manifest says so too
    forward = json.loads((chain_ws / "artifacts/forward/manifest.json").read_text())
    assert forward["model"]["trust_remote_code"] is False and forward["config"]["model"]["trust_remote_code"] is False
    prepared = json.loads((chain_ws / "artifacts/prepare_model/source.json").read_text())
    assert prepared["trust_remote_code"] is False


def test_hub_model_is_looked_up_in_the_cache_only_unless_allowed(tmp_path, monkeypatch):
    import huggingface_hub
    seen = []

    def fake_snapshot_download(repo_id, **kwargs):
        seen.append(kwargs["local_files_only"])
        from huggingface_hub.errors import LocalEntryNotFoundError
        raise LocalEntryNotFoundError("not cached")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.chdir(tmp_path)
    source = _hub("Qwen/Qwen2.5-7B", revision="main")
    monkeypatch.delenv(sources.ALLOW_DOWNLOAD_ENV, raising=False)
    with pytest.raises(UserError, match="downloads are off"):
        sources.prepare(source, tmp_path, False, False)
    monkeypatch.setenv(sources.ALLOW_DOWNLOAD_ENV, "1")
    with pytest.raises(UserError, match="could not be reached"):
        sources.prepare(source, tmp_path, False, False)
    assert seen == [True, False]
