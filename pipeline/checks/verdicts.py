"""One check's result and the checks table: what was compared, the measured number, its tolerance.

A check passes when measured <= tolerance (NaN, i.e. not measurable, fails). Each result
belongs to one prompt of the run (`prompt_id`; "" for a check of the whole run). `error` = the
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
FAILING_SHOWN = 3   # failing check names in metrics.json (a `dvc exp show` column)
_NAME = re.compile(r"^[A-Za-z0-9_]+$")   # DVC metric keys: no spaces, no dots (dots nest)
SCHEMA = pa.schema([("prompt_id", pa.string()), ("name", pa.string()), ("what", pa.string()),
                    ("measured", pa.float64()), ("tolerance", pa.float64()), ("verdict", pa.string()),
                    ("severity", pa.string()), ("detail", pa.string())])


@dataclass(frozen=True)
class Check:
    name: str
    what: str          # one line: what is compared with what
    measured: float
    tolerance: float
    severity: str      # "error" | "report"
    detail: str = ""   # where: position / branch / step of the worst case
    # Set (and said in detail) when severity is report only because the two computations compared
    # ran on different devices or GPU models (`suite.kernel_bound`); not a column of checks.parquet.
    device_note: str = ""
    prompt_id: str = ""   # the prompt whose artifacts were checked (the stage sets it)

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


CHUNK = 1 << 20   # elements per step of `max_abs`: its float64 temporaries stay a few MB at any size


def max_abs(a, b) -> float:
    """max |a - b| of two numpy arrays or torch tensors (any dtype, any device), in float64.

    The one comparison of every check: it walks both, flattened, CHUNK elements at a time, so
    comparing two [T, V] logits or [heads, T, T] weights never copies them whole to float64 (a
    CUDA tensor comes to the CPU one chunk at a time). Equal values count 0 (also equal
    infinities, and NaN on both sides: a reproduced NaN is reproduced; `logits_finite` is the
    check that NaN is there at all); NaN on one side counts inf. Shapes that differ count inf,
    never raise: the check then fails naming it, and the other checks still run (a missing row
    is passed as an empty array for that reason).
    """
    if tuple(a.shape) != tuple(b.shape):
        return math.inf
    a, b = _flat(a), _flat(b)
    worst = 0.0
    for start in range(0, a.shape[0], CHUNK):
        x, y = _float64(a[start:start + CHUNK]), _float64(b[start:start + CHUNK])
        with np.errstate(invalid="ignore"):
            d = np.where((x == y) | (np.isnan(x) & np.isnan(y)), 0.0, np.abs(x - y))
        worst = max(worst, float(np.where(np.isnan(d), math.inf, d).max()))
        if worst == math.inf:
            break
    return worst


def _flat(x):
    return x.detach().reshape(-1) if hasattr(x, "detach") else np.ravel(x)   # a view where the layout allows


def _float64(chunk) -> np.ndarray:
    if hasattr(chunk, "detach"):     # torch: convert on the CPU, one chunk
        import torch
        return chunk.to(device="cpu").to(torch.float64).numpy()
    return np.asarray(chunk, dtype=np.float64)


def to_table(checks: list[Check]) -> pa.Table:
    keys = [(c.prompt_id, c.name) for c in checks]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate checks (prompt_id, name): {sorted({k for k in keys if keys.count(k) > 1})}")
    return pa.table({f: [getattr(c, f) for c in checks] for f in SCHEMA.names}, schema=SCHEMA)


def summary(checks: list[Check]) -> dict:
    """The counts: checks, passed, and failed by severity."""
    failed = [c for c in checks if not c.passed]
    return {"checks": len(checks), "passed": len(checks) - len(failed),
            "failed_error": sum(c.severity == "error" for c in failed),
            "failed_report": sum(c.severity == "report" for c in failed)}


def metrics(checks: list[Check]) -> dict:
    """metrics.json (DVC metrics, `dvc exp show` columns): the counts, the names of the failing
    checks (each once over the set), worst first (error before report), and the prompts with a
    failing error check, each at most FAILING_SHOWN then `+N more`, or `none`.
    Each check's measured value and tolerance stay in checks.parquet and the report: as metrics
    they made hundreds of columns and DVC rounds small tolerances (2e-06) to 0."""
    failing = [c.name for c in sorted(checks, key=lambda c: c.severity != "error") if not c.passed]
    return {**summary(checks), "failing": _shown(list(dict.fromkeys(failing))),
            "failing_prompts": _shown([pid for pid in failed_errors_by_prompt(checks) if pid])}


def _shown(names: list[str]) -> str:
    """At most FAILING_SHOWN names, then `+N more`; `none` for none."""
    more = f" +{len(names) - FAILING_SHOWN} more" if len(names) > FAILING_SHOWN else ""
    return ", ".join(names[:FAILING_SHOWN]) + more or "none"


def failed_errors(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if c.severity == "error" and not c.passed]


def failed_errors_by_prompt(checks: list[Check]) -> dict[str, list[str]]:
    """prompt_id -> the names of its failing error checks, prompts in run order (only those with one)."""
    out: dict[str, list[str]] = {}
    for c in checks:
        if c.severity == "error" and not c.passed:
            out.setdefault(c.prompt_id, []).append(c.name)
    return out


def failed_line(checks: list[Check]) -> str:
    """The failing error checks, each prompt's after its names: `a, b (prompt p1); c (prompt p2)`
    ("" when none fails)."""
    return "; ".join(", ".join(names) + (f" (prompt {pid})" if pid else "")
                     for pid, names in failed_errors_by_prompt(checks).items())


def stored_rows(table: pa.Table) -> dict[tuple[str, str], dict]:
    """checks.parquet's rows by (prompt_id, name)."""
    return {(r["prompt_id"], r["name"]): r for r in table.to_pylist()}
