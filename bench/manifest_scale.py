"""How a stage's manifest grows with the set: for N prompts, a forward-shaped manifest (the record shape of a
real one: two inputs and two outputs per prompt, each path, bytes, mtime, sha256, each prompt's facts and
seconds) written as a stage writes it (`Staging.write_json`: streamed `json.dump`, indent 2), then parsed by a
fresh interpreter as every later stage parses it (`json.load`), with that interpreter's peak RSS.

    python -m bench.manifest_scale [--sizes 1000 10000 100000] [--out artifacts/bench/manifest_scale.json]

Prints, per N: the file's MB, the write and parse seconds, the parsing process's peak RSS (MB, its start-up
subtracted), and the per-prompt figures a projection to larger N multiplies (docs/scale.md, "1,000,000
prompts on 16 nodes").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.store.staging import Staging

PARSE = """
import json, resource, sys, time
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
with open(sys.argv[1], encoding="utf-8") as f:
    m = json.load(f)
s = time.perf_counter() - t
print(json.dumps({"parse_s": s, "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
                  "outputs": len(m["outputs"])}))
"""


def _record(path: str, i: int) -> dict:
    h = hashlib.sha256(f"{path}{i}".encode()).hexdigest()
    return {"path": path, "bytes": 325800 + i, "mtime_ns": 1796524754297295743 + i, "sha256": h,
            "logical_sha256": h[::-1]}


def manifest(n: int) -> dict:
    ids = [f"q{i:07d}" for i in range(n)]
    return {
        "format_version": 4, "stage": "forward", "config": {}, "facts": {},
        "prompt_facts": {p: json.dumps({"n_tokens": 7, "output_size": 151936}) for p in ids},
        "inputs": [_record(f"artifacts/tokenize/tokens/prompt_id={p}/{name}", i)
                   for i, p in enumerate(ids) for name in ("tokens.parquet", "facts.json")],
        "outputs": [_record(f"artifacts/forward/{kind}/prompt_id={p}/{name}", i) for i, p in enumerate(ids)
                    for kind, name in (("capture", "capture.safetensors"), ("facts", "facts.json"))],
        "prompt_seconds": {p: 0.0123456 for p in ids},
    }


def write(n: int, folder: Path) -> dict:
    """In this process: build the manifest and write it as a stage does; the seconds and this process's peak."""
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    path = Staging(folder).write_json(f"manifest_{n}.json", manifest(n))
    return {"path": str(path), "write_s": time.perf_counter() - t,
            "write_peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}


def measure(n: int, folder: Path) -> dict:
    """Write (a fresh interpreter building and writing it) and parse (another), as two stages would."""
    def run(*argv: str) -> dict:
        out = subprocess.run([sys.executable, *argv], check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    wrote = run("-m", "bench.manifest_scale", "--write", str(n), "--folder", str(folder))
    path = Path(wrote.pop("path"))
    got = run("-c", PARSE, str(path))
    size = path.stat().st_size
    path.unlink()
    return {"n": n, "mb": size / 1e6, **wrote, **got, "kb_per_prompt": size / 1e3 / n,
            "parse_us_per_prompt": got["parse_s"] / n * 1e6, "parse_peak_kb_per_prompt": got["peak_mb"] * 1024 / n,
            "write_peak_kb_per_prompt": wrote["write_peak_mb"] * 1024 / n}


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a set size is an integer >= 1")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=_positive, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--out", type=Path, default=Path("artifacts/bench/manifest_scale.json"))
    ap.add_argument("--write", type=int, help=argparse.SUPPRESS)       # the writer's own process
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write:
        print(json.dumps(write(args.write, args.folder)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            rows.append(measure(n, Path(tmp)))
            r = rows[-1]
            print(f"N={n:>8}: {r['mb']:9.1f} MB; write {r['write_s']:7.2f} s, peak {r['write_peak_mb']:8.1f} MB; "
                  f"parse {r['parse_s']:7.2f} s, peak {r['peak_mb']:8.1f} MB; per prompt: {r['kb_per_prompt']:.2f} "
                  f"KB, write {r['write_peak_kb_per_prompt']:.2f} KB RSS, parse {r['parse_us_per_prompt']:.1f} us "
                  f"and {r['parse_peak_kb_per_prompt']:.2f} KB RSS", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
