"""A recorded run's set-level tables, per prompt: prompt_metrics rows and check verdicts by prompt id.

`nexttoken diff` compares two runs prompt by prompt with these, and `nexttoken sweep` lists each
experiment's prompts from them. The prompt_metrics tables (probs: one row per prompt and
temperature; trajectories: per prompt, branch and kv_cache) carry a `prompt_id` column, and so
does checks.parquet (rows unique on (prompt_id, name)).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from pipeline.checks import verdicts
from pipeline.store import paths

# The columns that, with prompt_id, key a prompt_metrics row (what two runs' rows are matched on).
ROW_KEYS = {paths.PROBS_PROMPT_METRICS: ("temperature",), paths.TRAJECTORY_PROMPT_METRICS: ("branch", "kv_cache")}


def row_label(item: tuple[str, str], row: dict) -> str:
    """How a prompt_metrics row is named in a line: `T=1`, `sample`, `greedy_kv`."""
    if item == paths.PROBS_PROMPT_METRICS:
        return f"T={row['temperature']:g}"
    return row["branch"] + ("_kv" if row["kv_cache"] else "")


def prompt_metrics(root: Path, item: tuple[str, str]) -> dict[str, dict[tuple, dict]] | None:
    """prompt id -> (row key -> row, prompt_id left out); None when the run has no such table."""
    path = paths.artifact(item, root)
    if not path.is_file():
        return None
    out: dict[str, dict[tuple, dict]] = {}
    for row in pq.read_table(path).to_pylist():
        pid = row.pop(paths.PARTITION_KEY)
        out.setdefault(pid, {})[tuple(row[k] for k in ROW_KEYS[item])] = row
    return out


def checks(root: Path) -> dict[str, dict[str, dict]] | None:
    """prompt id -> check name -> its checks.parquet row; None when the run has no checks.parquet.
    Rows by (prompt_id, name) as the audit reads them (`verdicts.stored_rows`)."""
    path = paths.artifact(paths.CHECKS, root)
    if not path.is_file():
        return None
    out: dict[str, dict[str, dict]] = {}
    for (pid, name), row in verdicts.stored_rows(pq.read_table(path)).items():
        out.setdefault(pid, {})[name] = row
    return out


def of_prompt(by_prompt: dict | None, prompt_id: str):
    """One prompt's entry of a `prompt_metrics` or `checks` mapping; None when it has none."""
    return None if by_prompt is None else by_prompt.get(prompt_id)


# ---------------------------------------------------------------- two runs, one prompt
def metric_lines(item: tuple[str, str], rows_a: dict[tuple, dict] | None, rows_b: dict[tuple, dict] | None,
                 labels: tuple[str, str] = ("A", "B")) -> list[str]:
    """One prompt's prompt_metrics rows in two runs, matched on their keys: identical, or per row
    the columns that differ (value in A | in B), and the rows only one run has."""
    head = f"prompt metrics ({item[0]}/{item[1]})"
    if rows_a is None or rows_b is None:
        missing = " and ".join(lab for lab, r in zip(labels, (rows_a, rows_b)) if r is None)
        return [f"  {head}: not recorded for this prompt in {missing}"]
    out = []
    for key in sorted(set(rows_a) | set(rows_b), key=repr):
        x, y = rows_a.get(key), rows_b.get(key)
        if x is None or y is None:
            out.append(f"    {row_label(item, x or y)}: only in {labels[0] if y is None else labels[1]}")
            continue
        changed = [f"{c} {_cell(x[c])} | {_cell(y.get(c))}" for c in x if c in y and x[c] != y[c]]
        changed += [f"{c} only in {labels[0]}" for c in x if c not in y] + \
            [f"{c} only in {labels[1]}" for c in y if c not in x]
        if changed:
            out.append(f"    {row_label(item, x)}: " + "; ".join(changed))
    if not out:
        return [f"  {head}: identical ({len(rows_a)} row(s))"]
    return [f"  {head}: {len(out)} of {len(set(rows_a) | set(rows_b))} row(s) differ", *out]


def check_lines(checks_a: dict[str, dict] | None, checks_b: dict[str, dict] | None,
                labels: tuple[str, str] = ("A", "B")) -> list[str]:
    """One prompt's check verdicts in two runs, by check name: the same, or each that differs."""
    if checks_a is None or checks_b is None:
        missing = " and ".join(lab for lab, r in zip(labels, (checks_a, checks_b)) if r is None)
        return [f"checks: no verdicts for this prompt in {missing}"]
    names = sorted(set(checks_a) | set(checks_b))
    differ = [n for n in names if (checks_a.get(n) or {}).get("verdict") != (checks_b.get(n) or {}).get("verdict")]
    if not differ:
        return [f"checks: same verdicts ({len(names)} checks)"]
    verdict = lambda row: "-" if row is None else row["verdict"]
    return [f"checks: {len(differ)} of {len(names)} verdict(s) differ ({labels[0]} | {labels[1]})",
            *(f"  {n}: {verdict(checks_a.get(n))} | {verdict(checks_b.get(n))}" for n in differ)]


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    text = repr(v)
    return text if len(text) <= 40 else text[:39] + "…"
