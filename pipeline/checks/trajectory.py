"""The checks on the trajectories stage's files: step-1 logits, greedy argmax, KV cache, generate parity.

Each compares the stored steps and step logits with the forward logits or with
`model.generate` run again here; see `pipeline.checks.suite.run_all` for where they run.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from pipeline.checks.verdicts import Check, diff_detail, max_abs, mismatches
from pipeline.model.decode import generate_reference
from pipeline.model.trajectories import branch_settings


def step_logit_rows(path: Path) -> dict[tuple[str, bool, int], np.ndarray]:
    """(branch, kv_cache, step) -> float32 logits row; one row group per step, as written."""
    out, pf = {}, pq.ParquetFile(path)
    for g in range(pf.num_row_groups):
        t = pf.read_row_group(g, columns=["branch", "kv_cache", "step", "token_id", "logit"])
        ids = t["token_id"].to_numpy()
        row = np.full(int(ids.max()) + 1, np.nan, np.float32)     # an id missing stays NaN
        row[ids] = t["logit"].to_numpy()
        out[(t["branch"][0].as_py(), t["kv_cache"][0].as_py(), t["step"][0].as_py())] = row
    return out


def _run_name(branch: str, kv: bool) -> str:
    return f"{branch}_kv" if kv else branch


def step1_logits(step_rows: dict, last_row: np.ndarray, severity: str) -> list[Check]:
    return [Check(f"step1_logits_{_run_name(b, kv)}", f"step-1 logits of branch {b} (kv_cache={kv}) == the forward "
                  "logits at the last prompt position, bit for bit",
                  max_abs(step_rows.get((b, kv, 1), np.empty(0)), last_row), 0, severity, "step 1")
            for b, kv in sorted({(b, kv) for b, kv, _ in step_rows})]


def greedy_argmax(steps: list[dict], step_rows: dict, last_row: np.ndarray) -> list[Check]:
    """Greedy step 1 takes argmax of the forward logits, every greedy step the argmax of its own
    (np.argmax and torch.argmax both return the lowest id among equal maxima)."""
    greedy, top = [r for r in steps if r["branch"] == "greedy"], int(np.argmax(last_row))
    if not greedy:
        return []
    first = [r for r in greedy if r["step"] == 1 and r["token_id"] != top]
    own = [r for r in greedy if r["token_id"] != int(np.argmax(step_rows.get(
        ("greedy", r["kv_cache"], r["step"]), np.full(1, np.nan))))]
    return [Check("greedy_step1_argmax", "greedy step-1 token == argmax of the forward logits' last row (runs "
                  "differing)", len(first), 0, "error", f"argmax id {top}"),
            Check("greedy_tokens_argmax", "every greedy token == argmax of its stored step logits (steps differing)",
                  len(own), 0, "error", ", ".join(f"{_run_name('greedy', r['kv_cache'])} step {r['step']}"
                                                   for r in own[:4]))]


def kv_cache(steps: list[dict], step_rows: dict, atol: float) -> list[Check]:
    """KV-cache vs full-prefix run of each branch, step by step up to the first different choice
    (after it the prefixes differ). Report severity: bf16 may miss atol; shown, never loosened."""
    out = []
    for b in sorted({r["branch"] for r in steps}):
        ids = {kv: {r["step"]: r["token_id"] for r in steps if r["branch"] == b and r["kv_cache"] == kv}
               for kv in (False, True)}
        if not ids[False] or not ids[True]:
            continue
        diffs, differ = [], 0
        for s in sorted(set(ids[False]) & set(ids[True])):
            # a missing row compares as inf (shapes 0 and 1 never match)
            diffs.append(max_abs(step_rows.get((b, False, s), np.empty(0)), step_rows.get((b, True, s), np.empty(1))))
            if ids[False][s] != ids[True][s]:
                differ += 1
                break
        out += [Check(f"kv_cache_logits_{b}", "max abs logit diff per step, KV cache vs full prefix "
                      "(checks.kv_cache_atol)", max(diffs, default=math.nan), atol, "report",
                      "per step: " + ", ".join(f"{d:g}" for d in diffs)),
                Check(f"kv_cache_choices_{b}", "steps whose chosen id differs, KV cache vs full prefix",
                      differ + abs(len(ids[False]) - len(ids[True])), 0, "report", f"{len(diffs)} steps compared")]
    return out


def generate_parity(model, prompt_ids: list[int], steps: list[dict], sampling_cfg, eos_ids: set[int],
                    device: torch.device) -> list[Check]:
    """model.generate == the stored ids of each branch: its KV-cache run, as generate runs by
    default (a full re-forward per step costs the checks stage twice the decoding), or its
    no-cache run when only that was recorded. The two runs are compared with each other
    step by step in `kv_cache`."""
    out = []
    for b in sorted({r["branch"] for r in steps}):
        kv = any(r["branch"] == b and r["kv_cache"] for r in steps)
        stored = [r["token_id"] for r in sorted(steps, key=lambda r: r["step"])
                  if (r["branch"], r["kv_cache"]) == (b, kv)]
        ref = generate_reference(model, prompt_ids, branch_settings(b, sampling_cfg), sampling_cfg.max_new_tokens,
                                 sampling_cfg.seed, kv_cache=kv, eos_ids=eos_ids)
        off_cpu = b == "sample" and device.type != "cpu"
        out.append(Check(f"generate_parity_{b}", f"model.generate after torch.manual_seed(seed) == stored {b} ids "
                         f"(kv_cache={kv})" + ("; report off CPU: there generate draws from the device RNG, our "
                                               "loop from a CPU generator" if off_cpu else ""),
                         mismatches(ref, stored), 0, "report" if off_cpu else "error", diff_detail(ref, stored)))
    return out
