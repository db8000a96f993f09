"""Writing a stage's artifacts atomically, with its manifest, and reading them back safely.

A stage builds its whole output folder in a staging folder outside `artifacts/`
(`.nexttoken/staging/`), writes `manifest.json` last, then moves the folder into
`artifacts/<stage>/` with a rename. An interrupted or failed stage therefore leaves no
partial file under `artifacts/`: either the old folder, none, or the complete new one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline import paths, provenance
from pipeline.errors import EXIT_USER_ERROR, UserError

PARQUET_META_KEY = b"nexttoken"


class StageRun:
    """One run of one stage: records inputs, collects outputs, writes the manifest."""

    def __init__(self, stage: str, root: Path, config: dict[str, Any]):
        self.stage = stage
        self.root = Path(root).resolve()
        self.config = config
        self.seeds: dict[str, int] = {}
        self.model: dict[str, Any] | None = None
        self.facts: dict[str, Any] = {}
        self._inputs: list[dict[str, Any]] = []
        self._started = time.time()
        self.staging = self.root / paths.STAGING / f"{stage}-{os.getpid()}"
        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.staging.mkdir(parents=True)

    # ------------------------------------------------------------ inputs
    def use(self, item: tuple[str, str] | Path) -> Path:
        """Record an input (an artifact item or a path).

        A folder records every file its stage produced (not its manifest, which is the
        record of those files, not one of them).
        """
        path = paths.artifact(item, self.root) if isinstance(item, tuple) else self.root / item
        if not path.exists():
            raise UserError(f"input {_rel(path, self.root)} is missing: run the stage that makes it "
                            f"(`dvc repro`)")
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != paths.MANIFEST) \
            if path.is_dir() else [path]
        for f in files:
            self._inputs.append(provenance.file_record(f, self.root))
        return path

    # ------------------------------------------------------------ outputs
    def out(self, name: str) -> Path:
        """A path in the staging folder, for writers that need a file name."""
        p = self.staging / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_json(self, name: str, obj: Any) -> Path:
        p = self.out(name)
        p.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")
        return p

    def write_parquet(self, name: str, table, facts: dict[str, Any] | None = None, **kwargs) -> Path:
        """A Parquet file whose schema metadata carries the key facts of this run."""
        import pyarrow.parquet as pq
        meta = {**(table.schema.metadata or {}), **self.parquet_metadata(facts)}
        p = self.out(name)
        pq.write_table(table.replace_schema_metadata(meta), p, **kwargs)
        return p

    def parquet_metadata(self, extra: dict[str, Any] | None = None) -> dict[bytes, bytes]:
        """Schema metadata for a Parquet file: this run's key facts under b"nexttoken"."""
        facts = {"stage": self.stage, "config_sha256": provenance.sha256_json(self.config)}
        if self.model:
            facts["model"] = {k: self.model.get(k) for k in ("name", "kind", "revision")}
        facts = {**facts, **self.facts, **(extra or {})}
        return {PARQUET_META_KEY: provenance.canonical_json(facts).encode()}

    # ------------------------------------------------------------ commit
    def commit(self) -> Path:
        """Write the manifest and move the finished folder into artifacts/<stage>/."""
        outputs = [provenance.file_record(p, self.staging) for p in sorted(self.staging.rglob("*"))
                   if p.is_file()]
        final = paths.stage_dir(self.stage, self.root)
        for o in outputs:
            o["path"] = _rel(final / o["path"], self.root)
        manifest = {
            "schema_version": provenance.SCHEMA_VERSION,
            "stage": self.stage,
            "config": self.config,
            "config_sha256": provenance.sha256_json(self.config),
            "seeds": self.seeds,
            "model": self.model,
            "facts": self.facts,
            "inputs": self._inputs,
            "outputs": outputs,
            **provenance.environment(self.root),
            "command": sys.argv,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - self._started, 3),
        }
        self.write_json(paths.MANIFEST, manifest)
        _swap_into_place(self.staging, final)
        return final

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _swap_into_place(staging: Path, final: Path) -> None:
    """Replace `final` by `staging` with renames (same filesystem, no copy)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    trash = staging.with_name(staging.name + ".old")
    if final.exists():
        os.replace(final, trash)
    os.replace(staging, final)
    shutil.rmtree(trash, ignore_errors=True)


def _rel(path: Path, root: Path) -> str:
    return Path(os.path.relpath(path, root)).as_posix()


@contextmanager
def stage_run(stage: str, config: dict[str, Any], root: Path | str = ".") -> Iterator[StageRun]:
    """Run a stage's body; commit its outputs on success, leave nothing on failure."""
    run = StageRun(stage, Path(root), config)
    try:
        yield run
        run.commit()
    finally:
        run.discard()


def stage_main(stage: str, body: Callable[[], None]) -> None:
    """Entry point wrapper: a UserError is one line on stderr and exit status 2.

    Progress bars show on a terminal only: in CI logs and under DVC's captured output
    they would be thousands of carriage-return lines.
    """
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:       # imported by the stage module already
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    try:
        body()
    except UserError as e:
        print(f"nexttoken {stage}: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print(f"nexttoken {stage}: interrupted; nothing was written to artifacts/{stage}", file=sys.stderr)
        sys.exit(130)


# ---------------------------------------------------------------- readers
def read_parquet(path: Path, columns: list[str] | None = None, filters=None):
    """A Parquet artifact as an Arrow table; a clear error naming a missing or corrupt file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        return pq.read_table(path, columns=columns, filters=filters)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path} is not a readable Parquet file (truncated or corrupt?): "
                        f"{str(e).splitlines()[0]}") from None


def parquet_facts(path: Path) -> dict[str, Any]:
    """The facts a stage stored in a Parquet file's schema metadata."""
    import pyarrow.parquet as pq
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta.get(PARQUET_META_KEY, b"{}"))


def read_json(path: Path) -> Any:
    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON (corrupt?): {e}") from None


def read_safetensors(path: Path) -> dict:
    """All tensors of a safetensors artifact (no pickle); a clear error when corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def read_manifest(stage: str, root: Path | str = ".") -> dict[str, Any]:
    return read_json(paths.manifest_path(stage, root))
