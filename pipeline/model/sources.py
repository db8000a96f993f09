"""What a model source is, decided before any stage runs: its folder, its config.json, its family.

No torch import: the validate stage calls `up_front` on every run, so a missing folder, a folder
without weights or tokenizer, pickle-only weights, or a model_type that cannot be captured is
refused in one line before DVC removes any stage's outputs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.config.schema import SourceConfig
from pipeline.errors import UserError, bad_value
from pipeline.model import gguf
from pipeline.model.families import TINY_FAMILIES, Support, support
from pipeline.store.provenance import sha256_file

PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.msgpack", "*.h5", "*.gguf"]
_TOKENIZER = {"tokenizer.json", "tokenizer.model", "vocab.json"}
_SHA256_BLOB = re.compile(r"[0-9a-f]{64}")


def folder_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` by relative path; an HF cache symlink to blobs/<sha256>
    (LFS) already names it."""
    out = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and ".cache" not in p.parts):
        target = path.resolve()
        lfs = path.is_symlink() and target.parent.name == "blobs" and _SHA256_BLOB.fullmatch(target.name)
        out[path.relative_to(folder).as_posix()] = target.name if lfs else sha256_file(path)
    return out


def changed_files(record: dict) -> list[str]:
    """For a model used in place (kind local or hub: source.json's snapshot_dir), one line per file
    whose sha256 is not what prepare_model recorded: edited, missing, or new. Empty otherwise."""
    folder = record.get("snapshot_dir")
    if not folder or record.get("kind") not in ("local", "hub"):
        return []
    if not Path(folder).is_dir():
        return [f"model folder {folder}: missing (prepare_model hashed {len(record.get('inputs', {}))} files there)"]
    recorded, now = record.get("inputs", {}), folder_hashes(Path(folder))
    lines = [f"model file {folder}/{name}: sha256 {now[name][:12]} != recorded {sha[:12]} (changed after "
             "prepare_model)" for name, sha in recorded.items() if name in now and now[name] != sha]
    lines += [f"model file {folder}/{name}: missing (recorded by prepare_model)"
              for name in recorded if name not in now]
    lines += [f"model file {folder}/{name}: new since prepare_model" for name in now if name not in recorded]
    return lines


def check_folder(path: str, root: Path) -> Path:
    """The resolved folder of `model.source.path` (absolute, or relative to `root`), refused in one
    line when it cannot load: missing, no config.json, pickle weights only, no safetensors, no
    tokenizer files."""
    key = "model.source.path"
    folder = (Path(root) / Path(path).expanduser()).resolve()
    if not folder.is_dir():
        raise UserError(f"{key}={path!r}: no such folder ({folder}); allowed: a folder holding config.json, "
                        "*.safetensors weights and the tokenizer files")
    names = {p.name for p in folder.iterdir() if p.is_file()}
    missing = [what for what, ok in (("config.json", "config.json" in names),
                                     ("tokenizer files (tokenizer.json, tokenizer.model or vocab.json)",
                                      bool(names & _TOKENIZER))) if not ok]
    if not any(n.endswith(".safetensors") for n in names):
        pickles = sorted(n for n in names if any(Path(n).match(p) for p in PICKLE_PATTERNS))
        if pickles:
            raise UserError(f"{key}={path!r}: pickle weights only ({', '.join(pickles)}): nexttoken loads "
                            "safetensors only, never pickle (save_pretrained writes safetensors by default)")
        missing.insert(0, "*.safetensors weights")
    if missing:
        raise UserError(f"{key}={path!r}: {folder} has no {', no '.join(missing)}")
    return folder


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable config.json ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a config.json (a JSON object expected)")
    return config


def _cached_config(hub_id: str, revision: str | None) -> Path | None:
    """config.json of a hub model where the HF cache has it (no request); None when it does not."""
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(hub_id, "config.json", revision=revision or "main")
    except Exception:       # an id the hub library rejects: prepare_model says so in its own words
        return None
    return Path(found) if isinstance(found, str) else None


def up_front(source: SourceConfig, root: Path) -> Support | None:
    """The capture support of the configured model, from its config.json, or a one-line refusal.

    kind=local: the folder must load (`check_folder`); kind=tiny: the family is built here; kind=hub:
    decided where the HF cache already holds the config (else prepare_model finds or fetches it);
    kind=gguf / ollama: the file is found and its header read (`gguf.check`), unless a package
    assembles it (read by prepare_model); tiny_qwen2 is a known family.
    """
    if source.kind in ("gguf", "ollama"):
        _gguf_up_front(source, root)
        return None
    if source.kind == "local":
        folder = check_folder(source.path, root)
        return support(_read_config(folder / "config.json"), f"{source.path}/config.json")
    if source.kind == "tiny":
        if source.family not in TINY_FAMILIES:
            raise bad_value("model.source.family", source.family, f"one of {', '.join(TINY_FAMILIES)}")
        return support({"model_type": source.family, "num_attention_heads": 1, "num_hidden_layers": 1},
                       "model.source.family")       # every toy has attention layers (tiny._FAMILY_EXTRAS)
    if source.kind == "hub":
        local = Path(root) / source.hub_id
        config = local / "config.json" if local.is_dir() else _cached_config(source.hub_id, source.revision)
        return support(_read_config(config), str(config)) if config is not None and config.is_file() else None
    return None


def _gguf_up_front(source: SourceConfig, root: Path) -> None:
    """A GGUF that is missing, not GGUF, or of an architecture transformers cannot read: one line."""
    file = gguf.locate(source, root)
    if file is not None:
        gguf.check(file, f"model.source ({file})")
