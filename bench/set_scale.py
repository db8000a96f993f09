"""Set-size scale (issue 29): the chain over sets of N prompts on tiny_qwen2, each stage a fresh process.

Per size N (synthetic prompts `Note i: <subject> <verb> like`, 5-8 tokens each), one workspace
linking the prepared tiny_qwen2 model, `capture.positions=last`, `sampling.max_new_tokens=STEPS`
(4: the issue's baseline; conf/ decodes 24) and the executor asked for (`serial`, or `ray` with
`executor.workers` local workers). Each stage runs as `python -m stages.<name>` and is measured as
that child (wall s, CPU s, its own peak RSS; `tests/helpers/stage_peak.py`); its manifest's
`prompt_seconds` give the stage work per prompt (set-up such as a model load or a Ray start not
counted). Disk: every file of the stage's folder, per prompt. Beside them, the floor: one child
(`python -m bench.set_scale floor N STEPS`) that loads the model and does the same forward and the
same four decodings (sample / greedy, with and without the KV cache) per prompt in a plain loop, over
the set's first FLOOR_PROMPTS (1000) prompts at most.

Targets: the chain's stage work <= 0.25 s per prompt; each stage's peak RSS grows with N by a
log-log slope <= 0.1; disk <= 1.5 MB per prompt. Printed as a table; `bench_sets` records the ratios.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from bench.chain_scale import OFFLINE, run_stage
from bench.common import fit_exponent
from pipeline.store import paths
from pipeline.store.artifacts import read_manifest
from tests.helpers import worktree

STAGES = ("tokenize", "forward", "logits", "probs", "trajectories", "lens", "checks", "report")
STEPS = 4
PER_PROMPT_TARGET = 0.25      # s of stage work per prompt, the whole chain
RSS_EXPONENT_TARGET = 0.1
DISK_TARGET_MB = 1.5
FLOOR_PROMPTS = 1000    # the floor runs at most this many of a set's prompts: its s/prompt does not depend on N
SUBJECTS = ("the sea", "a cat", "the moon", "bread", "a river", "the city", "music", "winter", "a clock", "snow")
VERBS = ("is", "seems", "becomes", "was", "feels", "looks", "sounds")


def prompts(n: int) -> list[dict]:
    return [{"id": f"p{i:05d}", "text": f"Note {i}: {SUBJECTS[i % len(SUBJECTS)]} {VERBS[i % len(VERBS)]} like"}
            for i in range(n)]


def set_workspace(src: Path, dest: Path, n: int, steps: int, executor: list[str]) -> Path:
    (dest / "prompts").mkdir(parents=True)
    shutil.copytree(worktree.ROOT / "conf", dest / "conf")
    (dest / "prompts/set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts(n)), encoding="utf-8")
    worktree.sh(dest, sys.executable, "-m", "pipeline.tools.cli", "compose", "model=tiny_qwen2", "capture.device=cpu",
                "prompt.set=prompts/set.jsonl", f"prompt.max_set_size={n}", "capture.positions=last",
                f"sampling.max_new_tokens={steps}", *executor, env=OFFLINE)
    link = paths.stage_dir("prepare_model", dest)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(paths.stage_dir("prepare_model", src).resolve(), target_is_directory=True)
    return dest


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure_size(src: Path, dest: Path, n: int, steps: int, executor: list[str]) -> dict:
    ws = set_workspace(src, dest, n, steps, executor)
    stages = {}
    for stage in STAGES:
        out = run_stage(ws, stage)
        manifest = read_manifest(stage, ws)
        work = sum((manifest.get("prompt_seconds") or {}).values())
        stages[stage] = {**out, "work_s": round(work, 3), "work_s_per_prompt": round(work / n, 4),
                         "wall_s_per_prompt": round(out["wall_s"] / n, 4),
                         "disk_mb_per_prompt": round(_bytes(paths.stage_dir(stage, ws)) / n / 2**20, 4)}
        if manifest.get("executor", {}).get("kind") == "ray":
            where = list(manifest["executor"]["prompts"].values())
            stages[stage]["ray_worker_rss_mb"] = sorted({w.get("rss_mb") for w in where if w.get("rss_mb")})
        print(f"[sets] N={n} {stage}: {stages[stage]}", file=sys.stderr, flush=True)
    floor = floor_child(ws, min(n, FLOOR_PROMPTS), steps)
    work = sum(s["work_s"] for s in stages.values())
    disk = sum(s["disk_mb_per_prompt"] for s in stages.values())
    return {"N": n, "steps": steps, "executor": executor or ["executor=serial"], "stages": stages,
            "work_s_per_prompt": round(work / n, 4), "wall_s": round(sum(s["wall_s"] for s in stages.values()), 1),
            "disk_mb_per_prompt": round(disk, 3), "floor_s_per_prompt": floor["s_per_prompt"],
            "work_vs_floor": round(work / n / floor["s_per_prompt"], 2), "floor": floor}


def floor_child(ws: Path, n: int, steps: int) -> dict:
    env = worktree.tool_env(**OFFLINE, PYTHONPATH=os.pathsep.join(filter(None, [str(worktree.ROOT),
                                                                               os.environ.get("PYTHONPATH")])))
    proc = worktree.sh(ws, sys.executable, "-m", "bench.set_scale", "floor", str(n), str(steps), env=env,
                       timeout=24 * 3600)
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def floor(n: int, steps: int) -> dict:
    """The plain script: the prepared model, the ids of each of the set's first `n` prompts (`FLOOR_PROMPTS` at
    most: its s/prompt does not depend on N) through one forward (the last position's logits, as the capture
    computes them with positions=last) and four decodings of `steps` tokens (greedy and sampled, with and without
    the KV cache; each step the last position's logits only, `logits_to_keep=1`, as generate
    and the trajectories stage compute them), no capture, nothing written."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(paths.stage_dir("prepare_model"), dtype=torch.bfloat16,
                                                 attn_implementation="eager", local_files_only=True).eval()
    ids = [pq.read_table(p, columns=["token_id"])["token_id"].to_pylist()
           for p in sorted(paths.dataset(paths.TOKENS).glob("*/tokens.parquet"))[:n]]
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for prompt in ids:
            x = torch.tensor([prompt])
            model(x, logits_to_keep=1)             # as the capture computes positions=last
            for sample in (False, True):
                for cache in (True, False):
                    seq, past = x, None
                    for _ in range(steps):
                        out = model(seq if past is None else seq[:, -1:], past_key_values=past, use_cache=cache,
                                    logits_to_keep=1)
                        past = out.past_key_values if cache else None
                        logits = out.logits[0, -1].float()
                        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen) if sample \
                            else logits.argmax().reshape(1)
                        seq = torch.cat([seq, nxt.reshape(1, 1)], dim=1)
    dt = time.perf_counter() - t0
    return {"prompts": len(ids), "steps": steps, "s": round(dt, 3), "s_per_prompt": round(dt / len(ids), 5)}


def fits(runs: list[dict]) -> dict:
    ns = [r["N"] for r in runs]
    return {"sizes": ns, **{f"{s}_peak_rss": _round(fit_exponent(ns, [r["stages"][s]["peak_mb"] for r in runs]))
                            for s in STAGES}}


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _round(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


def table(section: dict) -> str:
    lines = []
    for name, runs in section["runs"].items():
        lines += [f"set scale tiny_qwen2, {name}: each stage a fresh process; stage work s/prompt (manifest) / "
                  "wall s / peak MB / disk MB per prompt",
                  f"{'N':>6} " + " ".join(f"{s:>26}" for s in STAGES) + f" {'s/prompt':>9} {'floor':>7} "
                  f"{'x floor':>7} {'MB/prompt':>9}"]
        for r in runs:
            cells = " ".join(f"{x['work_s_per_prompt']:>6.3f}/{x['wall_s']:>7.1f}/{x['peak_mb']:>5.0f}/"
                             f"{x['disk_mb_per_prompt']:>5.2f}" for x in (r["stages"][s] for s in STAGES))
            lines.append(f"{r['N']:>6} {cells} {r['work_s_per_prompt']:>9.3f} {r['floor_s_per_prompt']:>7.3f} "
                         f"{r['work_vs_floor']:>7.1f} {r['disk_mb_per_prompt']:>9.2f}")
        f = section["fits"].get(name)
        if f:
            lines.append(f"{'slope':>6} " + " ".join(f"{'rss ' + format(_nan(f[s + '_peak_rss']), '.3f'):>26}"
                                                     for s in STAGES))
    return "\n".join(lines)


def bench_sets(src: Path, res, tmp: Path, sizes: tuple[int, ...], steps: int = STEPS,
               executors: dict[str, list[str]] | None = None) -> dict:
    """Every size under each executor; the targets as ratios at the largest size."""
    executors = executors or {"serial": []}
    section = res.sections.setdefault("sets", {"runs": {}, "fits": {}})
    for name, overrides in executors.items():
        runs = [measure_size(src, tmp / f"sets_{name}_{n}", n, steps, overrides) for n in sizes]
        section["runs"][name], section["fits"][name] = runs, fits(runs) if len(runs) >= 2 else None
        big = runs[-1]
        res.ratio(f"set_work_s_per_prompt[{name}]", big["work_s_per_prompt"], PER_PROMPT_TARGET,
                  f"stage work per prompt, whole chain, N={big['N']}, {steps} new tokens", "seconds, not a ratio")
        res.ratio(f"set_work_vs_floor[{name}]", big["work_vs_floor"], None,
                  "stage work per prompt / a plain script's forward + four decodings", "information")
        res.ratio(f"set_disk_mb_per_prompt[{name}]", big["disk_mb_per_prompt"], DISK_TARGET_MB,
                  f"artifacts per prompt, N={big['N']}", "MB, not a ratio")
        if section["fits"][name]:
            worst = max((v for k, v in section["fits"][name].items() if k.endswith("_peak_rss") and v is not None),
                        default=None)
            res.ratio(f"set_peak_rss_exponent[{name}]", worst, RSS_EXPONENT_TARGET,
                      f"largest log-log slope of a stage's peak RSS over N={sizes}", "")
    return section


if __name__ == "__main__":
    if sys.argv[1:2] == ["floor"]:
        print(json.dumps(floor(int(sys.argv[2]), int(sys.argv[3]))))
