"""The checks stage's work: re-derive every recorded number from the stored artifacts and model.

Each check is a small function returning a `Check` (what it compares, measured value,
tolerance, severity); it passes when measured <= tolerance, and a NaN (not measurable)
fails. `error` = the pipeline is broken (the stage fails after writing its results);
`report` = a numerical finding (bf16 KV-cache drift, FP32 sums), shown and never failing
the run. Earlier stages' own verdicts (facts.json, summary.json booleans) are never used as
measurements: every number is recomputed here from the files and the stored model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline import capture, logits_io, probs, recompute, sampling
from pipeline.artifacts import read_json, read_parquet, read_safetensors
from pipeline import paths
from pipeline.decode import generate_reference
from pipeline.errors import UserError
from pipeline.trajectories import branch_settings

SEVERITIES = ("error", "report")
_NAME = re.compile(r"^[a-z0-9_]+$")   # DVC metric keys: no spaces, no dots (dots nest)
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
    detail: str = ""   # where: position / branch / step, the worst case

    def __post_init__(self):
        if not _NAME.match(self.name):
            raise ValueError(f"check name {self.name!r}: lower-case letters, digits and _ only")
        if self.severity not in SEVERITIES:
            raise ValueError(f"check {self.name}: severity {self.severity!r} not in {SEVERITIES}")
        object.__setattr__(self, "measured", float(self.measured))
        object.__setattr__(self, "tolerance", float(self.tolerance))

    @property
    def passed(self) -> bool:
        return self.measured <= self.tolerance   # False for NaN: not measured is not a pass

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"


def mismatches(got: Sequence, want: Sequence) -> int:
    """Positions that differ, plus the length difference."""
    return sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))


def diff_detail(got: Sequence, want: Sequence) -> str:
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    if bad:
        return f"first difference at index {bad[0]}: {got[bad[0]]!r} vs {want[bad[0]]!r}"
    return "" if len(got) == len(want) else f"lengths {len(got)} vs {len(want)}"


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| in float64; equal values (also equal infinities) count 0, NaN counts inf."""
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    a, b = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d = np.where(a == b, 0.0, np.abs(a - b))
    return float(np.nan_to_num(d, nan=math.inf).max())


# ---------------------------------------------------------------- results
def to_table(checks: list[Check]) -> pa.Table:
    names = [c.name for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate check names: {sorted({n for n in names if names.count(n) > 1})}")
    return pa.table({"name": names, "what": [c.what for c in checks],
                     "measured": [c.measured for c in checks], "tolerance": [c.tolerance for c in checks],
                     "verdict": [c.verdict for c in checks], "severity": [c.severity for c in checks],
                     "detail": [c.detail for c in checks]}, schema=SCHEMA)


def _json_number(x: float) -> float | None:
    return x if math.isfinite(x) else None   # JSON has no NaN/inf; DVC reads null as missing


def metrics(checks: list[Check]) -> dict:
    """metrics.json: a summary and, per check, measured / tolerance / pass / severity."""
    return {"summary": {"checks": len(checks), "passed": sum(c.passed for c in checks),
                        "failed_error": sum(not c.passed and c.severity == "error" for c in checks),
                        "failed_report": sum(not c.passed and c.severity == "report" for c in checks)},
            "checks": {c.name: {"measured": _json_number(c.measured), "tolerance": _json_number(c.tolerance),
                                "pass": c.passed, "severity": c.severity} for c in checks}}


def failed_errors(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if c.severity == "error" and not c.passed]


# ---------------------------------------------------------------- stored artifacts
@dataclass(frozen=True)
class Stored:
    """What the checks read: token ids, the capture, and the paths of the tables."""

    token_ids: list[int]
    token_text: list[str]
    tensors: dict[str, torch.Tensor]     # capture.safetensors
    forward_device: dict                 # facts.json device / gpu_name (where the capture ran)
    logits: Path
    table: Path
    filtered: Path
    steps: Path
    step_logits: Path

    @property
    def captured_logits(self) -> torch.Tensor:           # [1, R, V], R = T or 1
        return self.tensors[capture.act_name("logits")]

    @property
    def logit_positions(self) -> list[int]:
        # Derived from the shapes, not from facts.json: all positions, or the last one.
        n, rows = len(self.token_ids), self.captured_logits.shape[1]
        return list(range(n)) if rows == n else [n - 1]

    def last_row(self) -> np.ndarray:
        """logits.parquet at the last prompt position (float32 = the exact bf16 values)."""
        return logits_io.read_position(self.logits, len(self.token_ids) - 1)

    def steps_rows(self) -> list[dict]:
        return read_parquet(self.steps).to_pylist()


def load(use: Callable[[tuple[str, str]], Path]) -> Stored:
    """Read the artifacts through `use` (StageRun.use: records each as an input)."""
    tokens = read_parquet(use(paths.TOKENS), columns=["token_id", "text"])
    facts = read_json(use(paths.FORWARD_FACTS))
    return Stored(tokens["token_id"].to_pylist(), tokens["text"].to_pylist(), read_safetensors(use(paths.CAPTURE)),
                  {"device": facts.get("device"), "gpu_name": facts.get("gpu_name")},
                  use(paths.LOGITS), use(paths.TABLE), use(paths.FILTERED), use(paths.STEPS), use(paths.STEP_LOGITS))


def device_severity(recorded: dict, device: torch.device) -> str:
    """error when this process computes on the device the capture was made on, else report.

    Matmul results depend on the kernels, so a recomputation on another device can differ
    by rounding without anything being wrong.
    """
    here = {"device": device.type, "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    there = {"device": torch.device(recorded.get("device") or "cpu").type, "gpu_name": recorded.get("gpu_name")}
    return "error" if here == there else "report"


# ---------------------------------------------------------------- tokenizer
def tokenizer_retokenize(tokenizer, text: str, add_special_tokens: bool, stored_ids: list[int]) -> Check:
    ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    return Check("tokenizer_retokenize", "prompt.text tokenized again by the stored tokenizer == tokens.parquet ids",
                 mismatches(ids, stored_ids), 0, "error", diff_detail(ids, stored_ids))


def tokenizer_round_trip(tokenizer, text: str, stored_ids: list[int]) -> Check:
    special = set(tokenizer.all_special_ids)
    decoded = tokenizer.decode([i for i in stored_ids if i not in special], skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)
    return Check("tokenizer_round_trip", "decode(stored ids without special tokens) == prompt.text (characters)",
                 mismatches(decoded, text), 0, "error", diff_detail(decoded, text))


def tokenizer_expected_ids(family: str, expected: list[int] | None, stored_ids: list[int]) -> list[Check]:
    if expected is None:
        return []
    return [Check("tokenizer_expected_ids", f"tokens.parquet ids == prompt.expected_token_ids.{family}",
                  mismatches(stored_ids, expected), 0, "error", diff_detail(stored_ids, expected))]


# ---------------------------------------------------------------- capture and logits file
def capture_input_ids(tensors: dict, stored_ids: list[int]) -> Check:
    got = tensors["input_ids"][0].tolist()
    return Check("capture_input_ids", "input_ids in capture.safetensors == tokens.parquet ids",
                 mismatches(got, stored_ids), 0, "error", diff_detail(got, stored_ids))


def logits_file(path: Path, captured_logits: torch.Tensor, positions: list[int]) -> list[Check]:
    """logits.parquet (float32) == the captured logits, every cell; T x V rows, each cell once.

    Read one row group (= one position, as written) at a time: memory stays one row.
    """
    ref = captured_logits[0].float().numpy()                        # [R, V]: bf16 is exact in float32
    row_of, seen = {p: i for i, p in enumerate(positions)}, []
    n_rows, worst, where, layout = 0, 0.0, "", 0
    pf = pq.ParquetFile(path)
    for g in range(pf.num_row_groups):
        t = pf.read_row_group(g, columns=["position", "token_id", "logit"])
        pos, ids, val = (t[c].to_numpy() for c in ("position", "token_id", "logit"))
        n_rows += len(pos)
        p = int(pos[0]) if len(pos) else -1
        if p not in row_of or (pos != p).any() or not np.array_equal(ids, np.arange(ref.shape[1])):
            layout += 1                                  # not one whole position, ids in order
            continue
        seen.append(p)
        d = max_abs(val, ref[row_of[p]])
        if d > worst or not where:
            k = int(np.argmax(val != ref[row_of[p]]))
            worst, where = d, f"worst position {p} (first differing id {k})" if d else ""
    bad = layout + abs(len(seen) - len(set(seen))) + len(set(positions) - set(seen))
    return [Check("logits_file_rows", f"logits.parquet rows == T x V = {ref.size}, one whole position per "
                  "row group, each position once", abs(n_rows - ref.size) + bad, 0, "error",
                  f"{n_rows} rows, {bad} bad or missing positions"),
            Check("logits_file_exact", "logits.parquet float32 == bf16 logits in capture.safetensors, all cells",
                  worst, 0, "error", where)]


# ---------------------------------------------------------------- recomputations
def lm_head(model, tensors: dict, severity: str) -> Check:
    d = recompute.lm_head_recompute(model, tensors[capture.act_name("final_norm_out")],
                                    tensors[capture.act_name("logits")])
    return Check("lm_head_recompute", "the model's lm_head on stored final_norm_out vs stored logits, all positions",
                 d, 0, severity, "max abs diff")


def layer0_attention(model, tensors: dict, severity: str) -> list[Check]:
    diffs = recompute.layer0_attention_recompute(model, tensors)
    return [Check(f"layer0_attention_{k}", f"layer-0 attention step `{k}` recomputed from the captured step "
                  "before it vs captured", d, 0, severity, "max abs diff") for k, d in diffs.items()]


def residual_adds(tensors: dict, num_layers: int) -> list[Check]:
    out = []
    for i in range(num_layers):
        d = recompute.residual_adds_recompute(tensors, i)
        # Elementwise adds round the same on every device: always an error check.
        out.append(Check(f"residual_adds_layer{i}", f"layer {i}: resid_pre+attn_out == resid_mid and "
                         "resid_mid+mlp_out == resid_post", max(d.values()), 0, "error",
                         ", ".join(f"{k} {v:g}" for k, v in d.items())))
    return out


def future_attention(tensors: dict) -> list[Check]:
    return [Check(f"future_attention_layer{i}", f"layer {i}: largest attention weight on a future position",
                  w, 0, "error", "max over heads and query positions")
            for i, w in sorted(recompute.future_attention_max(tensors).items())]


def fresh_forward(model, tensors: dict, positions: str, severity: str) -> list[Check]:
    """Two hook-free forward passes in this process: vs the captured logits, and vs each other."""
    ids, stored = tensors["input_ids"], tensors[capture.act_name("logits")]
    first = capture.plain_forward_logits(model, ids, positions)
    second = capture.plain_forward_logits(model, ids, positions)
    return [Check("capture_transparent", "fresh plain forward (no hooks, this process) == captured logits, bit for bit",
                  recompute.max_abs_diff(first, stored), 0, severity, f"positions={positions}"),
            Check("repeat_deterministic", "a second fresh plain forward == the first, bit for bit",
                  recompute.max_abs_diff(second, first), 0, severity, "same process")]


# ---------------------------------------------------------------- probabilities
def _t(t: float) -> str:
    return f"{t:g}".replace(".", "_")


def prob_sums(rows: dict[int, np.ndarray], temperatures: Sequence[float], tol64: float,
              tol32: float) -> list[Check]:
    """|sum - 1| of softmax(logits / T) in FP64 (error) and FP32 (report: bf16 logits over a
    large vocabulary can miss a 2e-6 FP32 tolerance, as the article found at T=1 and T=2)."""
    by_t = {t: {} for t in temperatures}
    for pos, row in rows.items():
        for t, tab in sampling.probability_table(torch.from_numpy(row), list(temperatures)).items():
            by_t[t][pos] = tab
    out = []
    for t, tabs in by_t.items():
        for kind, tol, sev in (("fp64", tol64, "error"), ("fp32", tol32, "report")):
            errs = {pos: getattr(tab, f"sum_err{kind[2:]}") for pos, tab in tabs.items()}
            worst = max(errs, key=errs.get)
            out.append(Check(f"probs_{kind}_sum_T{_t(t)}", f"|sum(softmax(logits/{t:g})) - 1| in {kind.upper()}",
                             errs[worst], tol, sev, f"position {worst}"))
    return out


def table_recompute(table_path: Path, rows: dict[int, np.ndarray], temperatures: Sequence[float]) -> list[Check]:
    """table.parquet == a recomputation from logits.parquet; probabilities keep the logits' order."""
    worst, where, inversions, where_inv = 0.0, "", 0, ""
    table = read_parquet(table_path)
    positions = set(table["position"].to_pylist())
    for pos in sorted(positions | set(rows)):
        part = table.filter(pa.compute.equal(table["position"], pos))
        if pos not in rows or part.num_rows != rows.get(pos, np.empty(0)).size:
            worst, where = math.inf, f"position {pos}: in table.parquet and logits.parquet"
            continue
        order = np.argsort(part["token_id"].to_numpy(), kind="stable")
        logits = part["logit"].to_numpy()[order]
        tabs = sampling.probability_table(torch.from_numpy(rows[pos]), list(temperatures))
        checks = {"logit": (logits, rows[pos]), "rank": (part["rank"].to_numpy()[order],
                                                         sampling.ranks(torch.from_numpy(rows[pos])))}
        checks |= {probs.prob_column(t): (part[probs.prob_column(t)].to_numpy()[order], tabs[t].p64)
                   for t in temperatures if probs.prob_column(t) in part.column_names}
        missing = [probs.prob_column(t) for t in temperatures if probs.prob_column(t) not in part.column_names]
        for col, (got, want) in checks.items():
            d = max_abs(got, want)
            if d > worst:
                worst, where = d, f"position {pos}, column {col}"
        if missing:
            worst, where = math.inf, f"position {pos}: columns {missing} missing"
        by_logit = sampling.rank_order(torch.from_numpy(logits))
        for t in temperatures:
            if probs.prob_column(t) in part.column_names:
                p = part[probs.prob_column(t)].to_numpy()[order][by_logit]
                n = int((np.diff(p) > 0).sum())       # a lower logit with a higher probability
                if n:
                    inversions, where_inv = inversions + n, f"position {pos}, T={t:g}"
    return [Check("probs_table_recompute", "table.parquet logits, ranks and FP64 probabilities == a "
                  "recomputation from logits.parquet", worst, 0, "error", where),
            Check("probs_keep_logit_order", "in table.parquet a lower logit never has a higher probability",
                  inversions, 0, "error", where_inv)]


def _kept_sets(filtered_path: Path) -> dict[tuple[int, str], dict]:
    t = read_parquet(filtered_path).to_pydict()
    sets: dict[tuple[int, str], dict] = {}
    for i in range(len(t["position"])):
        s = sets.setdefault((t["position"][i], t["filter"][i]), {"ids": [], "before": [], "after": []})
        s["ids"].append(t["token_id"][i])
        s["before"].append(t["prob_before"][i])
        s["after"].append(t["prob_after"][i])
    return sets


def filtered(filtered_path: Path, rows: dict[int, np.ndarray], named: list) -> list[Check]:
    """filtered.parquet == recomputed kept sets; renormalised sums; top-p minimality."""
    sets, by_name = _kept_sets(filtered_path), {f.name: f.settings for f in named}
    wrong, sum_err, sum_where, not_minimal, min_where = [], 0.0, "", [], ""
    for pos, row in rows.items():
        for name, s in by_name.items():
            got, want = sets.get((pos, name)), sampling.filter_distribution(torch.from_numpy(row), s)
            if got is None or got["ids"] != want.ids.tolist() or max_abs(np.array(got["after"]), want.prob_after) \
                    or max_abs(np.array(got["before"]), want.prob_before):
                wrong.append(f"{name}@{pos}")
            if got is None:
                continue
            err = abs(math.fsum(got["after"]) - 1.0)
            if err >= sum_err:
                sum_err, sum_where = err, f"{name} at position {pos}"
            if s.top_p < 1.0 and not s.is_greedy:
                kept, without = _top_p_masses(row, s, got["ids"])
                if not (kept >= s.top_p > without):
                    not_minimal.append(f"{name}@{pos}")
                min_where = f"{name}@{pos}: kept mass {kept:.9g} >= p={s.top_p:g} > without last {without:.9g}"
    return [Check("filtered_sets_recompute", "filtered.parquet kept ids and probabilities == recomputed from "
                  "logits.parquet (count of differing sets)", len(wrong) + len(set(sets) - {(p, n) for p in rows
                  for n in by_name}), 0, "error", ", ".join(wrong[:5])),
            Check("filtered_renormalised_sum", "|sum(prob_after) - 1| of every stored kept set", sum_err, 1e-12,
                  "error", sum_where),
            Check("top_p_minimality", "top-p sets (p < 1): kept mass >= p and mass without the last kept id < p "
                  "(count of violating sets)", len(not_minimal), 0, "error",
                  ", ".join(not_minimal[:5]) or min_where)]


def _top_p_masses(row: np.ndarray, s: sampling.SamplingSettings, kept: list[int]) -> tuple[float, float]:
    """FP64 mass of the kept ids and without the least likely one, in the distribution top-p
    saw: softmax(logits / T) renormalised over what top-k left (all ids when top_k = 0)."""
    p = torch.softmax(torch.from_numpy(row).double() / s.temperature, dim=-1).numpy()
    if s.top_k:
        base = sampling.warp(torch.from_numpy(row).reshape(1, -1), sampling.SamplingSettings(s.temperature, s.top_k))
        p = p / math.fsum(p[torch.isfinite(base[0]).numpy()].tolist())
    masses = sorted(p[kept].tolist(), reverse=True)
    return math.fsum(masses), math.fsum(masses[:-1])
