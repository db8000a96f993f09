"""Disk per prompt of a recorded run, per stage folder (docs/cost_and_scale.md, "Disk per prompt of a set").

`python bench/disk_per_prompt.py WORKSPACE [--before]`: the bytes of each stage folder's files divided by the
run's prompts, with the largest files. `--before` also writes, into a temporary folder, what the code before
issue 29 stored for the same numbers: table.parquet and filtered.parquet as the probs stage writes them
(`probs.read_table`, derived or stored), and step_logits.parquet in the long layout
(`logits_io.write_logits` over `logits_io.read_step_logits`'s rows), and prints their sizes per prompt.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.store import logits_io, paths
from pipeline.store.artifacts import read_json, read_manifest, tables_stored

STAGES = ("tokenize", "forward", "logits", "probs", "trajectories", "lens")


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main(root: Path, before: bool) -> None:
    ids = paths.run_prompt_ids(root)
    n, total = len(ids), 0
    print(f"{n} prompts")
    for stage in STAGES:
        folder = paths.stage_dir(stage, root)
        if not folder.exists():
            continue
        total += size(folder)
        files: dict[str, int] = {}
        for f in (f for f in folder.rglob("*") if f.is_file()):
            files[f.name] = files.get(f.name, 0) + f.stat().st_size
        largest = sorted(files.items(), key=lambda kv: -kv[1])[:4]
        print(f"{stage:13s} {size(folder) / n / 1e6:8.3f} MB/prompt  " +
              ", ".join(f"{k} {v / n / 1e6:.3f}" for k, v in largest))
    print(f"{'total':13s} {total / n / 1e6:8.3f} MB/prompt")
    if not before:
        return
    from pipeline.numerics import probs
    manifest, tmp = read_manifest("probs", root), Path(tempfile.mkdtemp())
    table = kept = steps_long = steps_now = stored = 0
    for pid in ids:
        t = probs.read_table(paths.lookup(root), pid, manifest)
        positions = read_json(paths.partition(paths.PROBS_SUMMARY, pid, root))["positions"]
        pq.write_table(t, tmp / "t.parquet", compression="zstd", row_group_size=t.num_rows // len(positions))
        table += (tmp / "t.parquet").stat().st_size
        pq.write_table(probs.read_table(paths.lookup(root), pid, manifest, paths.FILTERED), tmp / "f.parquet",
                       compression="zstd")
        kept += (tmp / "f.parquet").stat().st_size
        src = paths.partition(paths.STEP_LOGITS, pid, root)
        if not src.is_file():               # not stored (sampling.step_logits): nothing on disk to compare
            continue
        rows = logits_io.read_step_logits(src)
        meta = {k: v for k, v in pq.read_schema(src).metadata.items() if k != logits_io.STEP_META_KEY}
        logits_io.write_logits(tmp / "s.parquet", [(p, r) for _, p, r in rows], meta,
                               extra_schema=logits_io.STEP_KEY_SCHEMA, extra_values=[k for k, _, _ in rows])
        steps_long += (tmp / "s.parquet").stat().st_size
        steps_now += src.stat().st_size
        stored += 1
    k = max(stored, 1)
    print(f"before: table.parquet {table / n / 1e6:.3f}, filtered.parquet {kept / n / 1e6:.3f} MB/prompt "
          f"(stored: {tables_stored(manifest)}); step_logits.parquet per prompt that stores it "
          f"({stored} of {n}): long layout {steps_long / k / 1e6:.3f} MB, this layout {steps_now / k / 1e6:.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--before" in sys.argv[2:])
