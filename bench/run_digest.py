"""Content digests of a run's data files: per column (Parquet) and per tensor (safetensors).

Schema metadata, encodings, nullability and row-group layout are ignored: only the values
count, so two runs (or two versions of the code) can be compared number for number:

    python -m bench.run_digest artifacts > after.json && diff before.json after.json

bench/results/digests_0286aca_*.json hold the digests of the run before the library was
reorganised by role (commit 0286aca, this machine's CPU: AVX-512 + AMX-bf16, native kernels).
"""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FILES = {
    "tokenize/tokens.parquet": None,
    "logits/logits.parquet": None,
    "probs/table.parquet": None,
    "probs/filtered.parquet": None,
    "probs/prompt_metrics.parquet": None,
    "trajectories/steps.parquet": ["branch", "kv_cache", "step", "token_id", "logit", "prob", "rank", "top_ids",
                                   "top_logits", "top_probs"],
    "trajectories/step_logits.parquet": None,
    "trajectories/prompt_metrics.parquet": None,
}

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
    """file -> column or tensor -> digest, for the data files present under root (an artifacts/ folder)."""
    out = {}
    for rel, cols in FILES.items():
        p = root / rel
        if not p.exists():
            continue
        t = pq.read_table(p)
        out[rel] = {c: col_digest(t[c]) for c in (cols or t.column_names) if c in t.column_names}
        out[rel]["_rows"] = t.num_rows
    cap = root / "forward/capture.safetensors"
    if cap.exists():
        import torch
        from safetensors.torch import load_file
        out["forward/capture.safetensors"] = {
            k: f"{hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]} "
               f"{v.dtype} {list(v.shape)}" for k, v in sorted(load_file(str(cap)).items())}
    return out

if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1])), indent=1, sort_keys=True))
