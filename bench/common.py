"""What the bench sections share: plan and results, timing, the workspace, the in-process chain,
fresh-process measurements (time, peak memory) and the nnsight contender.

Timing runs contenders alternately (the order flips every repetition) and takes medians of
per-pair ratios, so load from other processes hits both sides of a pair. Peak memory is the
process's resident high-water mark (VmHWM), reset after the model is loaded
(`/proc/self/clear_refs`), so "extra peak" is what one pass adds on top of the loaded model.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.atomic import write_atomic
from pipeline.config import schema
from pipeline.errors import UserError, bad_value
from pipeline.model import capture, loader
from pipeline.store import paths
from tests.helpers import validated


@dataclass(frozen=True)
class Plan:
    """Repetitions and sizes: the default run fits well under an hour on a 2-core CPU; --quick is for tests."""

    quick: bool
    reps_forward: int          # capture / nnsight pairs
    reps_io: int
    reps_chain: int
    reps_dvc: int
    # "tiny_qwen2" | "workspace" (this workspace's model) -> capture.positions -> prompt lengths
    scale_lengths: dict
    dvc_stages: tuple[str, ...] | None = None   # None: every stage after prepare_model
    # set sizes of the `sets` section (bench/set_scale.py), and whether it runs them on Ray too
    set_sizes: tuple[int, ...] = (10, 100)
    set_ray: bool = False

    @classmethod
    def make(cls, quick: bool, lengths: tuple[int, ...] | None = None,
             workspace_lengths: tuple[int, ...] | None = None, last_lengths: tuple[int, ...] | None = None) -> Plan:
        if quick:
            return cls(True, 3, 2, 1, 1, {"workspace": {"all": lengths or (16, 64)}}, ("tokenize", "forward"))
        # The whole chain runs the model ~30 times per prompt (trajectories, checks): on 2 idle
        # cores gemma3_270m took 458 s at 4096 tokens and 1327 s at 8192 (positions=last), and
        # tiny_qwen2 at 4096 7 minutes on 2 loaded ones (bench/results/scale_chain_*.json); so the
        # default lengths stay short and longer ones are opt-in (--lengths, --workspace-lengths,
        # --last-lengths).
        return cls(False, 3, 3, 1, 3, {"tiny_qwen2": {"all": lengths or (32, 256, 1024)},
                                       "workspace": {"all": workspace_lengths or (), "last": last_lengths or ()}})

    def dvc_models(self, workspace_model: str) -> tuple[str, ...]:
        """Models the dvc section compares: this workspace's (quick), else tiny_qwen2 and this one."""
        if self.quick:
            return (workspace_model,)
        return tuple(dict.fromkeys(("tiny_qwen2", workspace_model)))


class Results:
    """Every ratio with its target and verdict, plus each section's details."""

    def __init__(self) -> None:
        self.ratios: dict[str, dict] = {}
        self.sections: dict[str, dict] = {}

    def ratio(self, name: str, value: float, target: float | None, what: str, note: str = "") -> None:
        finite = value is not None and math.isfinite(value)
        ok = None if target is None or not finite else bool(value <= target)   # not measured: no verdict
        self.ratios[name] = {"value": float(value) if finite else None, "target": target, "pass": ok,
                             "what": what, "note": note}


# ---------------------------------------------------------------- timing
def alternate(contenders: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall times per contender (and this process's CPU time under "<name>.cpu": it leaves out
    the moments the machine gave to others); the order flips every repetition."""
    names = list(contenders)
    for _ in range(warmup):
        for n in names:
            contenders[n]()
    times: dict[str, list[float]] = {k: [] for n in names for k in (n, f"{n}.cpu")}
    for r in range(reps):
        for n in (names if r % 2 == 0 else names[::-1]):
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            contenders[n]()
            times[n].append(time.perf_counter() - t0)
            times[f"{n}.cpu"].append(time.process_time() - c0)
    return times


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median of per-repetition ratios: a slow moment of the machine cancels within its pair."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def summary(times: dict[str, list[float]]) -> dict:
    return {n: {"median_s": statistics.median(t), "runs_s": [round(x, 4) for x in t]} for n, t in times.items()}


# ---------------------------------------------------------------- workspace
@dataclass
class Workspace:
    """This workspace's params, its prepared model, and (once loaded) the model and tokenizer."""

    root: Path
    params: dict
    snapshot: Path
    cfg: dict
    model: object = None
    tokenizer: object = None
    load_s: dict | None = None

    @classmethod
    def open(cls, root: Path) -> Workspace:
        root = Path(root).resolve()
        params = schema.read_params(root / paths.PARAMS)
        prepared = paths.stage_dir("prepare_model", root)
        if not (prepared / paths.SOURCE[1]).exists():
            raise UserError(f"{prepared} holds no prepared model: run `dvc repro prepare_model` first "
                            f"(the bench measures the model of this workspace)")
        source = json.loads((prepared / paths.SOURCE[1]).read_text(encoding="utf-8"))
        cfg = {n: schema.load_section(params, n) for n in ("model", "prompt", "capture", "probs", "sampling")}
        if source.get("name") != cfg["model"].name:
            raise UserError(f"{prepared} holds {source.get('name')} but params.yaml names {cfg['model'].name}: "
                            f"run `dvc repro prepare_model` (or `nexttoken compose model=...`) first")
        if cfg["prompt"].set is not None:     # the baseline script and the in-process chain take one prompt
            raise bad_value("prompt.set", cfg["prompt"].set, "null: the bench compares one prompt's chain with the "
                            f"plain-script baseline (compose one, e.g. `nexttoken compose model={source['name']}`)")
        return cls(root, params, loader.snapshot_dir(prepared, source).resolve(), cfg)

    @property
    def name(self) -> str:
        return self.cfg["model"].name

    def load(self) -> None:
        if self.model is None:
            cap = self.cfg["capture"]
            t0 = time.perf_counter()
            self.model = loader.load_model(self.snapshot, loader.resolve_dtype(cap.dtype),
                                           loader.resolve_device(cap.device), cap.attn_implementation,
                                           self.cfg["model"].trust_remote_code)
            t1 = time.perf_counter()
            self.tokenizer = loader.load_tokenizer(self.snapshot, self.cfg["model"].trust_remote_code)
            self.load_s = {"model": t1 - t0, "tokenizer": time.perf_counter() - t1}

    def input_ids(self) -> torch.Tensor:
        add = self.cfg["model"].tokenizer.add_special_tokens
        return torch.tensor([self.tokenizer(self.cfg["prompt"].text, add_special_tokens=add).input_ids])

    def spec(self, positions: str = "all") -> capture.CaptureSpec:
        return capture.CaptureSpec(self.cfg["capture"].attention_layers, positions)


# ---------------------------------------------------------------- the in-process chain
@contextlib.contextmanager
def shared_model(preloaded: dict | None = None):
    """`loader.load_model` / `load_tokenizer` memoized by resolved path: every stage of an
    in-process chain gets the same model object, loaded at most once."""
    cache = dict(preloaded or {})
    cache["calls"] = []             # ("model" | "tokenizer"), in call order: what each stage loads
    load_model, load_tokenizer = loader.load_model, loader.load_tokenizer

    def model(path, dtype, device, attn, trust, spread=False):
        cache["calls"].append("model")
        key = ("model", str(Path(path).resolve()), str(dtype), str(torch.device(device)), attn, trust)
        if spread:
            key += ("spread",)
        if key not in cache:
            cache[key] = load_model(path, dtype, device, attn, trust, spread=spread)
        return cache[key]

    def tokenizer(path, trust_remote_code=False):
        cache["calls"].append("tokenizer")
        key = ("tokenizer", str(Path(path).resolve()), trust_remote_code)
        if key not in cache:
            cache[key] = load_tokenizer(path, trust_remote_code)
        return cache[key]

    loader.load_model, loader.load_tokenizer = model, tokenizer
    try:
        yield cache
    finally:
        loader.load_model, loader.load_tokenizer = load_model, load_tokenizer


def preloaded(ws: Workspace) -> dict:
    cap, trust = ws.cfg["capture"], ws.cfg["model"].trust_remote_code
    return {("model", str(ws.snapshot), str(loader.resolve_dtype(cap.dtype)),
             str(loader.resolve_device(cap.device)), cap.attn_implementation, trust): ws.model,
            ("tokenizer", str(ws.snapshot), trust): ws.tokenizer}


def scratch_workspace(src_root: Path, dest: Path) -> Path:
    """params.yaml + a link to the prepared model: stages write here, never into the user's artifacts."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / paths.PARAMS).write_bytes((src_root / paths.PARAMS).read_bytes())
    link = paths.stage_dir("prepare_model", dest)
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(paths.stage_dir("prepare_model", src_root).resolve(), target_is_directory=True)
    return dest


def run_chain(root: Path, stages: tuple[str, ...], cache: dict | None = None) -> dict:
    """Run the stages' own `main()` in order in `root`, one process, shared model; time each."""
    times, notes, loads = {}, {}, {}
    old = Path.cwd()
    os.chdir(root)      # stages read params.yaml and write artifacts/ relative to the cwd
    try:
        with shared_model(cache) as shared:
            for name in stages:
                if name != "validate":
                    validated.ensure_here()       # as dvc repro runs validate first (no torch; about a second)
                t0 = time.perf_counter()
                notes[name] = _run_stage(name)
                times[name] = time.perf_counter() - t0
                loads[name] = sorted(set(shared["calls"]))
                shared["calls"].clear()
    finally:
        os.chdir(old)
    return {"stage_s": times, "total_s": sum(times.values()), "loads": loads,
            "notes": {k: v for k, v in notes.items() if v}}


def _run_stage(name: str) -> str:
    try:
        importlib.import_module(f"stages.{name}").main()
    except SystemExit as e:          # the checks stage exits 1 after writing failed error checks
        return f"exited with status {e.code}"
    return ""


def nnsight_contender(model, input_ids: torch.Tensor, attention_layers: tuple[int, ...]) -> Callable[[], dict]:
    """nnsight saving the tensors capture records at module boundaries, under capture's names:
    embed, every layer's resid_pre / attn_out / resid_mid / mlp_out / resid_post, attention
    weights of the given layers, layer 0's ln1 output and q/k/v projections (and q/k norms),
    the final norm output and the logits. Not reachable from a module (they live inside the
    attention function), so capture-only: layer 0's q/k after RoPE, its mask and z."""
    from nnsight import NNsight
    names = capture.family(model)
    lm = NNsight(model)

    def envoy(node, path: str):
        for part in path.split("."):
            node = getattr(node, part)
        return node

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    n_layers = len(capture.decoder_layers(model))
    layer0_proj = capture.layer0_projections(names)

    def run() -> dict:
        saved: dict = {}
        act = capture.act_name
        with torch.inference_mode(), lm.trace(input_ids, use_cache=False):   # in execution order
            saved[act("embed")] = envoy(lm, names.embed).output.save()
            for i in range(n_layers):
                layer = envoy(lm, names.layers)[i]
                saved[act("resid_pre", i)] = layer.input.save()
                attn = envoy(layer, names.attn)
                if i == 0:
                    saved[act("ln1_out", 0)] = envoy(layer, names.ln1).output.save()
                    for kind, path in layer0_proj:
                        saved[act(kind, 0)] = envoy(attn, path).output.save()
                if i in attention_layers:
                    saved[act("attn_weights", i)] = attn.output[1].save()
                saved[act("attn_out", i)] = first(envoy(layer, names.attn_out).output).save()
                saved[act("resid_mid", i)] = envoy(layer, names.resid_mid_reader).input.save()
                saved[act("mlp_out", i)] = first(envoy(layer, names.mlp_out).output).save()
                saved[act("resid_post", i)] = first(layer.output).save()
            saved[act("final_norm_out")] = envoy(lm, names.final_norm).output.save()
            saved[act("logits")] = lm.output.logits.save()
        return saved

    return run


# ---------------------------------------------------------------- the command
def write_json(path: Path, obj: dict) -> None:
    """Atomic: a temp file in the same folder, then a rename."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8"))


# ---------------------------------------------------------------- processes and memory
def child(cwd: Path, spec: dict, python: str | None = None, timeout: int = 1800, module: str = "bench.scale") -> dict:
    """Run one measurement (`python -m module SPEC`) in a fresh interpreter in `cwd`; its JSON result
    plus the wall time."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    # the child imports this checkout's bench/ (and, from another venv, its pipeline/) from any cwd
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    load_before, t0 = os.getloadavg(), time.perf_counter()
    proc = subprocess.run([python or sys.executable, "-m", module, json.dumps(spec)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench child {spec} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1]), "process_wall_s": round(wall, 3),
            "loadavg_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())}}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so later peaks exclude model loading."""
    Path("/proc/self/clear_refs").write_text("5")


def release_freed() -> None:
    """Give freed heap back to the OS (glibc), so RSS is what is live, not what malloc kept."""
    import ctypes
    import gc
    gc.collect()
    try:
        import pyarrow as pa
        pa.default_memory_pool().release_unused()
    except ImportError:
        pass
    with contextlib.suppress(OSError, AttributeError):    # not glibc: RSS keeps what malloc retained
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def peak_mb() -> float:
    return _status_kb("VmHWM") / 1024


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """Slope of log y over log x, least squares: the growth exponent (1 = linear)."""
    if len(xs) < 2 or not all(math.isfinite(y) and y > 0 for y in ys):
        return math.nan
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


