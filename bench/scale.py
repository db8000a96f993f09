"""Bench measurements that need a fresh process: peak memory, prompt-length scale, stage isolation.

Peak memory is the process's resident high-water mark (VmHWM), reset after the model is
loaded (`/proc/self/clear_refs`), so "extra peak" is what one pass adds on top of the loaded
model; each contender and each prompt length runs in its own `python -m bench.scale`
child, which prints one JSON line. `bench_dvc` times `dvc repro` in a temporary git clone of
the working tree against the same stages in one process, and says where the difference goes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import (
    Workspace,
    alternate,
    child,
    fit_exponent,
    nnsight_contender,
    paired_ratio,
    peak_mb,
    preloaded,
    release_freed,
    reset_peak,
    rss_mb,
    run_chain,
    scratch_workspace,
    summary,
)
from pipeline.store import paths
from tests.helpers import worktree

TL_PYTHON_ENV = "NEXTTOKEN_BENCH_TL_PYTHON"   # an interpreter with transformer_lens, if not this one
OFFLINE = {"HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}   # for the tools run in clones and workspaces


# ---------------------------------------------------------------- child kinds
def _prompt_ids(ws, n: int):
    """`n` token ids: the reference prompt's text repeated, cut to length."""
    import torch
    add = ws.cfg["model"].tokenizer.add_special_tokens
    text = ws.cfg["prompt"].text
    per_copy = max(1, len(ws.tokenizer(text, add_special_tokens=False).input_ids))
    ids = ws.tokenizer(text * (n // per_copy + 2), add_special_tokens=add).input_ids[:n]
    return torch.tensor([ids])


def _memory(ws, spec: dict) -> dict:
    """One contender's pass after a warm-up: time and the peak RSS it adds."""
    from pipeline.model import capture
    ws.load()
    ids = ws.input_ids()
    if spec["contender"] == "nnsight":
        layers = ws.spec().resolve_layers(len(capture.decoder_layers(ws.model)))
        fn = nnsight_contender(ws.model, ids, layers)
    else:
        def fn():
            return capture.run_capture(ws.model, ids, ws.spec())
    fn()                   # warm-up: one-time allocations are not the pass's cost
    release_freed()
    base = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    kept = fn()            # kept alive until the peak is read: what a user holds afterwards
    took = time.perf_counter() - t0
    out = {"time_s": took, "rss_loaded_mb": base, "peak_mb": peak_mb(), "n_saved": len(kept)}
    return {**out, "extra_peak_mb": out["peak_mb"] - base}


def _scale(ws, spec: dict) -> dict:
    """One prompt length, fresh process: positions=last first (the smaller run, so its peak is
    clean), then the default capture (all positions). Each: forward with capture, the forward
    stage's capture.safetensors, the logits Parquet; time and peak RSS above the loaded model."""
    from pipeline.model import capture
    code = code_digest()        # the code this child imported (others may edit the tree between children)
    t0 = time.perf_counter()
    ws.load()
    load_s = time.perf_counter() - t0
    ids = _prompt_ids(ws, spec["length"])
    with tempfile.TemporaryDirectory() as d:
        _forward_and_dump(ws, _prompt_ids(ws, 8), "all", Path(d))   # warm-up: imports, pools, kernels
    passes = {pos: _measured_pass(ws, ids, pos) for pos in ("last", "all")}
    # Times: the fastest of `reps` passes (one slow moment of a shared machine is not growth);
    # memory: the first pass. Then the model's own cost at this length, for comparison. CPU time
    # (all threads) beside wall time: on a shared machine it moves far less with the others' load.
    for pos, first in passes.items():
        more = [_measured_pass(ws, ids, pos) for _ in range(spec.get("reps", 1) - 1)]
        times, cpus = [first["time_s"]] + [r["time_s"] for r in more], [first["cpu_s"]] + [r["cpu_s"] for r in more]
        first.update(time_s=min(times), time_runs_s=times, cpu_s=min(cpus), cpu_runs_s=cpus)
    plain, plain_cpu = [], []
    for _ in range(spec.get("reps", 1)):
        t, c = time.perf_counter(), time.process_time()
        capture.plain_forward_logits(ws.model, ids, "all")
        plain.append(time.perf_counter() - t)
        plain_cpu.append(time.process_time() - c)
    return {"length": ids.shape[1], "code_sha256": code, "load_s": load_s, "plain_forward_s": min(plain),
            "plain_forward_cpu_s": min(plain_cpu), **passes}


def code_digest() -> str:
    """sha256 over the library's and the bench's .py files (path and bytes, in path order)."""
    import hashlib
    h = hashlib.sha256()
    repo = Path(__file__).resolve().parents[1]
    for f in sorted([*(repo / "pipeline").rglob("*.py"), *(repo / "bench").glob("*.py")]):
        h.update(f.relative_to(repo).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _measured_pass(ws, ids, positions: str) -> dict:
    from pipeline.model import capture
    release_freed()
    base = rss_mb()
    phases, peaks, cpu = {}, {}, {}
    with tempfile.TemporaryDirectory() as d:
        def phase(name, fn):
            reset_peak()
            t, c = time.perf_counter(), time.process_time()
            result = fn()
            phases[f"{name}_s"], peaks[f"{name}_mb"] = time.perf_counter() - t, peak_mb() - base
            cpu[f"{name}_cpu_s"] = time.process_time() - c
            return result
        tensors = phase("forward", lambda: capture.run_capture(ws.model, ids, ws.spec(positions)))
        phase("save_capture", lambda: _save(tensors, ids, Path(d)))
        phase("logits_dump", lambda: _dump(tensors, ids, positions, Path(d)))
    sizes = {k: v.numel() * v.element_size() / 2**20 for k, v in tensors.items()}
    attn = sum(v for k, v in sizes.items() if k.endswith("attn_weights"))
    logits = sizes[capture.act_name("logits")]
    return {"rss_loaded_mb": base, **phases, "time_s": sum(phases.values()), **cpu, "cpu_s": sum(cpu.values()), **peaks,
            "extra_peak_mb": max(peaks.values()),
            "captured_mb": {"logits": logits, "attn_weights": attn, "other": sum(sizes.values()) - attn - logits}}


def _save(tensors: dict, ids, where: Path) -> None:
    from pipeline.model import forward
    forward.save_capture(forward.ForwardResult({**tensors, "input_ids": ids}, {}), where / "capture.safetensors")


def _dump(tensors: dict, ids, positions: str, where: Path) -> None:
    from pipeline.model import capture, forward
    from pipeline.store import logits_io
    rows = forward.logit_rows({"logit_positions": forward.logit_positions(positions, ids.shape[1])},
                              tensors[capture.act_name("logits")][0])
    logits_io.write_logits(where / "logits.parquet", rows, {b"bench": b"1"})


def _forward_and_dump(ws, ids, positions: str, where: Path) -> None:
    from pipeline.model import capture
    tensors = capture.run_capture(ws.model, ids, ws.spec(positions))
    _save(tensors, ids, where)
    _dump(tensors, ids, positions, where)


def _chain(ws, spec: dict) -> dict:
    """The in-process chain in a fresh process: one interpreter, one model load."""
    t0 = time.perf_counter()
    ws.load()
    load_s = time.perf_counter() - t0
    result = run_chain(ws.root, tuple(spec["stages"]), preloaded(ws))
    return {**result, "load_s": ws.load_s, "load_total_s": load_s}


def _transformer_lens(ws, spec: dict) -> dict:
    """TransformerLens 4.x (TransformerBridge) on the same snapshot, offline: time vs capture, peak RSS."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError as e:
        return {"available": False, "reason": f"transformer_lens not importable: {e}"}
    import torch

    from pipeline.model import capture, loader
    ws.load()
    ids = ws.input_ids()
    cap = ws.cfg["capture"]
    # The bridge rebuilds the HF model's modules in place (capture can no longer hook it): a second copy.
    hf = loader.load_model(ws.snapshot, loader.resolve_dtype(cap.dtype), "cpu", cap.attn_implementation, False)
    bridge = TransformerBridge.boot_transformers(str(ws.snapshot), hf_model=hf, tokenizer=ws.tokenizer,
                                                 device="cpu", dtype=loader.resolve_dtype(cap.dtype))
    n = len(capture.decoder_layers(ws.model))
    layers = ws.spec().resolve_layers(n)
    names = ["hook_embed", "ln_final.hook_out", *[f"blocks.{i}.hook_resid_post" for i in range(n)],
             *[f"blocks.{i}.attn.hook_pattern" for i in layers]]

    def tl():
        with torch.inference_mode():
            return bridge.run_with_cache(ids, names_filter=names)

    logits, cache = tl()
    del cache
    release_freed()
    base = rss_mb()
    reset_peak()
    kept = tl()
    extra = peak_mb() - base
    times = alternate({"capture": lambda: capture.run_capture(ws.model, ids, ws.spec()), "tl": tl},
                            spec["reps"], warmup=0)
    plain = capture.plain_forward_logits(ws.model, ids, "all")
    from importlib.metadata import version
    return {"available": True, "version": version("transformer-lens"),
            "loader": "TransformerBridge.boot_transformers(snapshot_dir, hf_model=model, tokenizer=...)",
            "offline_load": "ok", "n_cached": len(kept[1]), "cached": sorted(kept[1].keys()),
            "logits_equal_plain_forward": bool(torch.equal(logits, plain)),
            "extra_peak_mb": extra, "capture_vs_tl_time": paired_ratio(times, "capture", "tl"),
            **summary(times),
            "note": "HookedTransformer (and from_pretrained) were removed in TransformerLens 4.0; "
                    "the bridge keeps HF weights and numerics"}


def _imports(ws, spec: dict) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    return {"import_torch_transformers_s": time.perf_counter() - t0}


def _table(spec: dict) -> dict:
    """`python -m bench.scale '{"kind": "table", "lengths": [...], "reps": N}'` in a workspace:
    its scale runs and fits (as `nexttoken bench --only scale` records them), with the load average,
    the code's commit and the machine; the table is printed to stderr."""
    from pipeline.store import provenance
    ws = Workspace.open(Path.cwd())
    load, code = os.getloadavg(), {"pipeline": str(Path(__file__).resolve().parents[1] / "pipeline"),
                                   **provenance.git_state(worktree.ROOT), "sha256": code_digest()}
    result = measure_scale(ws.root, spec["lengths"], spec.get("reps", 1), ws.cfg["capture"].dtype)
    code["same_in_every_child"] = all(r.get("code_sha256") == code["sha256"] for r in result["runs"])
    out = {"model": ws.name, "workspace": str(ws.root), **result,
           "loadavg_1_5_15": {"start": list(load), "end": list(os.getloadavg())},
           "code": code, "hardware": provenance.hardware()}
    print(scale_table({ws.name: result}), file=sys.stderr)
    return out


KINDS = {"memory": _memory, "scale": _scale, "chain": _chain, "tl": _transformer_lens, "imports": _imports}


def _main(spec: dict) -> None:
    if spec["kind"] == "imports":    # before anything else imports torch
        print(json.dumps(_imports(None, spec)))
        return
    if spec["kind"] == "table":      # the parent of the per-length children: loads no model itself
        print(json.dumps(_table(spec), default=str))
        return
    ws = Workspace.open(Path.cwd())
    print(json.dumps(KINDS[spec["kind"]](ws, spec), default=str))


# ---------------------------------------------------------------- sections
def tiny_workspace(ws, tmp: Path) -> Path:
    """A workspace holding a prepared tiny_qwen2 (this one, if it already is)."""
    if ws.name == "tiny_qwen2":
        return ws.root
    dest = tmp / "tiny_ws"
    if not paths.artifact(paths.SOURCE, dest).exists():
        shutil.copytree(worktree.ROOT / "conf", dest / "conf", dirs_exist_ok=True)
        worktree.sh(dest, sys.executable, "-m", "pipeline.tools.cli", "compose", "model=tiny_qwen2", env=OFFLINE)
        worktree.sh(dest, sys.executable, "-m", "stages.prepare_model", env=OFFLINE)
    return dest


def bench_scale(ws, plan, res, tmp: Path) -> None:
    section = res.sections.setdefault("scale", {})
    for key, lengths in plan.scale_lengths.items():
        where = ws.root if key == "workspace" else tiny_workspace(ws, tmp)
        name = ws.name if key == "workspace" else key
        if name in section or not lengths:     # quick mode: the workspace model is tiny_qwen2 already
            continue
        section[name] = measure_scale(where, lengths, 1 if plan.quick else 2, ws.cfg["capture"].dtype)
        fits = section[name]["fits"]
        for kind in ("time", "memory"):
            res.ratio(f"scale_{kind}_exponent[{name}]", fits["all"][f"{kind}_exponent"], 1.15,
                      f"log-log slope of {kind} (forward + capture file + logits.parquet) over lengths "
                      f"{list(lengths)}, default capture", "memory = peak RSS above the loaded model")
        res.ratio(f"scale_plain_forward_time_exponent[{name}]", fits["plain_forward_time_exponent"], None,
                  "log-log slope of a hook-free forward alone: the model's own growth on this machine",
                  "information")
        for kind in ("time", "memory"):
            res.ratio(f"scale_{kind}_exponent_last[{name}]", fits["last"][f"{kind}_exponent"], None,
                      "the same with capture.positions=last (logits_to_keep=1)", "information")


def measure_scale(where: Path, lengths, reps: int, dtype: str) -> dict:
    """The scale runs of the workspace `where`, one fresh child process per length, and their fits."""
    lengths = list(lengths)
    # A long prompt on a slow CPU takes long (gemma3_270m in bf16 on AVX2: most of an hour at 4096):
    # the timeout is only a guard against a hung child.
    runs = []
    for n in lengths:
        runs.append(child(where, {"kind": "scale", "length": n, "reps": reps}, timeout=4 * 3600))
        # printed as it comes: kept if a longer one fails
        print(f"[scale] T={n}: {json.dumps(runs[-1], default=str)}", file=sys.stderr, flush=True)
    out = {"lengths": lengths, "dtype": dtype, "reps": reps, "runs": runs, "fits": scale_fits(lengths, runs)}
    if len(lengths) >= 3:   # fixed overhead dominates the shortest length: the slope without it too
        out["fits_without_shortest"] = {"lengths": lengths[1:], **scale_fits(lengths[1:], runs[1:])}
    return out


def scale_fits(lengths: list[int], runs: list[dict]) -> dict:
    """Growth exponents (log-log slopes) of time, CPU time and memory over `lengths`, per positions."""
    def fit(values):
        return fit_exponent(lengths, values)
    fits = {pos: {"time_exponent": fit([r[pos]["time_s"] for r in runs]),
                  "cpu_time_exponent": fit([r[pos].get("cpu_s", math.nan) for r in runs]),
                  "memory_exponent": fit([r[pos]["extra_peak_mb"] for r in runs]),
                  "memory_exponent_absolute_peak": fit([r[pos]["rss_loaded_mb"] + r[pos]["extra_peak_mb"]
                                                        for r in runs])}
            for pos in ("all", "last")}
    fits["plain_forward_time_exponent"] = fit([r["plain_forward_s"] for r in runs])
    fits["plain_forward_cpu_time_exponent"] = fit([r.get("plain_forward_cpu_s", math.nan) for r in runs])
    return fits


def scale_table(section: dict) -> str:
    """Per model and length: time (wall and CPU) and extra peak memory, all positions and last only, and the fits."""
    lines = []
    for name, s in section.items():
        if not isinstance(s, dict) or "runs" not in s:
            continue
        lines += [f"scale {name} ({s['dtype']}): forward + capture.safetensors + logits.parquet, "
                  "fresh process per length",
                  f"{'T':>8} {'all: s':>8} {'all: cpu':>8} {'all: +MB':>9} {'last: s':>8} {'last: +MB':>9} "
                  f"{'plain fwd s':>11}  dominant capture (all)"]
        for r in s["runs"]:
            a, last = r["all"], r["last"]
            top = max(a["captured_mb"], key=a["captured_mb"].get)
            lines.append(f"{r['length']:>8} {a['time_s']:>8.2f} {a.get('cpu_s', math.nan):>8.2f} "
                         f"{a['extra_peak_mb']:>9.0f} {last['time_s']:>8.2f} {last['extra_peak_mb']:>9.0f} "
                         f"{r['plain_forward_s']:>11.2f}  {top} {a['captured_mb'][top]:.0f} MB")
        for label, f in (("exponent", s["fits"]), (f"from {s['lengths'][1] if len(s['lengths']) > 1 else ''}",
                                                    s.get("fits_without_shortest"))):
            if f:
                lines.append(f"{label:>8} {f['all']['time_exponent']:>8.2f} "
                             f"{f['all'].get('cpu_time_exponent', math.nan):>8.2f} {f['all']['memory_exponent']:>9.2f} "
                             f"{f['last']['time_exponent']:>8.2f} {f['last']['memory_exponent']:>9.2f} "
                             f"{f['plain_forward_time_exponent']:>11.2f}")
    return "\n".join(lines)


def dvc_command(stages: tuple[str, ...] | None) -> list[str]:
    """Every stage after prepare_model (warm: the model is prepared), or just the named ones."""
    if stages is None:
        return ["dvc", "repro", "--force", "--downstream", "tokenize"]
    return ["dvc", "repro", "--force", "--single-item", *stages]


def _timed_dvc(clone: Path, cmd: list[str]) -> dict:
    """Run dvc; stage boundaries are timed from its own "Running stage" lines, read as they come."""
    env = worktree.tool_env(PYTHONUNBUFFERED="1", **OFFLINE)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=clone, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks, log = [], []
    for line in proc.stdout:
        log.append(line)
        if line.startswith("Running stage '"):
            marks.append((line.split("'")[1], time.perf_counter() - t0))
    rc = proc.wait()
    total = time.perf_counter() - t0
    walls = {name: (marks[i + 1][1] if i + 1 < len(marks) else total) - start for i, (name, start) in enumerate(marks)}
    return {"rc": rc, "total_s": total, "stage_wall_s": walls, "before_first_stage_s": marks[0][1] if marks else total,
            "log_tail": "".join(log[-15:]) if rc else ""}


def bench_dvc(ws, plan, res, tmp: Path) -> None:
    import yaml
    clone = worktree.clone_worktree(tmp / "clone")
    worktree.sh(clone, sys.executable, "-m", "pipeline.tools.cli", "compose", "model=tiny_qwen2", env=OFFLINE)
    shutil.copytree(paths.stage_dir("prepare_model", tiny_workspace(ws, tmp)), paths.stage_dir("prepare_model", clone))
    worktree.sh(clone, "dvc", "repro", "validate", env=OFFLINE)   # prepare_model depends on its output
    worktree.sh(clone, "dvc", "commit", "--force", "prepare_model", env=OFFLINE)
    stages = plan.dvc_stages or tuple(s for s in yaml.safe_load((clone / "dvc.yaml").read_text())["stages"]
                                      if s != "prepare_model")
    scratch = scratch_workspace(clone, tmp / "dvc_inprocess")
    dvc_runs, chain_runs = [], []
    for r in range(plan.reps_dvc):     # alternate: dvc, one-process chain (flipped every repetition)
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for k in order:
            if k == 0:
                dvc_runs.append(_timed_dvc(clone, dvc_command(plan.dvc_stages)))
            else:
                chain_runs.append(child(scratch, {"kind": "chain", "stages": list(stages)}))
    imports = child(clone, {"kind": "imports"})
    res.sections["dvc"] = {"model": "tiny_qwen2", "command": " ".join(dvc_command(plan.dvc_stages)),
                           "stages": list(stages), **_isolation(clone, stages, dvc_runs[-1], chain_runs[-1], imports),
                           "runs": {"dvc_s": [r["total_s"] for r in dvc_runs],
                                    "in_process_s": [r["process_wall_s"] for r in chain_runs]}}
    res.ratio("dvc_repro_vs_in_process", float(np.median([a["total_s"] / b["process_wall_s"]
                                                          for a, b in zip(dvc_runs, chain_runs)])), None,
              "dvc repro --force (tiny_qwen2, stages after prepare_model) / the same stages in one fresh process",
              "information: the price of stage isolation")


def _isolation(clone: Path, stages: tuple[str, ...], d: dict, c: dict, imports: dict) -> dict:
    """Where dvc's extra time goes: per stage, its wall time under dvc minus the same stage in the
    one-process chain; overall, interpreter starts + imports, repeated loads, dvc itself, the rest."""
    manifests = {s: json.loads(paths.manifest_path(s, clone).read_text())
                 for s in stages if paths.manifest_path(s, clone).exists()}
    per_stage = {s: {"wall_in_dvc_s": d["stage_wall_s"].get(s), "in_process_s": c["stage_s"].get(s),
                     "isolation_s": d["stage_wall_s"][s] - c["stage_s"].get(s, 0.0) if s in d["stage_wall_s"] else None,
                     "inside_stage_run_s": manifests[s]["duration_s"] if s in manifests else None,
                     "loads": c["loads"].get(s, []),
                     "hashes_model_snapshot": s in manifests and any(
                         "model.safetensors" in i["path"] for i in manifests[s]["inputs"])}
                 for s in stages}
    ran = [s for s in stages if s in d["stage_wall_s"]]
    start = imports["process_wall_s"]
    n_model = sum("model" in per_stage[s]["loads"] for s in ran)
    n_tok = sum("tokenizer" in per_stage[s]["loads"] for s in ran)
    parts = {"python_start_and_imports_s": len(ran) * start,
             "model_reloads_s": max(0, n_model - 1) * c["load_s"]["model"],
             "tokenizer_reloads_s": max(0, n_tok - 1) * c["load_s"]["tokenizer"],
             "dvc_before_first_stage_s": d["before_first_stage_s"]}
    extra = d["total_s"] - c["process_wall_s"]
    parts["rest_s"] = extra - sum(parts.values())   # dvc hashing/caching outputs, lazy imports, cold starts
    # The same extra split at the stage_run boundary: before/after it (interpreter, module imports,
    # dvc saving outputs) vs inside it beyond the warm in-process time (loads, lazy imports, cold process).
    split = {"outside_stage_run_s": sum(v["wall_in_dvc_s"] - v["inside_stage_run_s"] for v in per_stage.values()
                                        if v["wall_in_dvc_s"] is not None and v["inside_stage_run_s"] is not None),
             "inside_stage_run_beyond_in_process_s": sum(
                 v["inside_stage_run_s"] - v["in_process_s"] for v in per_stage.values()
                 if v["inside_stage_run_s"] is not None and v["in_process_s"] is not None)}
    return {"rc": d["rc"], "log_tail": d["log_tail"], "dvc_total_s": d["total_s"],
            "in_process_total_s": c["process_wall_s"], "in_process_notes": c["notes"],
            "python_start_plus_import_torch_transformers_s": start, "load_s": c["load_s"],
            "per_stage": per_stage, "extra_s": extra, "extra_breakdown": parts, "extra_split": split,
            "processes_started": len(ran), "model_loading_stages": n_model, "tokenizer_loading_stages": n_tok}


def transformer_lens(root: Path, plan) -> dict:
    python = os.environ.get(TL_PYTHON_ENV) or None
    if python is None and importlib.util.find_spec("transformer_lens") is None:
        return {"available": False, "python": sys.executable,
                "reason": f"transformer_lens is not installed here (it is not a nexttoken dependency); "
                          f"pip install transformer_lens (4.x keeps torch as pinned), or point {TL_PYTHON_ENV} "
                          "at an interpreter that has it"}
    try:
        return {"python": python or sys.executable, **child(root, {"kind": "tl", "reps": plan.reps_forward},
                                                           python=python)}
    except RuntimeError as e:
        return {"available": False, "python": python or sys.executable, "reason": str(e)[-1500:]}


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
