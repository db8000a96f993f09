"""Checks on the equivalence matrix, written to the equivalence stage's own checks.parquet.

Own table, not the checks stage's: the matrix re-runs the model several times over; had the checks
stage depended on it, every matrix change would re-run all checks and every checks change the matrix.
The table has the checks stage's schema (`verdicts.SCHEMA`), so readers take either.

- `equivalence_rederived_<v>` (error): `equivalence.rederive`'s row recomputed by its own path: a plain
  transformers forward written out here (own load, own left padding) and every figure in numpy
  float64 (top-p by transformers' `TopPLogitsWarper` called directly); the figures must agree. The
  forward computes what the stage's did and no more: the logits of the recorded positions only
  (logits_to_keep=1 with capture.positions=last) and of the prompt's row only (a batch's LM head sees
  it alone), so the head's matrix product has the stage's shape (a [T, H] x [H, V] product and a
  [1, H] one round a row differently in float32). Not made when the row did not run (its note says why).
- `equivalence_exact_<v>` (error): a variation in `equivalence.exact` is not bit-identical to the record.
- `equivalence_<v>` (report): what the variation changed (max |Δ logit|; the rest in the detail); a
  variation that did not run (not applicable here, or over the memory bound) is this report check,
  measured NaN, its note in the detail: never an error.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from pipeline.checks.verdicts import Check, summary
from pipeline.config.schema import EquivalenceConfig

TOLERANCE = 1e-9      # figures by two FP64 code paths: summation order only


def detail(r: dict) -> str:
    flips = r["top1_changed"]
    return (f"top-1 changed at {len(flips)} of {r['n_positions']} positions {flips[:8]}; top-p 0.9 kept "
            f"{r['kept_recorded']} -> {r['kept_variant']} (Jaccard {r['kept_jaccard']:.4g}); "
            f"KL mean {r['kl_mean']:.3g} max {r['kl_max']:.3g}; mean |Δ| {r['mean_abs_diff']:.3g}; "
            f"first differing tensor {r['first_differing_tensor']}; {r['note']}")


def ran(r: dict) -> bool:
    """Whether the row's variation ran (`compare.empty` marks one that did not with kept_recorded -1)."""
    return r["kept_recorded"] >= 0


def row_checks(rows: list[dict], exact: tuple[str, ...]) -> list[Check]:
    out = []
    for r in rows:
        v, m = r["variation"], r["max_abs_diff"]
        if not ran(r):
            out.append(Check(f"equivalence_{v}", f"{v} re-run vs the recorded logits: did not run here", m, 0.0,
                             "report", r["note"]))
        elif v in exact:
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
                 fillers: list[list[int]], pad_id: int, positions: str = "all") -> torch.Tensor:
    """The prompt's logits of one variation by a plain transformers forward, in the variation's dtype: [T, V],
    or [1, V] (the last position) with positions="last"."""
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
    # the head sees the prompt's row, past its padding: hidden [n, W or 1, H] -> [1, T or 1, H]
    prompt_row = model.get_output_embeddings().register_forward_pre_hook(
        lambda _, args: (args[0][0:1, max(0, args[0].shape[1] - len(ids)):], *args[1:]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if variation == "threads_1" else threads)
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                        logits_to_keep=1 if positions == "last" else 0)
    finally:
        torch.set_num_threads(threads)
        prompt_row.remove()
    return out.logits[0]


def figures(recorded: torch.Tensor, variant: torch.Tensor, positions: list[int], chunk: int = 2**22) -> dict:
    """The matrix's figures written out in numpy float64 (recorded, variant: [P, V], any float dtype), a chunk
    of positions at a time (each float64 copy of [P, V] is 2 x 4TV)."""
    from transformers import TopPLogitsWarper

    def kept(row):
        scores = TopPLogitsWarper(top_p=0.9)(None, torch.from_numpy(row.astype(np.float32))[None])[0]
        return np.flatnonzero(np.isfinite(scores.numpy()))

    def logsoftmax(x):
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    step = max(1, chunk // recorded.shape[-1])
    dmax, dsum, kl, flips = [], 0.0, [], []
    for i in range(0, len(positions), step):
        r, q = recorded[i:i + step].double().numpy(), variant[i:i + step].double().numpy()
        lp, lq = logsoftmax(r), logsoftmax(q)
        kl.append((np.exp(lp) * (lp - lq)).sum(-1))
        d = np.abs(r - q)
        dmax.append(d.max())
        dsum += d.sum()
        flips += [p for p, x, y in zip(positions[i:i + step], r.argmax(-1), q.argmax(-1)) if x != y]
    kl = np.concatenate(kl)
    a, b = kept(recorded[-1].double().numpy()), kept(variant[-1].double().numpy())      # the next token's kept set
    return {"max_abs_diff": np.max(dmax), "mean_abs_diff": dsum / (len(positions) * recorded.shape[-1]),
            "top1_changed": flips, "kept_recorded": a.size, "kept_variant": b.size,
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
        if not ran(stored):              # not applicable here, or over the memory bound: the row says so
            continue
        s = matrix.setup
        logits = plain_logits(s.snapshot, rec.ids, cfg.rederive, s.dtype, s.attn, matrix.fillers, matrix.pad_id,
                              s.spec.positions)
        if len(rec.positions) != logits.shape[0]:          # positions=all computes every row: take the recorded ones
            logits = logits[rec.positions]
        mine = figures(rec.logits, logits, rec.positions)
        del logits
        measured, where = disagreement(stored, mine)
        out.append(Check(f"equivalence_rederived_{cfg.rederive}", f"the {cfg.rederive} row's figures vs a plain "
                         "transformers forward and numpy float64 figures of this check's own", measured, TOLERANCE,
                         "error", where or "every figure agrees", prompt_id=pid))
    return out


def all_checks(matrix, cfg: EquivalenceConfig) -> list[Check]:
    """Every check on the matrix (`pipeline.equivalence.matrix.Matrix`): the re-derived rows, then each prompt's
    row checks."""
    results = rederived(matrix, cfg)
    for pid, (_, rows) in matrix.prompts.items():
        results += [replace(c, prompt_id=pid) for c in row_checks(rows, cfg.exact)]
    return results


def summary_text(results: list[Check]) -> str:
    s = summary(results)
    return (f"{s['checks']} equivalence checks: {s['passed']} pass, {s['failed_error']} error and "
            f"{s['failed_report']} report checks fail"
            + "".join(f"\n  {c.verdict} ({c.severity}) {c.name}: {c.measured:g} > {c.tolerance:g}  {c.detail[:160]}"
                      for c in results if not c.passed))
