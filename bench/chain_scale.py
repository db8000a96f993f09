"""Prompt-length scale of the whole chain: tokenize -> report, each stage a fresh process, as DVC runs it.

Per prompt length T (a prompt file of ~T tokens: the configured prompt's text repeated) and
capture.positions, one workspace linking the prepared model; every stage runs as
`python -m stages.<name>` and is measured as that child: wall time, CPU time (user + system,
every thread, `os.wait4`) and its own peak RSS (`tests/helpers/stage_peak.py`; not wait4's,
which carries this process's size into the child). Beside them one child loads the model (its
RSS is the baseline "above the loaded model") and times a hook-free forward over the same ids:
the model's own growth, for comparison.

Targets, per model:
- memory: the largest stage peak above the loaded model <= 2.5 x 4*T*V bytes (one float32
  [T, V]), at every length;
- growth of the pipeline's own work <= 1.1 (log-log slope over the lengths): the CPU time of
  the stages that run no model (tokenize, logits, probs, report), and the largest peak above
  the loaded model. What the model does (forward, trajectories, checks) grows as the model does
  (eager attention is quadratic): its slopes are information.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from bench.common import child, fit_exponent
from pipeline.store import paths
from tests.helpers import stage_peak, worktree
from tests.helpers.partitions import part

STAGES = ("tokenize", "forward", "logits", "probs", "trajectories", "checks", "report")
MODEL_STAGES = ("forward", "trajectories", "checks")      # the stages that run the model
OWN_WORK = tuple(s for s in STAGES if s not in MODEL_STAGES)
PEAK_TARGET = 2.5           # x 4*T*V bytes above the loaded model
EXPONENT_TARGET = 1.1
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}


# ---------------------------------------------------------------- one length
def prompt_text(tokenizer, text: str, n: int, add_special_tokens: bool) -> str:
    """Text of about n tokens: `text` repeated, cut at the n-th token (re-tokenizing may differ by one)."""
    per_copy = max(1, len(tokenizer(text, add_special_tokens=False).input_ids))
    ids = tokenizer(text * (n // per_copy + 2), add_special_tokens=add_special_tokens).input_ids[:n]
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def length_workspace(src: Path, dest: Path, model: str, text: str, positions: str) -> Path:
    """conf/ + a prompt file + params.yaml composed for it, and a link to src's prepared model."""
    (dest / "prompts").mkdir(parents=True)
    shutil.copytree(worktree.ROOT / "conf", dest / "conf")
    (dest / "prompts/scale.txt").write_text(text, encoding="utf-8")
    worktree.sh(dest, sys.executable, "-m", "pipeline.tools.cli", "compose", f"model={model}",
                "prompt.file=prompts/scale.txt", "prompt.text=null", f"capture.positions={positions}", env=OFFLINE)
    link = paths.stage_dir("prepare_model", dest)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(paths.stage_dir("prepare_model", src).resolve(), target_is_directory=True)
    return dest


def run_stage(ws: Path, stage: str) -> dict:
    """One stage in a fresh interpreter: exit status, wall s, CPU s (its threads), its own peak RSS MB."""
    env = worktree.tool_env(**OFFLINE, PYTHONPATH=os.pathsep.join(
        filter(None, [str(worktree.ROOT), os.environ.get("PYTHONPATH")])))
    log = ws / f".{stage}.log"
    out = stage_peak.run(f"stages.{stage}", ws, env, log)
    if out["rc"] not in (0, 1) or (out["rc"] == 1 and stage != "checks"):   # checks: 1 = a failed check
        raise RuntimeError(f"stage {stage} failed in {ws} ({out['rc']}):\n{log.read_text()[-3000:]}")
    return out


def measure_length(src: Path, dest: Path, model: str, text: str, positions: str) -> dict:
    """Every stage at one length; the loaded-model baseline and a plain forward beside them."""
    ws = length_workspace(src, dest, model, text, positions)
    stages = {"tokenize": run_stage(ws, "tokenize")}
    base = child(ws, {"kind": "loaded"}, timeout=6 * 3600)        # reads this workspace's tokens.parquet
    for stage in STAGES[1:]:
        stages[stage] = run_stage(ws, stage)
        print(f"[scale] {model} T~{len(text)} chars {positions}: {stage} {stages[stage]}", file=sys.stderr, flush=True)
    facts = json.loads(part(paths.FORWARD_FACTS, ws).read_text())
    t, v = facts["n_positions"], facts["output_size"]
    rows = len(facts["logit_positions"])
    extra = max(s["peak_mb"] for s in stages.values()) - base["rss_loaded_mb"]
    one_copy_mb = 4 * t * v / 2**20
    return {"T": t, "V": v, "logit_rows": rows, "positions": positions, "stages": stages,
            "loaded_mb": base["rss_loaded_mb"], "plain_forward_s": base["plain_forward_s"],
            "plain_forward_cpu_s": base["plain_forward_cpu_s"],
            "chain_wall_s": round(sum(s["wall_s"] for s in stages.values()), 2),
            "chain_cpu_s": round(sum(s["cpu_s"] for s in stages.values()), 2),
            "own_work_cpu_s": round(sum(stages[s]["cpu_s"] for s in OWN_WORK), 2),
            "max_extra_mb": round(extra, 1), "four_tv_mb": round(one_copy_mb, 1),
            "peak_vs_4tv": round(extra / one_copy_mb, 3),
            "checks_rc": stages["checks"]["rc"]}


def loaded_child(ws, spec: dict) -> dict:
    """`python -m bench.scale '{"kind": "loaded"}'` in a length workspace: RSS with the model loaded,
    then one hook-free forward over its tokens (the capture's positions)."""
    import pyarrow.parquet as pq
    import torch

    from bench.common import release_freed, rss_mb
    from pipeline.model import capture
    ws.load()
    release_freed()
    loaded = rss_mb()
    ids = torch.tensor([pq.read_table(part(paths.TOKENS, ws.root), columns=["token_id"])
                        ["token_id"].to_pylist()])
    t, c = time.perf_counter(), time.process_time()
    capture.plain_forward_logits(ws.model, ids, ws.cfg["capture"].positions)
    return {"rss_loaded_mb": loaded, "plain_forward_s": time.perf_counter() - t,
            "plain_forward_cpu_s": time.process_time() - c, "T": ids.shape[1]}


# ---------------------------------------------------------------- a model's lengths
def measure_model(src: Path, tmp: Path, model: str, prompt: str, add_special_tokens: bool, tokenizer,
                  lengths: dict[str, list[int]]) -> dict:
    """lengths: positions ("all" / "last") -> prompt lengths. Each length in its own workspace."""
    runs = {}
    for positions, ns in lengths.items():
        for n in ns:
            text = prompt_text(tokenizer, prompt, n, add_special_tokens)
            runs.setdefault(positions, []).append(
                {"length": n, **measure_length(src, tmp / f"{model}_{positions}_{n}", model, text, positions)})
    return {"model": model, "runs": runs, "fits": {p: fits(r) for p, r in runs.items() if len(r) >= 2}}


def fits(runs: list[dict]) -> dict:
    """Log-log slopes over T (all lengths, and without the shortest, where fixed costs dominate)."""
    def slopes(rs: list[dict]) -> dict:
        ts = [r["T"] for r in rs]
        out = {"own_work_cpu": fit_exponent(ts, [r["own_work_cpu_s"] for r in rs]),
               "max_extra_memory": fit_exponent(ts, [r["max_extra_mb"] for r in rs]),
               "chain_wall": fit_exponent(ts, [r["chain_wall_s"] for r in rs]),
               "chain_cpu": fit_exponent(ts, [r["chain_cpu_s"] for r in rs]),
               "plain_forward_cpu": fit_exponent(ts, [r["plain_forward_cpu_s"] for r in rs])}
        out |= {f"{s}_cpu": fit_exponent(ts, [r["stages"][s]["cpu_s"] for r in rs]) for s in STAGES}
        return {k: round(v, 3) if math.isfinite(v) else None for k, v in out.items()}
    return {"lengths": [r["T"] for r in runs], "all": slopes(runs),
            "without_shortest": slopes(runs[1:]) if len(runs) >= 3 else None}


def record_ratios(res, section: dict) -> None:
    """The section's targets as bench ratios (one per model)."""
    name = section["model"]
    for positions, runs in section["runs"].items():   # at the longest prompt: there [T, V] dominates fixed costs
        longest = max(runs, key=lambda r: r["T"])
        res.ratio(f"chain_peak_vs_4TV{'' if positions == 'all' else '_' + positions}[{name}]", longest["peak_vs_4tv"],
                  PEAK_TARGET, f"largest stage peak RSS above the loaded model / 4*T*V bytes (one float32 [T, V]), "
                  f"whole chain, capture.positions={positions}, the longest prompt",
                  f"T={longest['T']}: {longest['max_extra_mb']:.0f} MB above a loaded model of "
                  f"{longest['loaded_mb']:.0f} MB")
    f = section["fits"].get("all")
    if f:
        for key, what in (("own_work_cpu", "CPU time of the stages that run no model (tokenize, logits, probs, "
                                           "report)"),
                          ("max_extra_memory", "largest stage peak RSS above the loaded model")):
            res.ratio(f"chain_{key}_exponent[{name}]", f["all"][key], EXPONENT_TARGET,
                      f"log-log slope over T={f['lengths']}: {what}", "positions=all")
        for key in ("chain_cpu", "plain_forward_cpu"):
            res.ratio(f"{key}_exponent[{name}]", f["all"][key], None,
                      f"log-log slope over T={f['lengths']}: " + ("the whole chain's CPU time" if key == "chain_cpu"
                                                                 else "a hook-free forward (the model's own growth)"),
                      "information")


def _slope(fit: dict, key: str) -> float:
    """A fitted slope for printing: None (not finite) as nan, and 0.0 as 0.00."""
    return math.nan if fit[key] is None else fit[key]


def table(section: dict) -> str:
    """Per length: each stage's wall / CPU seconds and peak MB; the chain, own work, the memory target."""
    lines = []
    for positions, runs in section["runs"].items():
        lines += [f"chain scale {section['model']} (positions={positions}): each stage a fresh process; "
                  "wall s / CPU s / peak MB",
                  f"{'T':>6} " + " ".join(f"{s:>19}" for s in STAGES) + f" {'own cpu':>8} {'+MB':>7} {'/4TV':>5}"]
        for r in runs:
            cells = " ".join(f"{s['wall_s']:>6.1f}/{s['cpu_s']:>6.1f}/{s['peak_mb']:>5.0f}"
                             for s in (r["stages"][st] for st in STAGES))
            lines.append(f"{r['T']:>6} {cells} {r['own_work_cpu_s']:>8.1f} {r['max_extra_mb']:>7.0f} "
                         f"{r['peak_vs_4tv']:>5.2f}")
        f = section["fits"].get(positions)
        for label, s in (("slope", f and f["all"]), ("from 2nd", f and f["without_shortest"])):
            if s:
                lines.append(f"{label:>6} " + " ".join(f"{'cpu ' + format(_slope(s, st + '_cpu'), '.2f'):>19}"
                                                       for st in STAGES)
                             + f" {_slope(s, 'own_work_cpu'):>8.2f} {_slope(s, 'max_extra_memory'):>7.2f}")
    return "\n".join(lines)
