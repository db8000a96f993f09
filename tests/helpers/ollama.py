"""An Ollama store laid out as `ollama pull` lays it out, in a temporary folder (no Ollama needed)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.config import ollama


def ollama_store(root: Path, name: str, blob_source: Path | None = None) -> Path:
    """`root` as a store holding `name` (namespace/model/tag under registry.ollama.ai): a manifest naming
    its layers by digest, blobs/sha256-<digest>. The model layer is `blob_source` (linked), or a few bytes.
    Called again on the same root, it is that model pulled again: the manifest names the new blob."""
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    if blob_source is None:
        blob_source = root / "not-a-model.bin"
        blob_source.write_bytes(b"stands for a GGUF")
    digest = hashlib.sha256(blob_source.read_bytes()).hexdigest()
    (root / "blobs" / f"sha256-{digest}").symlink_to(blob_source)
    (root / "blobs" / f"sha256-{'0' * 64}").write_text("{{ .Prompt }}")      # the template layer
    manifest = root.joinpath("manifests", ollama.REGISTRY, *name.split("/"))
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{'0' * 64}"},
        {"mediaType": ollama.MODEL_LAYER, "digest": f"sha256:{digest}", "size": blob_source.stat().st_size}]}))
    return root
