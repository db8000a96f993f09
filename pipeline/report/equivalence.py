"""The report's equivalence matrix: how far each variation of the forward pass moved the recorded numbers.

A section of its own, appended by the report stage when the equivalence stage ran for the prompt
the report details (`equivalence.prompts` may choose others); no I/O but the reads through `use`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from pipeline.report.markdown import name, src, table, yes
from pipeline.store import paths
from pipeline.store.artifacts import read_parquet

HEADERS = ["variation", "compared", "max \\|Δ logit\\|", "mean \\|Δ logit\\|", "top-1 changed at",
           "top-p 0.9 kept (record → variant)", "Jaccard", "KL mean", "KL max", "bit-identical",
           "first differing tensor"]


def load(use: Callable[..., Path], prompt_id: str, root: Path | str = ".") -> list[dict] | None:
    """The prompt's matrix rows, or None when the equivalence stage did not run for it."""
    if not paths.partition(paths.EQUIVALENCE, prompt_id, root).is_file():
        return None
    return read_parquet(use(paths.EQUIVALENCE, prompt_id)).to_pylist()


def _g(x: float) -> str:
    return "n/a" if x is None else "NaN" if math.isnan(x) else f"{x:.3g}"


def _row(r: dict) -> list:
    if r["kept_recorded"] < 0:      # did not run: its note says why ("not applicable: ..." or "not run: ...")
        return [name(r["variation"]), r["compared"], r["note"], *[""] * 8]
    flips = r["top1_changed"]
    worst = "NaN (the variant's logits hold NaN)" if math.isnan(r["max_abs_diff"]) else _g(r["max_abs_diff"])
    return [name(r["variation"]), f"{r['compared']} ({r['n_positions']})", worst,
            _g(r["mean_abs_diff"]), ", ".join(map(str, flips)) if flips else "none",
            f"{r['kept_recorded']} → {r['kept_variant']}", f"{r['kept_jaccard']:.4f}", _g(r["kl_mean"]),
            _g(r["kl_max"]), yes(r["bit_identical"]),
            name(r["first_differing_tensor"]) if r["first_differing_tensor"] else "none"]


def markdown(rows: list[dict] | None, prompt_id: str) -> str:
    """The section as text to append to report.md ("" when the matrix did not run for the prompt)."""
    return "" if rows is None else "\n" + "\n".join(section(rows, prompt_id)).rstrip("\n") + "\n"


def section(rows: list[dict], prompt_id: str) -> list[str]:
    return ["## What changes the numbers (equivalence matrix)", "",
            "The prompt's forward pass re-run under each variation against the recorded one (the KV-cache rows: "
            "the trajectories' stored step logits with and without the cache). Differences in float64 over every "
            "position and id; top-p at T = 1 for the next token; KL(record ‖ variant) in FP64 at T = 1.", "",
            *table(HEADERS, [_row(r) for r in rows], src(paths.EQUIVALENCE, prompt_id))]
