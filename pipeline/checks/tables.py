"""The checks on the probs stage's files: table.parquet and filtered.parquet, each stored
value against a second derivation from logits.parquet.

The second derivations share no code with the probs stage: numpy and pyarrow
(`pipeline.checks.rederive`) for probabilities, ranks and kept sets, and, for the kept sets
again, transformers' warpers as `generate`'s own builder makes them (the probs stage builds
its warpers itself, in `pipeline.numerics.sampling`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from pipeline.checks.rederive import kept_rule, ranks, relative_difference, softmax64
from pipeline.checks.verdicts import Check
from pipeline.numerics import probs
from pipeline.store.artifacts import read_parquet

FP64_RTOL = 1e-12     # stored vs numpy FP64 probabilities: measured <= 2.1e-14 (exp and sum order differ)


def _worst(current: tuple[float, str], d: float, where: str) -> tuple[float, str]:
    return (d, where) if d > current[0] or (d == current[0] and not current[1]) else current


def _position(table, pos: int):
    return table.filter(pc.equal(table["position"], pos))


# ---------------------------------------------------------------- table.parquet
def _table(table: Path | pa.Table, columns: list[str] | None = None) -> pa.Table:
    """table.parquet as stored, or as a reader re-derives it (`probs.read_table`, `probs.table=derived`)."""
    return table.select(columns) if isinstance(table, pa.Table) and columns else \
        table if isinstance(table, pa.Table) else read_parquet(table, columns=columns)


def fp64_tables(table_path: Path | pa.Table, rows: dict[int, np.ndarray], temperatures: Sequence[float]) -> list[Check]:
    """Per temperature: the stored (or derived) FP64 column vs numpy's softmax of the stored logits."""
    table = _table(table_path)
    out = []
    for t in temperatures:
        col, worst, sums = probs.prob_column(t), (0.0, ""), []
        for pos, row in rows.items():
            part = _position(table, pos)
            stored = part[col].to_numpy() if col in part.column_names else np.empty(0)
            d, i = relative_difference(stored, softmax64(row, t))
            sums.append(abs(math.fsum(stored.tolist()) - 1.0))
            worst = _worst(worst, d, f"position {pos}" + (f", id {i}" if i >= 0 else ", rows missing"))
        out.append(Check(f"probs_fp64_table_T{t:g}".replace(".", "_"), f"table.parquet {col} vs numpy FP64 "
                         f"softmax(logits.parquet / {t:g}) (max-subtracted exp, math.fsum): max relative difference",
                         worst[0], FP64_RTOL, "error",
                         f"{worst[1]}; |sum(stored) - 1| {max(sums, default=math.nan):.3g}"))
    return out


def fp32_sums(rows: dict[int, np.ndarray], temperatures: Sequence[float], tol32: float) -> list[Check]:
    """A finding, not a comparison: over a large vocabulary a float32 softmax can miss a 2e-6
    sum tolerance (the article's did at T=1 and T=2)."""
    out = []
    for t in temperatures:
        errs = {pos: abs(math.fsum(torch.softmax(torch.from_numpy(row).float() / t, -1).double().tolist()) - 1.0)
                for pos, row in rows.items()}
        worst = max(errs, key=errs.get)
        out.append(Check(f"probs_fp32_sum_T{t:g}".replace(".", "_"), f"|sum(torch float32 softmax(logits / {t:g}))"
                         f" - 1|, summed exactly (a finding: float32 over the whole vocabulary)", errs[worst], tol32,
                         "report", f"position {worst}"))
    return out


def table_columns(table_path: Path | pa.Table, rows: dict[int, np.ndarray]) -> list[Check]:
    """The stored ids and logits are logits.parquet's; the stored ranks are pyarrow's."""
    table = _table(table_path, ["position", "token_id", "logit", "rank"])
    cells, ranked, where = 0, 0, {"cells": "", "ranks": ""}
    for pos, row in rows.items():
        part = _position(table, pos)
        ids, logits, rank = (part[c].to_numpy() for c in ("token_id", "logit", "rank"))
        if ids.size != row.size:
            cells, ranked = cells + abs(ids.size - row.size) + 1, ranked + 1
            where["cells"] = where["ranks"] = f"position {pos}: {ids.size} rows, {row.size} logits"
            continue
        bad = (ids != np.arange(row.size)) | ((logits != row) & ~(np.isnan(logits) & np.isnan(row)))
        wrong_rank = rank != ranks(row)
        cells, ranked = cells + int(bad.sum()), ranked + int(wrong_rank.sum())
        where["cells"] = where["cells"] or (f"position {pos}, first id {int(np.argmax(bad))}" if bad.any() else "")
        where["ranks"] = where["ranks"] or (f"position {pos}, first id {int(np.argmax(wrong_rank))}"
                                            if wrong_rank.any() else "")
    return [Check("probs_table_logits", "table.parquet token_id and logit vs logits.parquet at that position "
                  "(cells differing)", cells, 0, "error", where["cells"]),
            Check("probs_table_ranks", "table.parquet rank vs pyarrow.compute.rank of logits.parquet (descending, "
                  "ties by lower id) (ids differing)", ranked, 0, "error", where["ranks"])]


# ---------------------------------------------------------------- filtered.parquet
def _kept_sets(filtered_path: Path | pa.Table) -> dict[tuple[int, str], dict[str, np.ndarray]]:
    t = _table(filtered_path)
    out = {}
    keys = t.select(["position", "filter"]).group_by(["position", "filter"]).aggregate([]).to_pylist()
    for key in sorted((k["position"], k["filter"]) for k in keys):
        part = t.filter(pc.and_(pc.equal(t["position"], key[0]), pc.equal(t["filter"], key[1])))
        out[key] = {c: part[c].to_numpy(zero_copy_only=False) for c in part.column_names}
    return out


def filtered(filtered_path: Path | pa.Table, rows: dict[int, np.ndarray], named: list[probs.NamedFilter],
             warpers_for: Callable[[probs.NamedFilter], Callable]) -> list[Check]:
    """Each stored kept set vs numpy's rule and vs generate's warpers; its rows vs the config,
    logits.parquet and numpy's order; its probabilities vs numpy FP64. `warpers_for(filter)`:
    the warper list generate would build for it (called on [1, V] float32 scores)."""
    sets, expected = _kept_sets(filtered_path), {(p, f.name): f for p in rows for f in named}
    found = {"numpy": [], "warpers": [], "rows": []}
    worst = (0.0, "")
    for key in sorted(set(sets) | set(expected)):
        got, f = sets.get(key), expected.get(key)
        label = f"{key[1]}@{key[0]}"
        if got is None or f is None:
            for k in found:
                found[k].append(f"{label}: " + ("missing" if got is None else "not configured"))
            continue
        row, s, ids = rows[key[0]], f.settings, got["token_id"].astype(np.int64)
        if (why := kept_rule(row, s.temperature, s.top_k, s.top_p).violation(ids)) is not None:
            found["numpy"].append(f"{label}: {why}")
        if not s.is_greedy:
            scores = warpers_for(f)(None, torch.from_numpy(row.astype(np.float32)).reshape(1, -1))[0]
            want = torch.nonzero(scores != -math.inf).flatten().numpy()
            if not np.array_equal(np.sort(ids), want):
                found["warpers"].append(f"{label}: {ids.size} stored, {want.size} from the warpers "
                                        f"({np.setxor1d(ids, want).size} ids differ)")
        p = softmax64(row, s.temperature if not s.is_greedy else 1.0)
        order = np.lexsort((ids, -p[ids]))
        settings = (got["temperature"] == s.temperature) & (got["top_k"] == s.top_k) & (got["top_p"] == s.top_p)
        rows_ok = settings.all() and np.array_equal(got["kept_rank"], np.arange(1, ids.size + 1)) \
            and np.array_equal(order, np.arange(ids.size)) and np.array_equal(got["logit"], row[ids])
        if not rows_ok:
            found["rows"].append(label)
        before, after = p[ids], p[ids] / math.fsum(p[ids].tolist())
        for name, want in (("prob_before", before), ("prob_after", after)):
            d, i = relative_difference(got[name], want)
            worst = _worst(worst, d, f"{label} {name}" + (f", id {int(ids[i])}" if i >= 0 else ""))

    n, detail = {k: len(v) for k, v in found.items()}, {k: "; ".join(v[:4]) for k, v in found.items()}
    return [
        Check("filtered_sets_numpy", "filtered.parquet kept ids vs numpy's temperature -> top-k -> top-p rule on "
              "logits.parquet (sets differing; a top-p cut within 3.8e-6 of p may go either way)", n["numpy"], 0,
              "error", detail["numpy"]),
        Check("filtered_sets_warpers", "filtered.parquet kept ids vs transformers' warpers, built by generate's "
              "own builder, on logits.parquet (sets differing)", n["warpers"], 0, "error", detail["warpers"]),
        Check("filtered_rows", "filtered.parquet temperature / top_k / top_p, logit and kept_rank vs the config, "
              "logits.parquet and numpy's order (probability desc, id asc) (sets differing)", n["rows"], 0,
              "error", detail["rows"]),
        Check("filtered_probs", "filtered.parquet prob_before and prob_after vs numpy FP64 softmax(logits / T), "
              "renormalised by math.fsum over the kept ids: max relative difference", worst[0], FP64_RTOL,
              "error", worst[1]),
    ]
