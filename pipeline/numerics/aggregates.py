"""Set-level DVC metrics: a few figures that summarise a prompt set.

Every key is a `dvc exp show` column, so there are few. probs: over the prompts' sweep figures
(the configured sampling filter at `sampling.temperature`, as `kept` / `entropy` of a single
prompt) the median and mean entropy (nats) and the median kept count. trajectories, from its
prompt_metrics table (one row per prompt, branch and kv_cache; the reference path, no cache, as the
per-prompt metrics): the number of prompts, the share of prompts whose greedy / sampled
continuation ends in a loop, and the mean step where sampling left the greedy path over the
prompts where it did (0 when none did). Plain Python (no torch), so the stages, `nexttoken audit`
and the tests compute them with the same calls.
"""

from __future__ import annotations

import math
import statistics

import pyarrow as pa

PROBS_KEYS = ("entropy_median", "entropy_mean", "kept_median")


def aggregate_temperature(temperatures: list[float]) -> float:
    """The temperature the probs aggregates are taken at: 1 when listed, else the lowest listed."""
    return 1.0 if 1.0 in temperatures else min(temperatures)


def _median(values: list[float]) -> float | int:
    m = statistics.median(values)
    return int(m) if float(m).is_integer() and all(isinstance(v, int) for v in values) else float(m)


def probs_set_metrics(per_prompt: list[dict]) -> dict:
    """probs/metrics.json's set keys from each prompt's sweep figures (`probs.sweep_metrics`: the
    configured sampling filter at its own temperature, entropy in nats), so they move with
    `sampling.temperature` / top_k / top_p as a sweep varies them."""
    nats = [m["entropy"] for m in per_prompt]
    return {"entropy_median": float(statistics.median(nats)), "entropy_mean": math.fsum(nats) / len(nats),
            "kept_median": _median([m["kept"] for m in per_prompt])}


def trajectory_set_metrics(table: pa.Table) -> dict:
    """trajectories/metrics.json's set keys from its prompt_metrics.parquet (runs without the cache)."""
    ref = [r for r in table.to_pylist() if not r["kv_cache"]]
    prompts = sorted({r["prompt_id"] for r in table.to_pylist()})
    out: dict = {"n_prompts": len(prompts)}
    for branch in ("greedy", "sample"):
        runs = [r for r in ref if r["branch"] == branch]
        if runs:
            out[f"{branch}_loop_rate"] = sum(bool(r["loop"]) for r in runs) / len(runs)
    steps = [r["diverge"] for r in ref if r["branch"] == "sample" and r["diverge"]]
    if any(r["branch"] == "sample" and r["diverge"] is not None for r in ref):
        out["diverge_mean"] = math.fsum(steps) / len(steps) if steps else 0
    return out
