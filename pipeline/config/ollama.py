"""Ollama's local store: a model name resolved through its manifest to the GGUF blob.

`model=ollama model.source.name=smollm2:135m` names a model pulled by Ollama. The blob it resolves to is
the file prepare_model reads (pipeline/model/gguf.py) and so prepare_model's DVC dependency: conf/model/
ollama.yaml sets `model.source.files: ${ollama_blob:${model.source.name}}`, which this resolver turns into
the blob's path when conf/ is composed, by `nexttoken compose` (pipeline/config/compose.py registers it)
and by `dvc exp run -S ...` (DVC loads it as a Hydra plugin: hydra_plugins/nexttoken_resolvers.py).
A model pulled again under the same tag is a new blob, so a new dependency: the validate stage refuses a
params.yaml whose `files` is no longer the name's blob (pipeline/model/sources.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.errors import UserError

ENV = "OLLAMA_MODELS"
REGISTRY = "registry.ollama.ai"
MODEL_LAYER = "application/vnd.ollama.image.model"
RESOLVER = "ollama_blob"        # ${ollama_blob:NAME} in conf/: the blob's path


def store() -> Path:
    """Ollama's local model store: $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.environ.get(ENV) or Path.home() / ".ollama" / "models").expanduser()


def blob(name: str, where: Path | None = None) -> Path:
    """The GGUF blob of an Ollama model `name` ([namespace/]model[:tag], tag default latest), through
    manifests/registry.ollama.ai/<namespace, default library>/<model>/<tag> -> its model layer's digest."""
    where = store() if where is None else Path(where)
    key = "model.source.name"
    if not (where / "manifests").is_dir():
        raise UserError(f"{key}={name!r}: no Ollama store at {where} (set {ENV} or pull the model "
                        "with `ollama pull`); allowed: a model in a local Ollama store")
    model, _, tag = str(name).partition(":")
    parts = model.split("/")
    if not model or not all(parts) or len(parts) > 3 or ".." in parts or "/" in tag or tag in (".", ".."):
        raise UserError(f"{key}={name!r} is not allowed: an Ollama model name like smollm2:135m or user/model:tag")
    parts = {1: [REGISTRY, "library"], 2: [REGISTRY], 3: []}[len(parts)] + parts
    manifest = where.joinpath("manifests", *parts, tag or "latest")
    if not manifest.is_file():
        pulled = sorted(p.relative_to(where / "manifests").as_posix()
                        for p in (where / "manifests").rglob("*") if p.is_file())
        raise UserError(f"{key}={name!r}: not in the Ollama store {where} (no {manifest}); "
                        f"pulled there: {', '.join(pulled) or 'none'}")
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise UserError(f"{key}={name!r}: {manifest} is not an Ollama manifest with a model layer "
                        f"({MODEL_LAYER}): {type(e).__name__}") from None
    found = where / "blobs" / str(digest).replace(":", "-")
    if not found.is_file():
        raise UserError(f"{key}={name!r}: its model blob {found} is missing from the Ollama store")
    return found


def register_resolver() -> None:
    """`${ollama_blob:NAME}` -> the blob's path, for OmegaConf (once per process)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda name: str(blob(name)))
