"""Reading a run's artifacts back safely: each file refused in one line when it is missing or unreadable, a
manifest refused unless it is of this code's format, and what a stage reads for every prompt of a set but
is one file (a manifest, a vocabulary) read once per process and version of the file (`read_once`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import kernels
from pipeline.errors import UserError
from pipeline.store import paths, provenance

PARQUET_META_KEY = b"nexttoken"     # the key of a Parquet file's schema metadata holding its run's facts


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


def read_dataset(item: tuple[str, str], root: Path | str = ".", columns: list[str] | None = None, filter=None):
    """Every prompt's partition of a per-prompt Parquet file as one Arrow table, with a
    `prompt_id` column (string) taken from the Hive path; `filter` (a pyarrow expression, e.g.
    `pc.field("prompt_id") == "q"`) is pushed down to the partitions, so others are not read."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    folder = paths.dataset(item, root)
    if not paths.prompt_ids(item, root):
        raise UserError(f"{folder} holds no partition: run `dvc repro` to make it")
    hive = ds.partitioning(pa.schema([(paths.PARTITION_KEY, pa.string())]), flavor="hive")
    try:
        return ds.dataset(folder, format="parquet", partitioning=hive).to_table(columns=columns, filter=filter)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{folder} is not a readable Parquet dataset (truncated or corrupt?): "
                        f"{str(e).splitlines()[0]}") from None


def parquet_facts(path: Path) -> dict[str, Any]:
    """The facts a stage stored in a Parquet file's schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        meta = pq.read_schema(path).metadata or {}
        return json.loads(meta.get(PARQUET_META_KEY, b"{}"))
    except (pa.ArrowInvalid, OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a readable Parquet file (truncated or corrupt?): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


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


def tables_stored(probs_manifest: dict[str, Any]) -> bool:
    """Whether the probs stage of this manifest wrote table.parquet and filtered.parquet (`facts.table`:
    `probs.table` resolved), or readers re-derive them from logits.parquet (`probs.read_table`)."""
    return (probs_manifest.get("facts") or {}).get("table", "stored") != "derived"


def read_manifest(stage: str, root: Path | str = ".") -> dict[str, Any]:
    """A stage's manifest.json, refused in one line unless it is a manifest of this code's format
    (`provenance.FORMAT_VERSION`): every reader of a run's files reads it through here first."""
    return check_format(read_json(paths.manifest_path(stage, root)), paths.manifest_path(stage).as_posix())


def read_once(reader: Callable[..., Any] | None = None, *, maxsize: int = 8) -> Callable[..., Any]:
    """`reader(path, *args)` remembered per process by the file's path, modification time (ns) and size, and
    args (the last `maxsize`): what a stage reads for every prompt of a set but that is one file for the whole
    set (a manifest listing every partition, a 152k-id vocabulary or tokenizer.json), read once and again only
    when the file changes. The result is shared: callers only read it. `@read_once` or `@read_once(maxsize=N)`."""
    if reader is None:
        return functools.partial(read_once, maxsize=maxsize)

    @functools.lru_cache(maxsize=maxsize)
    def cached(path: str, mtime_ns: int, size: int, *args: Any) -> Any:
        return reader(Path(path), *args)

    @functools.wraps(reader)
    def wrapper(path: Path | str, *args: Any) -> Any:
        try:
            st = Path(path).stat()
        except FileNotFoundError:              # the reader names what is missing, in its own words
            return reader(Path(path), *args)
        return cached(str(path), st.st_mtime_ns, st.st_size, *args)
    return wrapper


@read_once(maxsize=len(paths.STAGES))      # every stage's manifest at once (the report reads them all)
def _manifest_file(path: Path, stage: str) -> dict[str, Any]:
    return check_format(read_json(path), paths.manifest_path(stage).as_posix())


def read_manifest_once(stage: str, root: Path | str = ".") -> dict[str, Any]:
    """`read_manifest`, read once per process and version of the file (`read_once`). Shared: read only."""
    return _manifest_file(paths.manifest_path(stage, root), stage)


def device_where(record: dict) -> str:
    """Where a recorded computation ran ({"device", "gpu_name"}), as the checks and the refusals name it: the
    device type (`cpu`), or for CUDA the type and GPU model (`cuda (NVIDIA H200)`)."""
    kind = str(record.get("device") or "cpu").split(":")[0]
    if kind != "cuda":
        return kind
    return f"{kind} ({record.get('gpu_name') or 'GPU model not recorded'})"


def recorded_cpu_kernels(root: Path | str, stage: str, prompt_id: str) -> str | None:
    """The CPU kernels a stage computed `prompt_id` with (`kernels.cpu_key`): the prompt's own record where the
    stage ran on Ray (a cluster may mix CPUs), else the stage process's kernel path; None when not recorded."""
    if not paths.manifest_path(stage, root).exists():
        return None
    manifest = read_manifest_once(stage, root)
    prompt = ((manifest.get("executor") or {}).get("prompts") or {}).get(prompt_id)
    return kernels.cpu_key(prompt) if prompt else kernels.cpu_key(manifest.get("kernels"))


def check_format(manifest: Any, where: str) -> dict[str, Any]:
    """`manifest` (read from `where`) when it is a stage manifest of this code's format, else one line:
    a run made by code of another format is read by checking out that code, not by special cases here."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("outputs"), list):
        raise UserError(f"{where} is not a stage manifest (no `outputs` list; corrupt?): re-run `dvc repro`")
    if manifest.get("format_version") != provenance.FORMAT_VERSION:
        raise UserError(provenance.format_refusal(where, manifest.get("format_version"),
                                                  (manifest.get("git") or {}).get("commit")))
    return manifest
