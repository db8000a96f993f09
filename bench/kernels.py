"""Bench section `kernels`: what `capture.kernels=portable` costs against `native`, in bf16 and float32.

The pins must be in place before torch loads, so each contender is a fresh `python -m
bench.kernels SPEC` process that pins its mode first (`pipeline.kernels.pin`, as the stages
do), loads this workspace's model in the dtype and times captured forward passes (median of
`reps` after a warm-up). Native and portable processes alternate, the order flipping every
pair; the ratio is the median of per-pair ratios, and `_best` the ratio of the fastest passes
(the least disturbed, on a loaded machine). Information, no target: the cost is the machine's
(AVX-512 / AMX kernels given up for AVX2 ones; bf16 without native bf16 is slow).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

from pipeline import kernels

DTYPES = ("bfloat16", "float32")


def measure(spec: dict) -> dict:
    """In the child: pin, load the model in spec["dtype"], time spec["reps"] captured passes."""
    kernels.pin(spec["mode"])                      # before anything below imports torch
    from bench.common import Workspace
    from pipeline.model import capture, loader
    from pipeline.store import provenance

    ws = Workspace.open(Path.cwd())
    cap, trust = ws.cfg["capture"], ws.cfg["model"].trust_remote_code
    t0 = time.perf_counter()
    model = loader.load_model(ws.snapshot, loader.resolve_dtype(spec["dtype"]), "cpu", cap.attn_implementation, trust)
    ws.tokenizer = loader.load_tokenizer(ws.snapshot, trust)
    load_s, ids, names = time.perf_counter() - t0, ws.input_ids(), ws.spec()
    capture.run_capture(model, ids, names)          # warm-up: oneDNN builds its kernels on the first pass
    times = []
    for _ in range(spec["reps"]):
        t0 = time.perf_counter()
        capture.run_capture(model, ids, names)
        times.append(time.perf_counter() - t0)
    return {"mode": spec["mode"], "dtype": spec["dtype"], "n_tokens": ids.shape[1], "load_s": round(load_s, 3),
            "median_s": statistics.median(times), "runs_s": [round(t, 4) for t in times],
            "kernel_path": kernels.summary(provenance.kernel_path())}


def bench_kernels(ws, plan, res) -> None:
    """portable / native time of a captured forward pass, per dtype, fresh processes alternated."""
    from bench.common import child
    section = res.sections.setdefault("kernels", {"model": ws.name})
    refusal = kernels.portable_refusal(platform.machine(), kernels.cpu_flags(), {})
    if refusal:
        section["skipped"] = f"capture.kernels=portable has no meaning here: {refusal}"
        return
    pairs, reps = (1, 2) if plan.quick else (3, 5)
    for dtype in DTYPES:
        runs: dict[str, list[dict]] = {"native": [], "portable": []}
        for i in range(pairs):
            for mode in ("native", "portable")[:: 1 if i % 2 == 0 else -1]:
                runs[mode].append(child(ws.root, {"mode": mode, "dtype": dtype, "reps": reps}, module="bench.kernels"))
        ratio = statistics.median(p["median_s"] / n["median_s"] for n, p in zip(runs["native"], runs["portable"]))
        medians = {m: statistics.median(r["median_s"] for r in rs) for m, rs in runs.items()}
        best = {m: min(t for r in rs for t in r["runs_s"]) for m, rs in runs.items()}
        section[dtype] = {"ratio": ratio, "median_pass_s": medians, "best_pass_s": best, "runs": runs}
        what = (f"captured forward pass ({ws.name}, {runs['native'][0]['n_tokens']} tokens), "
                "capture.kernels=portable / native, fresh processes alternated")
        res.ratio(f"portable_vs_native[{dtype}]", ratio, None, what,
                  f"native {medians['native']:.3f} s ({runs['native'][0]['kernel_path']}), "
                  f"portable {medians['portable']:.3f} s")
        res.ratio(f"portable_vs_native_best[{dtype}]", best["portable"] / best["native"], None,
                  what + ": fastest pass of each", f"native {best['native']:.3f} s, portable {best['portable']:.3f} s")


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1])), default=str))
