"""One check's result and the checks table: what was compared, the measured number, its tolerance.

A check passes when measured <= tolerance (NaN, i.e. not measurable, fails). `error` = the
pipeline is broken (the checks stage fails after writing its results); `report` = a
numerical finding (bf16 KV-cache drift, FP32 sums), shown and never failing the run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

SEVERITIES = ("error", "report")
_NAME = re.compile(r"^[A-Za-z0-9_]+$")   # DVC metric keys: no spaces, no dots (dots nest)
SCHEMA = pa.schema([("name", pa.string()), ("what", pa.string()), ("measured", pa.float64()),
                    ("tolerance", pa.float64()), ("verdict", pa.string()), ("severity", pa.string()),
                    ("detail", pa.string())])


@dataclass(frozen=True)
class Check:
    name: str
    what: str          # one line: what is compared with what
    measured: float
    tolerance: float
    severity: str      # "error" | "report"
    detail: str = ""   # where: position / branch / step of the worst case

    def __post_init__(self):
        if not _NAME.match(self.name):
            raise ValueError(f"check name {self.name!r}: letters, digits and _ only")
        if self.severity not in SEVERITIES:
            raise ValueError(f"check {self.name}: severity {self.severity!r} not in {SEVERITIES}")
        object.__setattr__(self, "measured", float(self.measured))
        object.__setattr__(self, "tolerance", float(self.tolerance))

    @property
    def passed(self) -> bool:
        return self.measured <= self.tolerance   # False for NaN: not measured is no pass

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"


def mismatches(got: Sequence, want: Sequence) -> int:
    """Positions that differ, plus the length difference."""
    return sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))


def diff_detail(got: Sequence, want: Sequence) -> str:
    bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if bad is not None:
        return f"first difference at index {bad}: {got[bad]!r} vs {want[bad]!r}"
    return "" if len(got) == len(want) else f"lengths {len(got)} vs {len(want)}"


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| in float64; equal values count 0 (also equal infinities, and NaN on both sides:
    a reproduced NaN is reproduced; `logits_finite` is the check that NaN is there at all);
    NaN on one side and a shape mismatch count inf."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, np.abs(a - b))
    return float(np.nan_to_num(d, nan=math.inf).max()) if d.size else 0.0


def to_table(checks: list[Check]) -> pa.Table:
    names = [c.name for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate check names: {sorted({n for n in names if names.count(n) > 1})}")
    return pa.table({f: [getattr(c, f) for c in checks] for f in SCHEMA.names}, schema=SCHEMA)


def _number(x: float) -> float | None:
    return x if math.isfinite(x) else None   # JSON has no NaN / inf


def metrics(checks: list[Check]) -> dict:
    """metrics.json: a summary and, per check, measured / tolerance / pass / severity."""
    failed = [c for c in checks if not c.passed]
    return {"summary": {"checks": len(checks), "passed": len(checks) - len(failed),
                        "failed_error": sum(c.severity == "error" for c in failed),
                        "failed_report": sum(c.severity == "report" for c in failed)},
            "checks": {c.name: {"measured": _number(c.measured), "tolerance": _number(c.tolerance),
                                "pass": c.passed, "severity": c.severity} for c in checks}}


def failed_errors(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if c.severity == "error" and not c.passed]
