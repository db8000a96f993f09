"""Same bytes out: one config run through `dvc repro` at two revisions of the code, every output file's
sha256 compared (issue 45: the stage layer redesigned, the numbers untouched).

    python -m bench.same_bytes BEFORE AFTER [--model tiny_qwen2] [--set N] [--out FILE.json]
                               [--work DIR [--only-before]]

Each revision is cloned from this checkout into a temporary folder, composed with the same overrides
(`--set N`: a set of N generated prompts, `capture.positions=last`) and run with `dvc repro`, this
interpreter's environment first on PATH. Data files are compared byte for byte; manifests (which record
when, where and by which code a stage ran) are compared field by field, and the fields that differ are
listed. The report and the explorer pages show each stage's run facts (created, duration, commit), so
they differ between any two runs: BEFORE is run twice (the control), and a file that differs between
those two runs is listed apart, with the lines of text that differ between BEFORE and AFTER. A Parquet
file whose table (schema and every value) is equal and whose metadata differs is listed apart too, with the
metadata keys that differ (a change that renames what the run records, e.g. the source kind). Exit
status 1 when any other file differs or exists at one revision only (a file the later revision adds is
listed, and counts only with --strict).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_FACTS = {"created_at", "duration_s", "timings", "git", "libraries", "hardware", "python_executable"}


def _sh(cwd: Path, *cmd: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd} ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return proc.stdout


def run(rev: str, dest: Path, overrides: list[str], n_set: int) -> Path:
    done = dest / ".same-bytes-done"
    if done.exists() and done.read_text() == json.dumps([rev, overrides, n_set]):
        return dest                 # made by an earlier call with --work (the same revision and config)
    shutil.rmtree(dest, ignore_errors=True)
    _sh(ROOT, "git", "clone", "-q", "--no-checkout", str(ROOT), str(dest))
    _sh(dest, "git", "checkout", "-q", rev)
    if n_set:
        subjects = ("the sea", "a cat", "the moon", "bread", "a river")
        (dest / "prompts/same_bytes.jsonl").write_text("".join(
            json.dumps({"id": f"s{i:03d}", "text": f"Line {i}: {subjects[i % 5]} is"}) + "\n" for i in range(n_set)),
            encoding="utf-8")
        overrides = [*overrides, "prompt=concepts", "prompt.set=prompts/same_bytes.jsonl", "capture.positions=last"]
    _sh(dest, sys.executable, "-m", "pipeline.tools.cli", "compose", *overrides)
    _sh(dest, "dvc", "repro")
    done.write_text(json.dumps([rev, overrides, n_set]))
    return dest


def files(repo: Path) -> dict[str, str]:
    out = {}
    for p in sorted((repo / "artifacts").rglob("*")):
        if p.is_file() and p.name != ".gitignore":
            out[p.relative_to(repo).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def manifest_fields(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if k not in RUN_FACTS and a.get(k) != b.get(k))


def _changed_lines(a: Path, b: Path, limit: int = 6) -> list[str]:
    try:
        la, lb = a.read_text(encoding="utf-8").splitlines(), b.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        return ["(binary)"]
    import difflib
    out = [line[:160] for line in difflib.unified_diff(la, lb, lineterm="", n=0)
           if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def _flat(d, prefix: str = "") -> dict:
    if not isinstance(d, dict):
        return {prefix: d}
    return {k: v for key, value in d.items() for k, v in _flat(value, f"{prefix}.{key}" if prefix else key).items()}


def parquet_metadata_only(a: Path, b: Path) -> list[str] | None:
    """The metadata keys two Parquet files differ in when their tables (schema and every value) are equal;
    None when the tables differ or either is no Parquet file."""
    if a.suffix != ".parquet":
        return None
    import pyarrow.parquet as pq
    ta, tb = pq.read_table(a), pq.read_table(b)
    if not ta.equals(tb, check_metadata=False):
        return None
    ma, mb = ({k.decode(): json.loads(v) for k, v in (t.schema.metadata or {}).items()} for t in (ta, tb))
    fa, fb = _flat(ma), _flat(mb)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


def compare(before: Path, after: Path, control: Path | None = None) -> dict:
    fa, fb = files(before), files(after)
    fc = files(control) if control else fa
    data = [k for k in sorted(set(fa) | set(fb)) if not k.endswith("/manifest.json")]
    res = {"same": [], "differ": [], "only_before": [], "only_after": [], "run_facts": {}, "manifest_fields": {},
           "metadata_only": {}}
    for k in data:
        key = "same" if fa.get(k) == fb.get(k) else "only_before" if k not in fb else \
            "only_after" if k not in fa else "differ"
        if key == "differ" and fc.get(k) != fa.get(k):          # differs from run to run at the same code
            res["run_facts"][k] = _changed_lines(before / k, after / k)
            continue
        if key == "differ" and (keys := parquet_metadata_only(before / k, after / k)) is not None:
            res["metadata_only"][k] = keys         # every value equal: only what the file says of its run differs
            continue
        res[key].append(k)
    for k in sorted(set(fa) & set(fb)):
        if k.endswith("/manifest.json"):
            ma, mb = (json.loads((r / k).read_text()) for r in (before, after))
            if changed := manifest_fields(ma, mb):
                res["manifest_fields"][k] = changed
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--model", default="tiny_qwen2")
    ap.add_argument("--set", type=int, default=0, help="a set of N generated prompts (0: the configured prompt)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--strict", action="store_true", help="a file only the later revision writes fails too")
    ap.add_argument("--keep", action="store_true", help="keep the two clones")
    ap.add_argument("--work", type=Path, help="keep the runs in this folder and reuse those it holds (the same "
                                               "revision and config): BEFORE can be run ahead, with --only-before")
    ap.add_argument("--only-before", action="store_true", help="run BEFORE and its control only (with --work)")
    args = ap.parse_args()
    if args.only_before and not args.work:
        ap.error("--only-before needs --work DIR (where the runs are kept for the comparison)")
    tmp = args.work or Path(tempfile.mkdtemp(prefix="nexttoken-same-bytes-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        overrides = [f"model={args.model}", "capture.device=cpu"]
        before = run(args.before, tmp / "before", overrides, args.set)
        control = run(args.before, tmp / "control", overrides, args.set)
        if args.only_before:
            print(f"{args.before}: run twice in {tmp}")
            return 0
        after = run(args.after, tmp / "after", overrides, args.set)
        res = compare(before, after, control)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(tmp, ignore_errors=True)
    res.update(before=args.before, after=args.after, model=args.model, set=args.set)
    print(f"{args.model}{f', a set of {args.set}' if args.set else ''}: {args.before} -> {args.after}")
    print(f"  data files with the same sha256: {len(res['same'])}; differing: {len(res['differ'])}; "
          f"only before: {len(res['only_before'])}; only after: {len(res['only_after'])}")
    for key in ("differ", "only_before", "only_after"):
        for k in res[key]:
            print(f"  {key}: {k}")
    meta = sorted({f for v in res["metadata_only"].values() for f in v})
    print(f"  Parquet files with every value equal and metadata that differs: {len(res['metadata_only'])} "
          f"(keys: {', '.join(meta) or 'none'})")
    print(f"  files that differ between two runs of {args.before} too (they show run facts): {len(res['run_facts'])}")
    for k, lines in res["run_facts"].items():
        print(f"    {k}: " + " | ".join(lines))
    fields = sorted({f for v in res["manifest_fields"].values() for f in v})
    print(f"  manifest fields that differ (besides {', '.join(sorted(RUN_FACTS))}): {', '.join(fields) or 'none'}")
    for k, v in res["manifest_fields"].items():
        print(f"    {k}: {', '.join(v)}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    bad = res["differ"] or res["only_before"] or (args.strict and res["only_after"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
