"""`nexttoken bench`: what recording costs, as ratios against the plain alternatives.

Sections (`--only NAME` runs one):
  capture    run_capture vs a hook-free forward, same model and prompt        (target <= 1.10)
  logits_io  logits.parquet write + read vs pandas to_parquet + read_parquet   (target <= 0.5; size <= 0.6)
             of the same long table; numpy save + load and the size vs bf16 as information
  chain      the stages in one process, model loaded once, vs bench/baseline_script.py (<= 1.2);
             then the equivalence stage once, its time / the forward stage's (information)
  nnsight    capture vs nnsight (and TransformerLens when installed): time and peak memory (<= 1.0)
  dvc        `dvc repro` in a temp clone vs the same stages in one process, tiny_qwen2 and this
             workspace's model: the price of isolation                             (target <= 1.3)
  scale      the whole chain (tokenize -> report) at growing prompt lengths, each stage a fresh
             process: peak RSS above the loaded model <= 2.5 x 4*T*V, growth of the pipeline's
             own work <= 1.1 (bench/chain_scale.py)
  kernels    a captured pass with capture.kernels=portable vs native, bf16 and float32 (information)
  sets       (opt-in: --only sets) the chain over sets of N prompts on tiny_qwen2 (--sizes, default 10 100; --ray: also
             executor=ray, 2 local workers), each stage a fresh process: stage work per prompt
             (<= 0.25 s) and its ratio to a plain forward + decoding loop, peak RSS growth over N
             (<= 0.1), disk per prompt (<= 1.5 MB) (bench/set_scale.py)

Absolute times depend on the machine and its neighbours, so contenders run alternately
(the order flips every repetition) and ratios are medians of per-pair ratios: load from
other processes hits both sides of a pair. The model comes from this workspace's
artifacts/prepare_model. Results go to artifacts/bench/bench.json (written atomically);
the printed table holds the ratios, then the scale tables. Fresh-process measurements live in
`bench.scale` and `bench.chain_scale`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import (
    Plan,
    Results,
    Workspace,
    alternate,
    nnsight_contender,
    paired_ratio,
    preloaded,
    run_chain,
    scratch_workspace,
    summary,
    write_json,
)
from bench.kernels import bench_kernels
from pipeline.errors import UserError
from pipeline.model import capture
from pipeline.store import logits_io, paths

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "bench" / "baseline_script.py"
OUTPUT = Path(paths.ARTIFACTS) / "bench" / "bench.json"
SECTIONS = ("capture", "logits_io", "chain", "nnsight", "dvc", "scale", "kernels", "sets")
# `sets` runs whole chains over sets of prompts (half an hour at N=100 on 2 cores): opt-in, `--only sets`
DEFAULT_SECTIONS = SECTIONS[:-1]
CHAIN_STAGES = ("tokenize", "forward", "logits", "probs", "trajectories", "checks")


# ---------------------------------------------------------------- sections
def bench_capture(ws: Workspace, plan: Plan, res: Results) -> torch.Tensor:
    ws.load()
    ids, spec = ws.input_ids(), ws.spec()
    out: dict = {}
    times = alternate({"capture": lambda: out.update(t=capture.run_capture(ws.model, ids, spec)),
                       "plain": lambda: out.update(p=capture.plain_forward_logits(ws.model, ids, "all")),
                       "plain_last": lambda: capture.plain_forward_logits(ws.model, ids, "last")},
                      plan.reps_forward)
    logits = out["t"][capture.act_name("logits")]
    res.sections["capture"] = {"model": ws.name, "n_tokens": ids.shape[1], "dtype": ws.cfg["capture"].dtype,
                               "bit_identical_logits": bool(torch.equal(logits, out["p"])), **summary(times)}
    res.ratio("capture_vs_plain", paired_ratio(times, "capture", "plain"), 1.10,
              "run_capture / hook-free forward, same prompt")
    res.ratio("plain_all_vs_plain_last", paired_ratio(times, "plain", "plain_last"), None,
              "hook-free forward computing every position's logits / only the last (logits_to_keep=1)",
              "information: what a decode step pays for unused logit rows")
    return logits[0]


def bench_logits_io(logits: torch.Tensor, plan: Plan, res: Results, tmp: Path) -> None:
    """logits [T, V] (computed dtype): Parquet writer + full read vs what a user would write instead.

    The target contender is pandas: a DataFrame of the same long table (position, token_id,
    logit), `to_parquet` and `read_parquet` with default settings, from the float32 matrix
    to the table in memory. Our side ends with the whole float32 matrix in memory
    (`logits_io.read_matrix`: the logit column of every row group, decoded in parallel).
    Information: numpy save + load of the matrix, the same layout with compression=None
    (the floor of the long format), write and read separately, a compressed numpy file,
    and the size against raw bf16.
    """
    import pandas as pd
    arr = logits.float().numpy()
    pq_path, raw_path, np_path = tmp / "logits.parquet", tmp / "logits_uncompressed.parquet", tmp / "logits.npy"
    pd_path = tmp / "logits_pandas.parquet"
    split: dict[str, list[float]] = {"parquet_write": [], "parquet_read": []}

    def write_read(path: Path, compression: str | None, record: bool = False) -> np.ndarray:
        t0 = time.perf_counter()
        logits_io.write_logits(path, enumerate(logits), {b"bench": b"1"}, compression=compression)
        t1 = time.perf_counter()
        out = logits_io.read_matrix(path)[1]
        if record:
            split["parquet_write"].append(t1 - t0)
            split["parquet_read"].append(time.perf_counter() - t1)
        return out

    def parquet():
        return write_read(pq_path, "zstd", record=True)

    def parquet_uncompressed():     # the floor: same layout and encodings, no compression
        return write_read(raw_path, None)

    def numpy_io():
        np.save(np_path, arr)
        return np.load(np_path)

    def pandas_io():            # what a user would write otherwise: the same long table, default settings
        t, v = arr.shape
        frame = pd.DataFrame({"position": np.repeat(np.arange(t, dtype=np.int32), v),
                              "token_id": np.tile(np.arange(v, dtype=np.int32), t), "logit": arr.reshape(-1)})
        frame.to_parquet(pd_path)
        return pd.read_parquet(pd_path)

    def numpy_compressed():      # a size-comparable numpy file, for context
        np.savez_compressed(tmp / "logits.npz", logits=arr)
        return np.load(tmp / "logits.npz")["logits"]

    times = alternate({"parquet": parquet, "pandas": pandas_io, "numpy": numpy_io,
                       "parquet_uncompressed": parquet_uncompressed}, plan.reps_io)
    # One pair only: zlib takes seconds per call, and this ratio is context, not a target.
    times |= {f"{k}_vs_npz": v for k, v in alternate({"parquet": parquet, "npz": numpy_compressed}, 1, 0).items()}
    positions, stored = logits_io.read_matrix(pq_path)
    exact = bool(np.array_equal(stored, arr)) and positions == list(range(arr.shape[0])) and \
        bool(np.array_equal(logits_io.read_matrix(raw_path)[1], arr))
    raw_bf16 = arr.size * 2
    res.sections["logits_io"] = {"shape": list(arr.shape), "read_back_exact": exact,
                                 "parquet_bytes": pq_path.stat().st_size, "npy_bytes": np_path.stat().st_size,
                                 "pandas_parquet_bytes": pd_path.stat().st_size,
                                 "uncompressed_parquet_bytes": raw_path.stat().st_size,
                                 "npz_bytes": (tmp / "logits.npz").stat().st_size,
                                 "raw_bf16_bytes": raw_bf16, "encodings": sorted(logits_io.logit_encodings(pq_path)),
                                 **summary(times), **summary(split)}
    res.ratio("parquet_vs_pandas", paired_ratio(times, "parquet", "pandas"), 0.5,
              "logits.parquet write + full read / pandas DataFrame.to_parquet + read_parquet of the same long "
              "table (position, token_id, logit; default settings)")
    res.ratio("parquet_size_vs_pandas", pq_path.stat().st_size / pd_path.stat().st_size, 0.6,
              "logits.parquet bytes / the pandas file's bytes")
    res.ratio("parquet_vs_numpy", paired_ratio(times, "parquet", "numpy"), None,
              "logits.parquet write + full read / numpy save + load (float32)",
              "information: a raw matrix file, not the long table the layout requires")
    res.ratio("parquet_uncompressed_vs_numpy", paired_ratio(times, "parquet_uncompressed", "numpy"), None,
              "the same Parquet layout with compression=None, write + full read / numpy save + load",
              "information: the floor of the long format; parquet_vs_numpy minus this is what zstd costs")
    res.ratio("parquet_vs_npz_compressed", paired_ratio(times, "parquet_vs_npz", "npz_vs_npz"), None,
              "logits.parquet write + read / numpy savez_compressed + load", "information: a compressed numpy file")
    res.ratio("parquet_size_vs_bf16", pq_path.stat().st_size / raw_bf16, None,
              "logits.parquet bytes / raw bf16 bytes (T*V*2)", "information: no target")


def _baseline_module():
    if not BASELINE.exists():
        raise UserError(f"{BASELINE} is missing: the bench needs the repository checkout (pip install -e .)")
    spec = importlib.util.spec_from_file_location("nexttoken_baseline_script", BASELINE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def baseline_settings(ws: Workspace, module):
    c, s = ws.cfg, ws.cfg["sampling"]
    from pipeline.numerics.probs import filters
    named = [(f.name, f.settings.temperature, f.settings.top_k, f.settings.top_p) for f in filters(c["probs"], s)]
    return module.Settings(prompt=c["prompt"].text, add_special_tokens=c["model"].tokenizer.add_special_tokens,
                           positions=c["probs"].positions, temperatures=c["probs"].temperatures,
                           filters=tuple(named), temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                           seed=s.seed, max_new_tokens=s.max_new_tokens, kv_cache=s.kv_cache)


def bench_chain(ws: Workspace, plan: Plan, res: Results, tmp: Path) -> None:
    ws.load()
    module = _baseline_module()
    settings = baseline_settings(ws, module)
    scratch = scratch_workspace(ws.root, tmp / "chain_ws")
    runs: list[dict] = []
    # The baseline runs first: one-time costs of the first generate / Parquet write land on it.
    times = alternate({"baseline": lambda: module.run(ws.model, ws.tokenizer, settings, tmp / "baseline_out"),
                       "chain": lambda: runs.append(run_chain(scratch, CHAIN_STAGES, preloaded(ws)))},
                      plan.reps_chain, warmup=0)
    last = runs[-1]
    checks_s = last["stage_s"].get("checks", 0.0)
    res.sections["chain"] = {"model": ws.name, "stages": list(CHAIN_STAGES), "per_stage_s": last["stage_s"],
                             "loads_per_stage": last["loads"],
                             "notes": last["notes"], "baseline_script": str(BASELINE.relative_to(REPO)),
                             **summary(times)}
    res.ratio("chain_vs_baseline", paired_ratio(times, "chain", "baseline"), 1.2,
              "tokenize..checks in one process (model loaded once) / bench/baseline_script.py")
    res.ratio("chain_vs_baseline_cpu_time", paired_ratio(times, "chain.cpu", "baseline.cpu"), None,
              "the same ratio in CPU time of this process", "information: steadier than wall time on a shared machine")
    res.ratio("chain_without_checks_vs_baseline",
              statistics.median((c["total_s"] - c["stage_s"].get("checks", 0.0)) / b
                                for c, b in zip(runs, times["baseline"])), None,
              "the same without the checks stage (the outputs alone)", f"information; checks took {checks_s:.1f} s")
    # The equivalence matrix's cost, once, on the chain's last outputs: it re-runs the forward pass per variation
    # (the `kernels` row in a subprocess, with its own torch import and model load).
    matrix_s = run_chain(scratch, ("equivalence",), preloaded(ws))["stage_s"]["equivalence"]
    res.sections["chain"]["equivalence_s"] = matrix_s
    res.ratio("equivalence_vs_forward", matrix_s / last["stage_s"]["forward"], None,
              "the equivalence stage (every configured variation) / the forward stage, in one process",
              f"information; equivalence took {matrix_s:.1f} s")


def bench_nnsight(ws: Workspace, plan: Plan, res: Results) -> None:
    from bench import scale
    section = res.sections.setdefault("nnsight", {})
    layers = ws.spec().resolve_layers(len(capture.decoder_layers(_loaded(ws))))
    if importlib.util.find_spec("nnsight") is None:
        section["nnsight"] = "not installed: pip install nnsight (0.8.x; it leaves torch as pinned)"
    else:
        import nnsight
        ids = ws.input_ids()
        run_nn = nnsight_contender(ws.model, ids, layers)
        saved = run_nn()
        cap = capture.run_capture(ws.model, ids, ws.spec())
        same = torch.equal(saved["logits"], cap["logits"])
        differ = sorted(k for k, v in saved.items() if not (k in cap and torch.equal(v, cap[k])))
        times = alternate({"capture": lambda: capture.run_capture(ws.model, ids, ws.spec()), "nnsight": run_nn},
                          plan.reps_forward)
        mem = {k: scale.child(ws.root, {"kind": "memory", "contender": k}) for k in ("capture", "nnsight")}
        section.update({"version": nnsight.__version__, "model": ws.name, "n_tokens": ids.shape[1],
                        "same_logits": bool(same), "saved_by_nnsight": len(saved), "saved_by_capture": len(cap),
                        "nnsight_tensors_differing_from_capture": differ,
                        "capture_only": sorted(set(cap) - set(saved)),
                        "memory": mem, **summary(times)})
        res.ratio("capture_vs_nnsight_time", paired_ratio(times, "capture", "nnsight"), 1.0,
                  f"run_capture (all {len(cap)} tensors) / nnsight trace saving the {len(saved)} of them that "
                  "modules expose (attention weights of layers " + str(list(layers)) + ")")
        res.ratio("capture_vs_nnsight_peak_rss", mem["capture"]["extra_peak_mb"] / mem["nnsight"]["extra_peak_mb"],
                  1.0, "peak RSS above the loaded model during one pass, fresh process each",
                  f"absolute peaks {mem['capture']['peak_mb']:.0f} vs {mem['nnsight']['peak_mb']:.0f} MB")
    section["transformer_lens"] = scale.transformer_lens(ws.root, plan)


def _hash_time(ws: Workspace) -> float:
    """What recording the snapshot as a stage input costs (every stage that `use`s it pays it)."""
    from pipeline.store import provenance
    t0 = time.perf_counter()
    for f in sorted(p for p in ws.snapshot.rglob("*") if p.is_file()):
        provenance.sha256_file(f)
    return time.perf_counter() - t0


def _loaded(ws: Workspace):
    ws.load()
    return ws.model


# ---------------------------------------------------------------- the command
def report(result: dict) -> str:
    """What `nexttoken bench` prints: the ratios, then the scale tables and the stages' imports where they ran."""
    from bench import chain_scale, scale, set_scale
    sections = result["sections"]
    parts = [chain_scale.table(s) for s in sections.get("scale", {}).values() if isinstance(s, dict) and "runs" in s]
    if "runs" in sections.get("sets", {}):
        parts.append(set_scale.table(sections["sets"]))
    parts.append(scale.importtime_table(sections.get("dvc", {})))
    return "\n\n".join([table(result["ratios"]), *filter(None, (p.strip() for p in parts))])


def table(ratios: dict) -> str:
    """The printed summary: one line per ratio, its target and PASS / MISS (info: no target)."""
    lines = [f"{'ratio':<40} {'value':>9} {'target':>8}  verdict", "-" * 70]
    for name, r in ratios.items():
        target = "-" if r["target"] is None else f"<= {r['target']:g}"
        verdict = "info" if r["target"] is None else {True: "PASS", False: "MISS", None: "n/a"}[r["pass"]]
        value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        lines.append(f"{name:<40} {value:>9} {target:>8}  {verdict}")
    return "\n".join(lines)


def run(root: Path, quick: bool = False, only: str | None = None, lengths: tuple[int, ...] | None = None,
        workspace_lengths: tuple[int, ...] | None = None, last_lengths: tuple[int, ...] | None = None,
        set_sizes: tuple[int, ...] | None = None, set_ray: bool = False) -> dict:
    """Every section (or `only` one) in order; bench.json is rewritten after each section, so an
    interrupted run keeps what it measured (`complete` says whether it finished)."""
    from bench import scale, set_scale
    from pipeline.store import provenance
    if only is not None and only not in SECTIONS:
        raise UserError(f"--only {only!r}: one of {', '.join(SECTIONS)}")
    plan = Plan.make(quick, lengths, workspace_lengths, last_lengths)
    plan = dataclasses.replace(plan, set_sizes=set_sizes or ((4, 8) if quick else plan.set_sizes), set_ray=set_ray)
    ws, res = Workspace.open(root), Results()
    started = time.time()
    out = {"schema_version": 1, "quick": quick, "only": only, "complete": False, "model": ws.name,
           "snapshot": str(ws.snapshot), "dtype": ws.cfg["capture"].dtype, "torch_threads": torch.get_num_threads(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "hardware": provenance.hardware(),
           "wall_s": None, "ratios": res.ratios, "sections": res.sections}
    wanted = DEFAULT_SECTIONS if only is None else (only,)
    with tempfile.TemporaryDirectory(prefix="nexttoken-bench-") as d:
        tmp, held = Path(d), {}
        steps = {"capture": lambda: held.update(logits=bench_capture(ws, plan, res)),
                 "logits_io": lambda: bench_logits_io(held["logits"], plan, res, tmp),
                 "chain": lambda: bench_chain(ws, plan, res, tmp),
                 "nnsight": lambda: bench_nnsight(ws, plan, res),
                 "dvc": lambda: scale.bench_dvc(ws, plan, res, tmp),
                 "scale": lambda: scale.bench_scale(ws, plan, res, tmp),
                 "kernels": lambda: bench_kernels(ws, plan, res),
                 "sets": lambda: set_scale.bench_sets(
                     scale.tiny_workspace(ws, tmp), res, tmp, plan.set_sizes,
                     executors={"serial": [], **({"ray": ["executor=ray", "executor.workers=2"]} if plan.set_ray
                                                 else {})})}
        for name in (("capture",) if "logits_io" in wanted and "capture" not in wanted else ()) + wanted:
            t0 = time.perf_counter()
            steps[name]()
            res.sections.setdefault(name, {})["section_wall_s"] = round(time.perf_counter() - t0, 2)
            print(f"[bench] {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            write_json(root / OUTPUT, {**out, "wall_s": round(time.time() - started, 1)})
    if ws.load_s:
        res.sections["workspace"] = {"model": ws.name, "load_s": ws.load_s, "snapshot_sha256_s": _hash_time(ws)}
    out.update(complete=True, wall_s=round(time.time() - started, 1))
    write_json(root / OUTPUT, out)
    return out
