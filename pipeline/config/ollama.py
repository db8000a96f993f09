"""Ollama's local store: a model name resolved through its manifest to the GGUF blob.

`model=ollama model.source.name=smollm2:135m` names a model pulled by Ollama. The store keeps one manifest per
name (manifests/registry.ollama.ai/<namespace>/<model>/<tag>), which names each layer by its sha256 digest, and
the layers as content-addressed blobs (blobs/sha256-<digest>). So the manifest says exactly which bytes the
name means: it is prepare_model's DVC dependency. conf/model/ollama.yaml sets
`model.source.files: ${ollama_manifest:${model.source.name}}`, which this resolver turns into the manifest's
path when conf/ is composed, by `nexttoken compose` (pipeline/config/compose.py registers it) and by
`dvc exp run -S ...` (DVC loads it as a Hydra plugin:
pipeline/config/plugins/hydra_plugins/nexttoken_resolvers.py). `ollama pull`
of a new version rewrites that manifest, so the next `dvc repro` runs prepare_model again, which reads the
blob the manifest names then (pipeline/model/gguf.py); the audit hashes that blob again.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pipeline.errors import UserError

ENV = "OLLAMA_MODELS"
REGISTRY = "registry.ollama.ai"
MODEL_LAYER = "application/vnd.ollama.image.model"
RESOLVER = "ollama_manifest"    # ${ollama_manifest:NAME} in conf/: the path of the name's manifest


def store() -> Path:
    """Ollama's local model store: $OLLAMA_MODELS (absolute from here on: DVC reads a dependency from the
    repository root, a queued experiment from another folder), else ~/.ollama/models."""
    return Path(os.environ.get(ENV) or Path.home() / ".ollama" / "models").expanduser().absolute()


def manifest(name: str, where: Path | None = None) -> Path:
    """The manifest of an Ollama model `name` ([namespace/]model[:tag], tag default latest):
    manifests/registry.ollama.ai/<namespace, default library>/<model>/<tag>; refused in one line when the
    store or the name is not there."""
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
    found = where.joinpath("manifests", *parts, tag or "latest")
    if not found.is_file():
        pulled = sorted(p.relative_to(where / "manifests").as_posix()
                        for p in (where / "manifests").rglob("*") if p.is_file())
        raise UserError(f"{key}={name!r}: not in the Ollama store {where} (no {found}); "
                        f"pulled there: {', '.join(pulled) or 'none'}")
    return found


def blob(name: str, where: Path | None = None) -> Path:
    """The GGUF blob the manifest of `name` names now: its model layer's digest -> blobs/sha256-<digest>."""
    where = store() if where is None else Path(where)
    key, found = "model.source.name", manifest(name, where)
    try:
        layers = json.loads(found.read_text(encoding="utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_LAYER)
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(digest)):       # a blob's name, never a path elsewhere
            raise ValueError(digest)
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise UserError(f"{key}={name!r}: {found} is not an Ollama manifest with a model layer "
                        f"({MODEL_LAYER}): {type(e).__name__}") from None
    model = where / "blobs" / str(digest).replace(":", "-")
    if not model.is_file():
        raise UserError(f"{key}={name!r}: its model blob {model} is missing from the Ollama store")
    return model


def register_resolver() -> None:
    """`${ollama_manifest:NAME}` -> the manifest's path, for OmegaConf (once per process)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda name: str(manifest(name)))
