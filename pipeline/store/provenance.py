"""Provenance: what produced an artifact, recorded as a fixed set of fields.

Every stage folder gets a `manifest.json` built here: the stage, its resolved config, seeds,
inputs and outputs with sha256 (plus a logical content hash for tables and tensors, which
ignores file metadata), the model source, library versions, hardware, determinism settings,
the git commit and dirty flag, when and how long. A failed metadata write is an error.
The kernel path (`kernel_path`) says which CPU/GPU kernels computed the numbers: the same
code and snapshot give other bits on a machine whose kernels differ (see pipeline/kernels.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline import kernels

# The layout of a run's files (manifest fields, file names, partitions, columns, the logical hash).
# Every manifest records it; every reader refuses a run of another format (`format_refusal`):
# auditing a run made by other code means checking out that code. Change the layout, bump this.
FORMAT_VERSION = 4

# Distributions whose versions decide the numbers (or how they are stored).
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pyarrow", "pandas",
             "hydra-core", "omegaconf", "dvc", "accelerate", "gguf", "nexttoken")

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_json(obj: Any) -> str:
    """Hash of a JSON-able object in canonical form (sorted keys, no spaces)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def logical_hash(path: Path) -> str | None:
    """Content hash of a table or tensor file that ignores its metadata and encoding.

    Parquet: the Arrow IPC stream of the table with schema metadata dropped, one record batch
    per row group, fed to sha256 as it is written (memory: one row group).
    safetensors: name, dtype, shape and raw bytes of every tensor, in name order.
    Other files: None (their sha256 is their identity).
    """
    path = Path(path)
    if path.suffix == ".parquet":
        return _parquet_hash(path)
    if path.suffix == ".safetensors":
        return _safetensors_hash(path)
    return None


def logical_matches(path: Path, record: dict) -> bool | None:
    """Whether `path`'s logical hash is the recorded one (None: the record has no logical hash).
    What `nexttoken audit` and `verify` call for every output."""
    if "logical_sha256" not in record:
        return None
    return logical_hash(path) == record["logical_sha256"]


def format_refusal(where: str, found: Any, made_by: str | None) -> str:
    """The one line refusing a run whose manifest `where` records format_version `found` (not
    FORMAT_VERSION), naming this code (nexttoken version and commit) and the commit that made the run."""
    here = git_state(Path(__file__).resolve().parents[2])["commit"]
    version = _version("nexttoken")
    code = f"nexttoken {version or '(not installed)'}" + (f" at {here[:12]}" if here else "")
    found = "none" if found is None else repr(found)
    checkout = f"git checkout {made_by[:12]}" if made_by else "the manifest records no commit"
    return (f"{where}: format_version {found} is not this code's {FORMAT_VERSION} ({code}): check out the "
            f"nexttoken revision that made this run to read or audit it ({checkout})")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


class _Sha256Sink:
    """A write-only file object feeding sha256: Arrow's IPC writer streams into it."""

    closed = False

    def __init__(self) -> None:
        self.hash = hashlib.sha256()

    def write(self, data) -> int:
        self.hash.update(data)
        return len(memoryview(data))

    def flush(self) -> None:
        pass


def _parquet_hash(path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    sink = _Sha256Sink()
    with pq.ParquetFile(path) as pf:
        schema = pf.schema_arrow.remove_metadata()
        with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema) as writer:
            for rg in range(pf.num_row_groups):
                # one chunk per column, so the batch does not depend on how the reader split it
                table = pf.read_row_group(rg, use_threads=False).replace_schema_metadata(None).combine_chunks()
                for batch in table.to_batches():
                    writer.write_batch(batch)
    return sink.hash.hexdigest()


def _safetensors_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        for name in sorted(k for k in header if k != "__metadata__"):
            info = header[name]
            h.update(canonical_json([name, info["dtype"], info["shape"]]).encode())
            start, end = info["data_offsets"]
            f.seek(base + start)
            remaining = end - start
            while remaining:
                block = f.read(min(_CHUNK, remaining))
                if not block:
                    raise ValueError(f"{path} is truncated: tensor {name} ends past the file")
                h.update(block)
                remaining -= len(block)
    return h.hexdigest()


MODEL_KEYS = ("name", "kind", "revision")   # what names a model in manifests and Parquet metadata


def model_record(source: dict | None) -> dict:
    """The model's name, kind and revision from a source record (source.json or a manifest's)."""
    return {k: (source or {}).get(k) for k in MODEL_KEYS}


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in LIBRARIES:
        out[dist] = _version(dist)
    return out


def hardware(with_torch: bool = True) -> dict[str, Any]:
    """The machine; with_torch=False leaves out what only torch can tell (threads, GPUs), for a
    stage that never imports it (validate: seconds saved on every config change)."""
    import psutil

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
    }
    if not with_torch:
        return info
    import torch

    info |= {
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
        "cuda_version": torch.version.cuda,
        "cudnn_version": None,
        "gpu_driver": None,
    }
    if torch.cuda.is_available():
        info["cudnn_version"] = torch.backends.cudnn.version()
        info["gpu_driver"] = _nvidia_driver()
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": p.name, "total_memory_bytes": p.total_memory,
                                 "compute_capability": f"{p.major}.{p.minor}"})
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip().splitlines()[0]
    except (subprocess.SubprocessError, IndexError):
        return None


def determinism() -> dict[str, Any]:
    import torch

    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "torch_threads": torch.get_num_threads(),
    }


def kernel_path() -> dict[str, Any]:
    """Which kernels compute here: the mode pinned, ATen's capability, the kernel-selecting CPU
    flags, the MKL / oneDNN builds, the pinning variables, threads and, on CUDA, the GPUs and
    every flag that changes GPU bits."""
    import torch

    config = torch.__config__.show()
    record: dict[str, Any] = {
        "mode": kernels.pinned_mode(),
        "machine": platform.machine(),
        "cpu_flags": kernels.cpu_flags(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": _build_version(r"Math Kernel Library Version ([0-9][0-9.]*)", config),
        "onednn": _build_version(r"MKL-DNN (v[^\s]+)", config),
        "env": {k: os.environ.get(k) for k in kernels.PIN_VARS},
        "torch_threads": torch.get_num_threads(),
        "cuda": None,
    }
    if torch.cuda.is_available():
        m = torch.backends.cuda.matmul
        record["cuda"] = {
            "gpus": [f"{p.name} (cc {p.major}.{p.minor})" for p in map(torch.cuda.get_device_properties,
                                                                     range(torch.cuda.device_count()))],
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "matmul_allow_tf32": m.allow_tf32, "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "allow_bf16_reduced_precision_reduction": m.allow_bf16_reduced_precision_reduction,
            "allow_fp16_reduced_precision_reduction": m.allow_fp16_reduced_precision_reduction,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "preferred_blas_library": str(torch.backends.cuda.preferred_blas_library()),
        }
    return record


def _build_version(pattern: str, config: str) -> str | None:
    m = re.search(pattern, config)
    return m.group(1) if m else None


def git_state(root: Path) -> dict[str, Any]:
    """Commit and dirty flag of the code that ran. Outside git: both None."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def environment(root: Path, with_torch: bool = True) -> dict[str, Any]:
    """The environment fields of a manifest, gathered once per stage run (with_torch: see `hardware`;
    without torch no kernel path either: such a stage computes nothing kernel-bound)."""
    return {"libraries": library_versions(), "hardware": hardware(with_torch),
            "determinism": determinism() if with_torch else None,
            "kernels": kernel_path() if with_torch else None,
            "git": git_state(root), "python_executable": sys.executable}


def json_bytes(obj: Any) -> bytes:
    """A JSON output as the stage layer writes it (`StageRun.write_json`: indent 2, UTF-8, a final newline)."""
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def unchanged_outputs(folder: Path, root: Path, stage: str, config: dict, files: dict[str, bytes],
                      inputs: list[Path]) -> bool:
    """Whether `folder` (a stage's output folder) already holds exactly `files` (name -> bytes, besides its
    manifest), under a manifest of this format that records this stage, this config, these inputs (sha256 of
    each, read now) and these outputs (sha256). A run would then rewrite only what says when and where it ran
    (created_at, duration, each output's modification time): for a stage whose outputs are a pure
    function of its config and inputs (validate), the folder is left as it is, so its DVC hash, and dvc.lock,
    do not change when nothing changed (issue 50). Anything unreadable or different: False (the stage runs)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        on_disk = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or (manifest.get("format_version"), manifest.get("stage"),
                                          manifest.get("config")) != (FORMAT_VERSION, stage, config):
        return False
    on_disk.pop("manifest.json")
    if set(on_disk) != set(files) or any(on_disk[name].read_bytes() != data for name, data in files.items()):
        return False

    def rel(path: Path) -> str:
        return Path(os.path.relpath(path, root)).as_posix()
    outputs = {rel(folder / name): hashlib.sha256(data).hexdigest() for name, data in files.items()}
    want_inputs = [(rel(p), sha256_file(p)) for p in inputs if p.is_file()]
    try:
        return ({o["path"]: o["sha256"] for o in manifest["outputs"]} == outputs and len(want_inputs) == len(inputs)
                and [(i["path"], i["sha256"]) for i in manifest["inputs"]] == want_inputs)
    except (KeyError, TypeError):
        return False


def file_record(path: Path, root: Path) -> dict[str, Any]:
    """path (relative to the repo root), size, modification time (ns), sha256 and logical hash
    of one file. Size and time let a consumer recognise the very file without reading it."""
    st = path.stat()
    rec = {"path": Path(os.path.relpath(path, root)).as_posix(), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
           "sha256": sha256_file(path)}
    logical = logical_hash(path)
    if logical is not None:
        rec["logical_sha256"] = logical
    return rec
