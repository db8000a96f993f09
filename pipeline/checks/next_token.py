"""The checks on prompt_metrics.parquet: every row recomputed from the last row of logits.parquet.

The second derivation shares no code with the probs stage (`pipeline.numerics`): numpy's FP64
softmax (`rederive.softmax64`: max-subtracted `exp`, `math.fsum`), numpy's argmax, the
vocabulary read from vocab.parquet, and numpy's temperature -> top-k -> top-p rule written
out from the warpers' (`rederive.kept_rule`: top-k keeps every id scoring at least the k-th;
top-p sorts ascending and drops an id while the cumulative mass up to it is <= 1 - p, never
the last, so the count kept of a group of tied scores is fixed, which ids is not, and a cut
within `rederive.TOP_P_BAND` of p, decided in float32 by the warper, may go either way).

Exact: the keys (the prompt id tokenize.json records, the last prompt position, one row per
`probs.temperatures` in ascending order), top1_id, top1_text and each filter's kept count.
Relative, FP64_RTOL: top1_prob and each kept mass against numpy's; the entropy as
|dH| / (1 + H): a relative error e in every probability moves H = -sum p ln p by at most
e * sum p |ln p + 1| <= e (1 + H), so the bound that holds for the probabilities holds for it
(a plain relative difference would blow up for a distribution with H near 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.checks.rederive import kept_rule, relative_difference, softmax64
from pipeline.checks.tables import FP64_RTOL
from pipeline.checks.verdicts import Check
from pipeline.store.artifacts import read_parquet

KEYS = ("prompt_id", "position", "temperature", "entropy", "top1_id", "top1_text", "top1_prob")


def columns(filters: Sequence) -> list[str]:
    """The columns the table must have: KEYS, then `<filter>_kept` and `<filter>_mass` per filter."""
    return [*KEYS, *(f"{f.name}_{c}" for f in filters for c in ("kept", "mass"))]


def entropy64(p: np.ndarray) -> float:
    nz = p[p > 0]
    return -math.fsum((nz * np.log(nz)).tolist())


def expected_row(row: np.ndarray, t: float, filters: Sequence) -> tuple[dict, dict, dict]:
    """numpy's figures at temperature t: (exact cells, kept-count ranges (lo, hi), FP64 values).

    A filter's mass is that of the `kept` highest probabilities it allows (ties have equal
    probabilities, so which of a tied group are kept does not change it). `filters`: objects
    with `.name` and `.settings` (temperature, top_k, top_p); a greedy one (temperature 0)
    keeps the argmax at any t, its mass at T = 1 (as summary.json reports greedy)."""
    p, top1 = softmax64(row, t), int(np.argmax(row))        # argmax: the lowest id among the maxima
    exact, ranges, values = {"temperature": t, "top1_id": top1}, {}, {"top1_prob": p[top1], "entropy": entropy64(p)}
    for f in filters:
        s = f.settings
        greedy = s.temperature == 0
        rule = kept_rule(row, 0.0 if greedy else t, s.top_k, s.top_p)
        ranges[f.name] = (int(rule.lo.sum()), int(rule.hi.sum()))
        values[f.name] = np.sort(softmax64(row, 1.0 if greedy else t)[rule.allowed])[::-1]
    return exact, ranges, values


def check(path: Path, prompt_id: str, position: int, row: np.ndarray, temperatures: Sequence[float],
          filters: Sequence, vocab_path: Path) -> list[Check]:
    """prompt_metrics.parquet vs numpy on `row` (logits.parquet at `position`, the last prompt
    position); `filters`: the configured ones (`probs.filters`: sampling, then probs.extra_filters)."""
    table, bad, worst = read_parquet(path, filters=[("prompt_id", "=", prompt_id)]), [], (0.0, "")   # its rows
    missing = [c for c in columns(filters) if c not in table.column_names]
    bad += [f"column {c} missing" for c in missing]
    groups = pq.ParquetFile(path).metadata.num_row_groups
    bad += [] if groups == 1 else [f"{groups} row groups"]
    got, temps = table.to_pylist(), sorted(temperatures)
    bad += [] if len(got) == len(temps) else [f"{len(got)} rows with prompt_id {prompt_id!r} for {len(temps)} "
                                              "temperatures"]
    vocab = read_parquet(vocab_path, columns=["token_id", "text"], filters=[("token_id", "=", int(np.argmax(row)))])
    text = vocab["text"][0].as_py() if vocab.num_rows else None
    for t, r in zip(temps, got):
        exact, ranges, values = expected_row(row, t, filters)
        label = f"T={t:g}"
        for k, v in {"prompt_id": prompt_id, "position": position, **exact, "top1_text": text}.items():
            if r.get(k) != v:
                bad.append(f"{label} {k} {r.get(k)!r}, expected {v!r}")
        derived = {"top1_prob": values["top1_prob"]}
        for f in filters:
            (lo, hi), n = ranges[f.name], r.get(f"{f.name}_kept")
            if not (isinstance(n, int) and lo <= n <= hi):
                bad.append(f"{label} {f.name}_kept {n!r}, expected {lo if lo == hi else f'{lo}-{hi}'}")
                n = lo
            derived[f"{f.name}_mass"] = math.fsum(values[f.name][:n].tolist())
        for k, v in derived.items():
            d, _ = relative_difference(np.array([np.nan if r.get(k) is None else r[k]], np.float64), np.array([v]))
            worst = max(worst, (d, f"{label} {k}"))
        h = values["entropy"]
        d = math.inf if r.get("entropy") is None else abs(r["entropy"] - h) / (1.0 + h)
        worst = max(worst, (d if not math.isnan(d) else math.inf, f"{label} entropy"))
    return [
        Check("probs_prompt_metrics_rows", "prompt_metrics.parquet keys, top1_id, top1_text and <filter>_kept vs "
              "tokenize.json's prompt_id, the last prompt position, probs.temperatures (ascending, one row group), "
              "numpy's argmax of logits.parquet, vocab.parquet and numpy's temperature -> top-k -> top-p rule "
              "(cells differing)", len(bad), 0, "error", "; ".join(bad[:4])),
        Check("probs_prompt_metrics_values", "prompt_metrics.parquet top1_prob and <filter>_mass vs numpy FP64 "
              "softmax(logits.parquet's last row / T) (masses summed by math.fsum), and entropy (nats) vs numpy's "
              "as |dH| / (1 + H): max relative difference", worst[0], FP64_RTOL, "error", worst[1]),
    ]
