"""Checks on the equivalence matrix, written to the equivalence stage's own checks.parquet.

Own table, not the checks stage's: the matrix re-runs the model several times over; had the checks
stage depended on it, every matrix change would re-run all checks and every checks change the matrix.
The table has the checks stage's schema (`verdicts.SCHEMA`), so readers take either.

- `equivalence_rederived_<v>` (error): `equivalence.rederive`'s row recomputed by its own path: a plain
  transformers forward written out here (own load, own left padding) and every figure in numpy
  float64 (top-p by transformers' `TopPLogitsWarper` called directly); the figures must agree.
- `equivalence_exact_<v>` (error): a variation in `equivalence.exact` is not bit-identical to the record.
- `equivalence_<v>` (report): what the variation changed (max |Δ logit|; the rest in the detail).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from pipeline.checks.verdicts import Check, summary, to_table
from pipeline.config.schema import EquivalenceConfig
from pipeline.store import paths
from pipeline.store.artifacts import StageRun

TOLERANCE = 1e-9      # figures by two FP64 code paths: summation order only


def detail(r: dict) -> str:
    flips = r["top1_changed"]
    return (f"top-1 changed at {len(flips)} of {r['n_positions']} positions {flips[:8]}; top-p 0.9 kept "
            f"{r['kept_recorded']} -> {r['kept_variant']} (Jaccard {r['kept_jaccard']:.4g}); "
            f"KL mean {r['kl_mean']:.3g} max {r['kl_max']:.3g}; mean |Δ| {r['mean_abs_diff']:.3g}; "
            f"first differing tensor {r['first_differing_tensor']}; {r['note']}")


def row_checks(rows: list[dict], exact: tuple[str, ...]) -> list[Check]:
    out = []
    for r in rows:
        v, m = r["variation"], r["max_abs_diff"]
        if v in exact:
            measured = m if (m > 0 or math.isnan(m) or r["bit_identical"]) else math.inf   # equal values, other bits
            out.append(Check(f"equivalence_exact_{v}", f"{v} re-run vs the recorded logits, bit for bit "
                             "(expected exact on this device)", 0.0 if r["bit_identical"] else measured, 0.0,
                             "error", detail(r)))
        else:
            out.append(Check(f"equivalence_{v}", f"{v} re-run vs the recorded logits: max |Δ logit| (a finding)",
                             m, 0.0, "report", detail(r)))
    return out


# ---------------------------------------------------------------- the independent recomputation
def plain_logits(snapshot, ids: list[int], variation: str, dtype: torch.dtype, attn: str,
                 fillers: list[list[int]], pad_id: int) -> np.ndarray:
    """The prompt's logits [T, V] of one variation by a plain transformers forward, float64."""
    from transformers import AutoModelForCausalLM
    if variation in ("float32", "float16"):
        dtype = getattr(torch, variation)
    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=dtype, local_files_only=True, use_safetensors=True,
                                                 attn_implementation="sdpa" if variation == "sdpa" else attn).eval()
    batch = [ids]
    if variation.startswith("batch_"):
        batch += [fillers[i % len(fillers)] for i in range(int(variation.split("_")[1]) - 1)]
    width = max(map(len, batch))
    input_ids = torch.tensor([[pad_id] * (width - len(b)) + b for b in batch])
    mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
    position_ids = torch.clamp(torch.cumsum(mask, dim=1) - 1, min=0) * mask + (1 - mask)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if variation == "threads_1" else threads)
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    finally:
        torch.set_num_threads(threads)
    return out.logits[0, width - len(ids):].double().numpy()


def figures(recorded: np.ndarray, variant: np.ndarray, positions: list[int]) -> dict:
    """The matrix's figures written out in numpy float64 (recorded, variant: [P, V] float64)."""
    from transformers import TopPLogitsWarper

    def kept(row):
        scores = TopPLogitsWarper(top_p=0.9)(None, torch.from_numpy(row.astype(np.float32))[None])[0]
        return np.flatnonzero(np.isfinite(scores.numpy()))

    def logsoftmax(x):
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    lp, lq = logsoftmax(recorded), logsoftmax(variant)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    a, b = kept(recorded[-1]), kept(variant[-1])      # the next token's kept set
    d = np.abs(recorded - variant)
    return {"max_abs_diff": d.max(), "mean_abs_diff": d.mean(),
            "top1_changed": [p for p, x, y in zip(positions, recorded.argmax(-1), variant.argmax(-1)) if x != y],
            "kept_recorded": a.size, "kept_variant": b.size,
            "kept_recorded_ids": a.tolist(), "kept_variant_ids": b.tolist(),
            "kept_jaccard": np.intersect1d(a, b).size / np.union1d(a, b).size, "kl_mean": kl.mean(), "kl_max": kl.max(),
            "kl_last": kl[-1]}


def disagreement(stored: dict, mine: dict) -> tuple[float, str]:
    """The largest relative difference of the float figures; inf when a count or list differs."""
    worst, where = 0.0, ""
    for k, want in mine.items():
        got = stored[k]
        if isinstance(want, list | int | np.integer):
            bad = list(got) != list(want) if isinstance(want, list) else int(got) != int(want)
            if bad:
                return math.inf, f"{k}: stored {got}, recomputed {want}"
            continue
        rel = abs(float(got) - float(want)) / max(1.0, abs(float(want)))
        if not rel <= worst:
            worst, where = rel, f"{k}: stored {got!r}, recomputed {float(want)!r}"
    return worst, where


def rederived(matrix, cfg: EquivalenceConfig) -> list[Check]:
    """One check per prompt: `cfg.rederive`'s row (one of `schema.REDERIVABLE`) against its independent
    recomputation."""
    if cfg.rederive is None:
        return []
    out = []
    for pid, (rec, rows) in matrix.prompts.items():
        stored = next(r for r in rows if r["variation"] == cfg.rederive)     # the config has it run (schema)
        s = matrix.setup
        logits = plain_logits(s.snapshot, rec.ids, cfg.rederive, s.dtype, s.attn, matrix.fillers, matrix.pad_id)
        mine = figures(rec.logits.double().numpy(), logits[rec.positions], rec.positions)
        measured, where = disagreement(stored, mine)
        out.append(Check(f"equivalence_rederived_{cfg.rederive}", f"the {cfg.rederive} row's figures vs a plain "
                         "transformers forward and numpy float64 figures of this check's own", measured, TOLERANCE,
                         "error", where or "every figure agrees", prompt_id=pid))
    return out


def record(stage: StageRun, matrix, cfg: EquivalenceConfig) -> list[Check]:
    results = rederived(matrix, cfg)
    for pid, (_, rows) in matrix.prompts.items():
        results += [replace(c, prompt_id=pid) for c in row_checks(rows, cfg.exact)]
    stage.write_parquet(paths.EQUIVALENCE_CHECKS[1], to_table(results))
    return results


def summary_text(results: list[Check]) -> str:
    s = summary(results)
    return (f"{s['checks']} equivalence checks: {s['passed']} pass, {s['failed_error']} error and "
            f"{s['failed_report']} report checks fail"
            + "".join(f"\n  {c.verdict} ({c.severity}) {c.name}: {c.measured:g} > {c.tolerance:g}  {c.detail[:160]}"
                      for c in results if not c.passed))
