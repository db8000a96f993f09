"""A stage's inputs, each checked before it is read, and their record (the manifest's `inputs`).

An input must be the file its stage recorded, the file the other inputs were made from, and made
with the config validate wrote for its stage now and the repository files as they are now (else it
is stale, and named so). The producers' manifests are read once (`Producers`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.config import registry
from pipeline.errors import UserError
from pipeline.store import graph, paths, provenance, readers

HASH_INPUTS_ENV = "NEXTTOKEN_HASH_INPUTS"   # set: every stage input is hashed in full, none trusted


def locate(item: tuple[str, str] | Path, root: Path, prompt_id: str | None = None) -> Path:
    """An input's path (an artifact item, a per-prompt one with its prompt id, or a path); one line when missing."""
    path = paths.locate(item, root, prompt_id)
    if not path.exists():
        raise UserError(f"input {rel(path, root)} is missing: run the stage that makes it (`dvc repro`)")
    return path


class Producers:
    """The manifests of the stages that made a run's artifacts, each read once, with its outputs indexed by
    path (a set's manifest lists every partition, and each prompt's inputs are looked up in it). A manifest
    is the process's one parsed copy (`readers.read_manifest_once`), the one the checks and the report read
    too: a manifest parses to about twice its JSON size in Python objects (forward's at 1,000 prompts:
    1.15 MB, 2.4 MB parsed), the manifests a late stage reads at 10,000 prompts hold some 60 MB of JSON,
    and the report and the checks each held two copies."""

    def __init__(self, root: Path):
        self.root = root
        self._manifests: dict[str, dict | None] = {}
        self._outputs: dict[str, dict[str, dict]] = {}            # stage -> its manifest's outputs by path

    def manifest(self, stage: str) -> dict | None:
        """A stage's manifest (None: it has none)."""
        if stage not in self._manifests:
            exists = paths.manifest_path(stage, self.root).exists()
            manifest = self._manifests[stage] = readers.read_manifest_once(stage, self.root) if exists else None
            index = self._outputs[stage] = {}
            for o in (manifest or {}).get("outputs") or []:
                index.setdefault(o.get("path"), o)
        return self._manifests[stage]

    def output(self, rel_path: str) -> dict[str, Any] | None:
        """The output record of `rel_path` in its producing stage's manifest (None: no such record)."""
        stage = producer(rel_path)
        if stage is None:
            return None
        self.manifest(stage)
        return self._outputs[stage].get(rel_path)


class Ledger:
    """The inputs a stage run used (`inputs`: path, bytes, sha256, logical hash), each verified as it is used."""

    def __init__(self, root: Path):
        self.root = root
        self.inputs: list[dict[str, Any]] = []
        self.producers = Producers(root)
        self._listed: dict[str, str] = {}                         # path -> sha256 of each input listed
        self._seen: dict[str, tuple[str, str | None]] = {}        # path -> (sha256, stage recording it)
        self._verified: set[str] = set()                          # stages whose manifest's inputs were checked

    def use(self, item: tuple[str, str] | Path, prompt_id: str | None = None) -> Path:
        """Record an input (an artifact item, a per-prompt one with its prompt id, or a path).

        A folder records every file its stage produced (not its manifest, which is the
        record of those files, not one of them). See `_record` for what is read.
        """
        path = locate(item, self.root, prompt_id)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != paths.MANIFEST) \
            if path.is_dir() else [path]
        for f in files:
            record = self._record(f)
            self._verify(record)
            if self._listed.get(record["path"]) != record["sha256"]:     # read twice (a set-level file): once
                self.inputs.append(record)
                self._listed[record["path"]] = record["sha256"]
        return path

    def prompt_ids(self, item: tuple[str, str]) -> list[str]:
        """The prompts an input dataset holds a partition for (the set this stage loops over)."""
        ids = paths.prompt_ids(item, self.root)
        if not ids:
            raise UserError(f"input {rel(paths.dataset(item, self.root), self.root)} holds no prompt partition: "
                            f"run the stage that makes it (`dvc repro`)")
        return ids

    def _record(self, f: Path) -> dict[str, Any]:
        """path, size and sha256 of an input, read cheaply where that is safe.

        A file its producing stage recorded, still of the recorded size and modification time
        (ns), is that file: its recorded sha256 and logical hash are taken over without
        reading it again (DVC trusts its own outputs the same way). Anything else (another
        size or time, a copy DVC checked out, no record, or NEXTTOKEN_HASH_INPUTS=1) is
        hashed in full and then checked against the record (`_verify`). Nothing is parsed
        here: a file that is unreadable yet unrecorded is named by the reader that opens it.
        """
        rel_path, st = rel(f, self.root), f.stat()
        made = self.producers.output(rel_path) or {}
        trusted = not os.environ.get(HASH_INPUTS_ENV) and made.get("sha256") and \
            made.get("bytes") == st.st_size and made.get("mtime_ns") == st.st_mtime_ns
        record = {"path": rel_path, "bytes": st.st_size,
                  "sha256": made["sha256"] if trusted else provenance.sha256_file(f)}
        if record["sha256"] == made.get("sha256") and "logical_sha256" in made:
            record["logical_sha256"] = made["logical_sha256"]
        return record

    def _verify(self, record: dict[str, Any]) -> None:
        """Refuse an input that is not what its stage recorded, or not what other inputs were made from.

        (1) The producing stage's manifest, when there is one and it lists the file, records
        this sha256. (2) Every manifest read so far that lists this file among its inputs
        recorded this sha256 too (e.g. a capture made from other tokens than the
        tokens.parquet beside it).
        """
        rel_path, sha = record["path"], record["sha256"]
        self._agree(rel_path, sha, None)
        stage = producer(rel_path)
        manifest = self.producers.manifest(stage) if stage else None
        if manifest is None:
            return
        made = self.producers.output(rel_path)
        if made is not None and made.get("sha256") != sha:
            raise UserError(f"{rel_path} was not produced by the recorded run of stage {stage} "
                            f"(sha256 {sha[:12]} != manifest {str(made.get('sha256'))[:12]}): re-run `dvc repro`")
        if made is None and any(p.startswith(paths.PARTITION_KEY + "=") for p in Path(rel_path).parts):
            # a stray partition would join every query over the dataset: only the recorded ones count
            raise UserError(f"{rel_path} is not a partition the recorded run of stage {stage} wrote: "
                            f"remove it or re-run `dvc repro`")
        if stage in self._verified:       # what the manifest records holds for all its files: checked once
            return
        for i in manifest.get("inputs") or []:
            self._agree(i.get("path"), i.get("sha256"), stage)
        check_fresh(rel_path, stage, manifest, self.root)
        self._verified.add(stage)

    def _agree(self, rel_path: str, sha: str, made_from_by: str | None) -> None:
        """Note a sha256 for rel_path (on disk: made_from_by None; else recorded as an input of that stage)."""
        seen = self._seen.setdefault(rel_path, (sha, made_from_by))
        if seen[0] != sha:
            disk, claim = ((sha, seen) if made_from_by is None else (seen[0], (sha, made_from_by)))
            if not rel_path.startswith(paths.ARTIFACTS + "/") and (made_from_by is None) != (seen[1] is None):
                # a repository file (a prompt file) edited after that stage read it: its outputs are stale
                stale = changed_since(claim[1], rel_path, claim[0], disk)
                raise UserError(f"{paths.ARTIFACTS}/{claim[1]} is stale: {stale}")
            raise UserError(f"{rel_path} (sha256 {disk[:12]}) is not the file stage {claim[1]} was made from "
                            f"(its manifest records sha256 {claim[0][:12]}): the artifacts come from different "
                            f"runs; re-run `dvc repro`")


def check_fresh(rel_path: str, stage: str, manifest: dict, root: Path) -> None:
    """Refuse an input whose stage ran with another config than the one validate wrote for it now
    (artifacts/validate/<stage>.json, from params.yaml), or read a repository file (a prompt file)
    that has changed since: its numbers belong to another run, and the checks would blame them
    instead of naming what is stale."""
    now = validated_config(stage, root)
    if now is not None:
        recorded = manifest.get("config") or {}
        for key in registry.diff_keys(recorded, now)[:1]:
            was, has = registry.dotted(recorded, key), registry.dotted(now, key)
            raise UserError(f"{rel_path} is stale: stage {stage} ran with {key}={was!r}, params.yaml has {has!r}: "
                            f"re-run {stage} and the stages after it (`dvc repro`)")
    for i in manifest.get("inputs") or []:
        path = str(i.get("path"))
        if path.startswith(paths.ARTIFACTS + "/"):
            continue
        if Path(path).is_absolute() or ".." in Path(path).parts:   # a tampered record: read nothing
            raise UserError(f"{paths.manifest_path(stage).as_posix()} records an input outside the "
                            f"repository ({path}): re-run `dvc repro`")
        file = root / path
        now_sha = provenance.sha256_file(file) if file.is_file() else "missing"
        if now_sha != i.get("sha256"):
            raise UserError(f"{rel_path} is stale: {changed_since(stage, path, str(i.get('sha256')), now_sha)}")


def validated_config(stage: str, root: Path) -> dict | None:
    """The config validate wrote for `stage` from params.yaml as it is now, in the form a manifest records
    it (None where there is none: validate itself, logits, a folder without a validate run)."""
    if stage not in graph.validated_stages():
        return None
    try:
        return graph.recorded(stage, json.loads(paths.validated(stage, root).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def producer(rel_path: str) -> str | None:
    """The stage whose folder holds `rel_path` (artifacts/<stage>/...), None for any other path."""
    parts = Path(rel_path).parts
    if len(parts) < 3 or parts[0] != paths.ARTIFACTS or parts[1] not in paths.STAGES:
        return None
    return parts[1]


def changed_since(stage: str, path: str, recorded: str, now: str) -> str:
    return (f"stage {stage} read {path} (sha256 {recorded[:12]}), which has changed since (now {now[:12]}): "
            f"re-run {stage} and the stages after it (`dvc repro`)")


def rel(path: Path, root: Path) -> str:
    return Path(os.path.relpath(path, root)).as_posix()
