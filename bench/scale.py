"""Bench measurements that need a fresh process: peak memory, prompt-length scale, stage isolation.

Peak memory is the process's resident high-water mark (VmHWM), reset after the model is
loaded (`/proc/self/clear_refs`), so "extra peak" is what one pass adds on top of the loaded
model; each contender runs in its own `python -m bench.scale` child, which prints one JSON
line. `bench_scale` runs the whole chain at growing prompt lengths (bench/chain_scale.py).
`bench_dvc` times `dvc repro` in a temporary git clone of the working tree against the same
stages in one process, for tiny_qwen2 and this workspace's model, and says where the
difference goes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import chain_scale
from bench.common import (
    Workspace,
    alternate,
    child,
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


KINDS = {"memory": _memory, "loaded": chain_scale.loaded_child, "chain": _chain, "tl": _transformer_lens,
         "imports": _imports}


def _main(spec: dict) -> None:
    if spec["kind"] == "imports":    # before anything else imports torch
        print(json.dumps(_imports(None, spec)))
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
    """The whole chain at growing prompt lengths (bench/chain_scale.py), per model of the plan."""
    from pipeline.model import loader
    section = res.sections.setdefault("scale", {})
    for key, lengths in plan.scale_lengths.items():
        if not any(lengths.values()):
            continue
        where = ws.root if key == "workspace" else tiny_workspace(ws, tmp)
        other = Workspace.open(where)
        if other.name in section:             # quick mode: the workspace model is tiny_qwen2 already
            continue
        tokenizer = loader.load_tokenizer(other.snapshot, other.cfg["model"].trust_remote_code)
        section[other.name] = chain_scale.measure_model(
            where, tmp / "scale", other.name, other.cfg["prompt"].text,
            other.cfg["model"].tokenizer.add_special_tokens, tokenizer, {k: list(v) for k, v in lengths.items() if v})
        section[other.name]["dtype"] = other.cfg["capture"].dtype
        chain_scale.record_ratios(res, section[other.name])


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


# issue 29's target for `dvc repro --force` over the one-process chain (an earlier 1.3, set in 635ecb7
# with no issue behind it, was never met: a fresh interpreter per stage cost 2.07)
DVC_TARGET = 1.5


def bench_dvc(ws, plan, res, tmp: Path) -> None:
    """`dvc repro --force` vs the same stages in one process, for tiny_qwen2 and this workspace's model."""
    section = res.sections.setdefault("dvc", {})
    for name in plan.dvc_models(ws.name):
        prepared = tiny_workspace(ws, tmp) if name == "tiny_qwen2" else ws.root
        section[name] = _dvc_one(name, prepared, plan, tmp / f"dvc_{name}")
        runs = section[name]["runs"]
        res.ratio(f"dvc_repro_vs_in_process[{name}]",
                  float(np.median([a / b for a, b in zip(runs["dvc_s"], runs["in_process_s"])])), DVC_TARGET,
                  f"dvc repro --force ({name}, stages after prepare_model) / the same stages in one fresh process",
                  "the price of stage isolation: interpreter starts, imports, model and tokenizer loads, dvc "
                  "(each stage a fresh interpreter, as DVC starts it)")


def _dvc_one(name: str, prepared: Path, plan, tmp: Path) -> dict:
    import yaml
    clone = worktree.clone_worktree(tmp / "clone")
    worktree.sh(clone, sys.executable, "-m", "pipeline.tools.cli", "compose", f"model={name}", env=OFFLINE)
    shutil.copytree(paths.stage_dir("prepare_model", prepared), paths.stage_dir("prepare_model", clone))
    worktree.sh(clone, "dvc", "repro", "validate", env=OFFLINE)   # prepare_model depends on its output
    worktree.sh(clone, "dvc", "commit", "--force", "prepare_model", env=OFFLINE)
    stages = plan.dvc_stages or tuple(s for s in yaml.safe_load((clone / "dvc.yaml").read_text())["stages"]
                                      if s != "prepare_model")
    scratch = scratch_workspace(clone, tmp / "in_process")
    dvc_runs, chain_runs = [], []
    for r in range(plan.reps_dvc):     # alternate: dvc, one-process chain (flipped every repetition)
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for k in order:
            if k == 0:
                dvc_runs.append(_timed_dvc(clone, dvc_command(plan.dvc_stages)))
            else:
                chain_runs.append(child(scratch, {"kind": "chain", "stages": list(stages)}, timeout=4 * 3600))
    imports = child(clone, {"kind": "imports"})
    timed = {s: stage_importtime(clone, s) for s in (IMPORTTIME_QUICK if plan.quick else stages)}
    return {"model": name, "command": " ".join(dvc_command(plan.dvc_stages)), "stages": list(stages),
            **_isolation(clone, stages, dvc_runs[-1], chain_runs[-1], imports, timed), "stage_imports": timed,
            "runs": {"dvc_s": [r["total_s"] for r in dvc_runs],
                     "in_process_s": [r["process_wall_s"] for r in chain_runs]}}


# --quick: one stage that must not load torch and one that runs the model (its inputs are there once
# the quick dvc section's tokenize and forward ran), not every stage again
IMPORTTIME_QUICK = ("logits", "forward")
HEAVY = ("torch", "transformers", "pandas", "pyarrow", "numpy", "matplotlib", "pydantic", "omegaconf", "hydra",
         "ray", "duckdb", "safetensors", "tokenizers", "dvc")
IMPORTTIME_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)$")


def parse_importtime(stderr: str) -> dict:
    """`python -X importtime` output -> the import time in seconds (the top-level imports' cumulative
    times; a nested import's is inside its parent's), the number of modules, each of HEAVY's own
    cumulative time where it was imported (under `-m stages.<stage>` it is nested in the stage's own
    modules), the five costliest top-level imports, and how many "import time:" lines did not parse.
    (CPython also times an import that fails, e.g. an optional one in a try; those count as modules.)"""
    top, names, heavy, odd = [], set(), {}, 0
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "imported package" in line:
            continue
        m = IMPORTTIME_LINE.match(line)
        if m is None:
            odd += 1
            continue
        cumulative, indent, name = int(m[2]), m[3], m[4]
        names.add(name)
        if not indent:                               # "| pkg": top level; "|   pkg": imported inside another
            top.append((cumulative, name))
        if name in HEAVY:
            heavy[name] = round(cumulative / 1e6, 3)
    top.sort(reverse=True)
    return {"import_s": round(sum(us for us, _ in top) / 1e6, 3), "modules": len(names),
            "heavy": [h for h in HEAVY if h in {n.split(".")[0] for n in names}],
            "heavy_s": {h: heavy[h] for h in HEAVY if h in heavy},
            "top": [{"module": n, "cumulative_s": round(us / 1e6, 3)} for us, n in top[:5]], "unparsed_lines": odd}


def stage_importtime(clone: Path, stage: str) -> dict:
    """The stage run once more in `clone` as DVC runs it (`python -m stages.<stage>`), under
    `python -X importtime`: what it imports, and what that costs, against its whole wall time."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", f"stages.{stage}"], cwd=clone,
                              capture_output=True, text=True, timeout=1800, env=worktree.tool_env(**OFFLINE))
    except subprocess.TimeoutExpired:
        return {"error": "did not finish in 1800 s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")][-20:]
        return {"error": f"exit {proc.returncode}: " + "\n".join(tail)}
    return {**parse_importtime(proc.stderr), "wall_s": round(wall, 3)}


def importtime_table(section: dict) -> str:
    """The printed per-stage import table of the dvc section's models."""
    lines = []
    for name, rec in section.items():
        if not isinstance(rec, dict) or not rec.get("stage_imports"):
            continue
        lines += [f"stage imports ({name}: python -X importtime -m stages.<stage>, each stage run once more, "
                  "alone, after the dvc runs)",
                  f"{'stage':<14} {'imports s':>9} {'wall s':>7} {'modules':>7} {'torch s':>8} {'transf. s':>9}  "
                  "other heavy packages", "-" * 100]
        for stage, r in rec["stage_imports"].items():
            if "error" in r:
                lines.append(f"{stage:<14} failed: {r['error'].splitlines()[-1] if r['error'] else ''}")
                continue
            t = {h: "-" if h not in r["heavy_s"] else f"{r['heavy_s'][h]:.2f}" for h in ("torch", "transformers")}
            others = [h for h in r["heavy"] if h not in ("torch", "transformers")]
            lines.append(f"{stage:<14} {r['import_s']:>9.2f} {r['wall_s']:>7.2f} {r['modules']:>7} {t['torch']:>8} "
                         f"{t['transformers']:>9}  {','.join(others) or '-'}")
    return "\n".join(lines)


def _isolation(clone: Path, stages: tuple[str, ...], d: dict, c: dict, imports: dict, timed: dict) -> dict:
    """Where dvc's extra time goes: per stage, its wall time under dvc minus the same stage in the
    one-process chain; overall, interpreter starts + imports (a stage's own -X importtime figure where
    `timed` has one, else a process importing torch and transformers), repeated loads, dvc itself, the rest."""
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
    measured = {s: timed[s]["import_s"] for s in ran if "import_s" in timed.get(s, {})}
    parts = {"python_start_and_imports_s": sum(measured.get(s, start) for s in ran),
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
