"""Set-level DVC metrics: a few figures that summarise a prompt set, from its prompt_metrics tables.

Every key is a `dvc exp show` column, so there are few: from probs' table (one row per prompt and
temperature) the median and mean entropy (bits) and the median kept count of the configured
sampling filter, at T = 1 when the table has it, else at its lowest temperature
(`aggregate_temperature`); from trajectories' table (one row per prompt, branch and kv_cache; the
reference path, no cache, as the per-prompt metrics) the number of prompts, the share of prompts
whose greedy / sampled continuation ends in a loop, and the mean step where sampling left the
greedy path over the prompts where it did (0 when none did). Plain Python over Arrow tables (no
torch), so the stages, `nexttoken audit` and the tests compute them with the same calls.
"""

from __future__ import annotations

import math
import statistics

import pyarrow as pa

PROBS_KEYS = ("entropy_median", "entropy_mean", "kept_median")
TRAJECTORY_KEYS = ("prompts", "greedy_loop_rate", "sample_loop_rate", "diverge_mean")


def aggregate_temperature(temperatures: list[float]) -> float:
    """The temperature the probs aggregates are taken at: 1 when listed, else the lowest listed."""
    return 1.0 if 1.0 in temperatures else min(temperatures)


def _median(values: list[float]) -> float | int:
    m = statistics.median(values)
    return int(m) if float(m).is_integer() and all(isinstance(v, int) for v in values) else float(m)


def probs_set_metrics(table: pa.Table) -> dict:
    """probs/metrics.json's set keys from prompt_metrics.parquet (`entropy` there is in nats)."""
    rows = table.to_pylist()
    t = aggregate_temperature(sorted({r["temperature"] for r in rows}))
    at_t = [r for r in rows if r["temperature"] == t]
    bits = [r["entropy"] / math.log(2) for r in at_t]
    return {"entropy_median": float(statistics.median(bits)), "entropy_mean": math.fsum(bits) / len(bits),
            "kept_median": _median([r["sampling_kept"] for r in at_t])}


def trajectory_set_metrics(table: pa.Table) -> dict:
    """trajectories/metrics.json's set keys from its prompt_metrics.parquet (runs without the cache)."""
    ref = [r for r in table.to_pylist() if not r["kv_cache"]]
    prompts = sorted({r["prompt_id"] for r in table.to_pylist()})
    out: dict = {"prompts": len(prompts)}
    for branch in ("greedy", "sample"):
        runs = [r for r in ref if r["branch"] == branch]
        if runs:
            out[f"{branch}_loop_rate"] = sum(bool(r["loop"]) for r in runs) / len(runs)
    steps = [r["diverge"] for r in ref if r["branch"] == "sample" and r["diverge"]]
    if any(r["branch"] == "sample" and r["diverge"] is not None for r in ref):
        out["diverge_mean"] = math.fsum(steps) / len(steps) if steps else 0
    return out
