"""Content digests of a run's data files: per column (Parquet) and per tensor (safetensors).

Schema metadata, encodings, nullability and row-group layout are ignored: only the values
count, so two runs (or two versions of the code) can be compared number for number:

    python -m bench.run_digest artifacts > after.json && diff before.json after.json

bench/results/digests_0286aca_*.json hold the digests of the run before the library was
reorganised by role (commit 0286aca, this machine's CPU: AVX-512 + AMX-bf16, native kernels),
when the files were flat in their stage folders; since issue 17 a per-prompt file is digested per
partition (`logits/logits/prompt_id=<id>/logits.parquet`): the same values under a new key.
"""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store import paths

# (item, the columns digested: None = all) of every data file; per-prompt files are digested per partition
FILES = [
    (paths.TOKENS, None),
    (paths.LOGITS, None),
    (paths.TABLE, None),
    (paths.FILTERED, None),
    (paths.STEPS, ["branch", "kv_cache", "step", "token_id", "logit", "prob", "rank", "top_ids", "top_logits",
                   "top_probs"]),
    (paths.STEP_LOGITS, None),
    (paths.PROBS_PROMPT_METRICS, None),
    (paths.TRAJECTORY_PROMPT_METRICS, None),
]


def data_files(repo: Path, item: tuple[str, str]) -> list[Path]:
    """An item's files in a run: a per-prompt item's partitions, a set-level item's one file."""
    if item not in paths.PER_PROMPT:
        return [paths.artifact(item, repo)]
    return [paths.partition(item, pid, repo) for pid in paths.run_prompt_ids(repo)]


def col_digest(col: pa.ChunkedArray) -> str:
    """sha256 (16 hex) of a column's values: the numpy buffer, or the JSON of its Python values."""
    col = col.combine_chunks()
    h = hashlib.sha256()
    try:
        arr = col.to_numpy(zero_copy_only=False)
        if arr.dtype == object:
            raise TypeError
        h.update(str(arr.dtype).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    except (TypeError, ValueError, pa.ArrowInvalid):   # lists, strings: through their Python values
        h.update(json.dumps(col.to_pylist(), ensure_ascii=False, default=str).encode())
    return h.hexdigest()[:16]

def main(root: Path) -> dict:
    """file -> column or tensor -> digest, for the data files present under root (an artifacts/ folder);
    keys are paths relative to root (a partition's: `logits/logits/prompt_id=<id>/logits.parquet`)."""
    out, repo = {}, root.parent
    for item, cols in FILES:
        for p in data_files(repo, item):
            if not p.exists():
                continue
            t = pq.read_table(p)
            rel = p.relative_to(root).as_posix()
            out[rel] = {c: col_digest(t[c]) for c in (cols or t.column_names) if c in t.column_names}
            out[rel]["_rows"] = t.num_rows
    for cap in data_files(repo, paths.CAPTURE):
        if cap.exists():
            import torch
            from safetensors.torch import load_file
            out[cap.relative_to(root).as_posix()] = {
                k: f"{hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]} "
                   f"{v.dtype} {list(v.shape)}" for k, v in sorted(load_file(str(cap)).items())}
    return out

if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1])), indent=1, sort_keys=True))
