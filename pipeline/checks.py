"""The checks stage's work: re-derive every recorded number from the stored artifacts and model.

Each check is a small function returning a `Check`; it passes when measured <= tolerance
(NaN, i.e. not measurable, fails). `error` = the pipeline is broken (the stage fails after
writing its results); `report` = a numerical finding (bf16 KV-cache drift, FP32 sums), shown
and never failing the run. Earlier stages' own verdicts (facts.json / summary.json booleans)
are never used as measurements: every number is recomputed here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pipeline import capture, logits_io, paths, probs, recompute, sampling
from pipeline.artifacts import parquet_facts, read_json, read_parquet, read_safetensors
from pipeline.decode import generate_reference
from pipeline.trajectories import branch_settings

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
    """max |a - b| in float64; equal values (also infinities) count 0, NaN and a shape mismatch inf."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d = np.where(a == b, 0.0, np.abs(a - b))
    return float(np.nan_to_num(d, nan=math.inf).max()) if d.size else 0.0


# ---------------------------------------------------------------- results
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


# ---------------------------------------------------------------- stored artifacts
@dataclass(frozen=True)
class Stored:
    """What the checks read: token ids, the capture, where it ran, and the tables' paths."""

    token_ids: list[int]
    token_text: list[str]
    tensors: dict[str, torch.Tensor]     # capture.safetensors
    devices: dict[str, dict]             # forward / trajectories -> {"device", "gpu_name"} they ran on
    logits: Path
    table: Path
    filtered: Path
    steps: Path
    step_logits: Path

    @property
    def logit_positions(self) -> list[int]:
        # From the shapes, not from facts.json: all positions, or the last one.
        n, rows = len(self.token_ids), self.tensors[capture.act_name("logits")].shape[1]
        return list(range(n)) if rows == n else [n - 1]

    def last_row(self) -> np.ndarray:
        """logits.parquet at the last prompt position (float32 = the exact bf16 values)."""
        return logits_io.read_position(self.logits, len(self.token_ids) - 1)


def load(use: Callable[[tuple[str, str]], Path]) -> Stored:
    """Read the artifacts through `use` (StageRun.use: records each one as an input)."""
    tokens = read_parquet(use(paths.TOKENS), columns=["token_id", "text"])
    facts, step_logits = read_json(use(paths.FORWARD_FACTS)), use(paths.STEP_LOGITS)
    devices = {"forward": {"device": facts.get("device"), "gpu_name": facts.get("gpu_name")},
               "trajectories": {"device": parquet_facts(step_logits).get("device"), "gpu_name": None}}
    return Stored(tokens["token_id"].to_pylist(), tokens["text"].to_pylist(), read_safetensors(use(paths.CAPTURE)),
                  devices, use(paths.LOGITS), use(paths.TABLE), use(paths.FILTERED), use(paths.STEPS), step_logits)


def device_record(device: torch.device) -> dict:
    return {"device": device.type, "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def device_severity(a: dict, b: dict) -> str:
    """error when two computations ran on the same kind of device, else report: matmul results
    depend on the kernels, so another device may round differently with nothing broken.
    A gpu_name of None (not recorded) compares the device type only."""
    names = (a.get("gpu_name"), b.get("gpu_name"))
    same = torch.device(a.get("device") or "cpu").type == torch.device(b.get("device") or "cpu").type
    return "error" if same and (None in names or names[0] == names[1]) else "report"


# ---------------------------------------------------------------- tokenizer and capture
def _ids(name: str, what: str, got: list, want: list) -> Check:
    return Check(name, what, mismatches(got, want), 0, "error", diff_detail(got, want))


def tokenizer_retokenize(tokenizer, text: str, add_special_tokens: bool, stored_ids: list[int]) -> Check:
    return _ids("tokenizer_retokenize", "prompt.text tokenized again by the stored tokenizer == tokens.parquet ids",
                tokenizer(text, add_special_tokens=add_special_tokens).input_ids, stored_ids)


def tokenizer_round_trip(tokenizer, text: str, stored_ids: list[int]) -> Check:
    special = set(tokenizer.all_special_ids)
    decoded = tokenizer.decode([i for i in stored_ids if i not in special], skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)
    return _ids("tokenizer_round_trip", "decode(stored ids without special tokens) == prompt.text (characters)",
                decoded, text)


def tokenizer_expected_ids(tokenizer, family: str, expected: list[int] | None, text: str,
                           stored_ids: list[int]) -> list[Check]:
    """Stored ids == prompt.expected_token_ids.<family>: an error when the expected ids decode to
    prompt.text (the tokenizer now segments this very text differently), a report when they do
    not (they were written for another text: stale after a `prompt.text` override, or mistyped)."""
    if expected is None:
        return []
    try:
        own = tokenizer.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text
    except (IndexError, OverflowError, TypeError, ValueError):   # ids the tokenizer does not have
        own = False
    what = f"tokens.parquet ids == prompt.expected_token_ids.{family}" + (
        "" if own else " (report: those ids do not decode to prompt.text)")
    return [Check("tokenizer_expected_ids", what, mismatches(stored_ids, expected), 0, "error" if own else "report",
                  diff_detail(stored_ids, expected))]


def capture_input_ids(tensors: dict, stored_ids: list[int]) -> Check:
    return _ids("capture_input_ids", "input_ids in capture.safetensors == tokens.parquet ids",
                tensors["input_ids"][0].tolist(), stored_ids)


def logits_file(path: Path, captured_logits: torch.Tensor, positions: list[int]) -> list[Check]:
    """logits.parquet (float32) == the captured logits in every cell; T x V rows, each position once.

    One row group (= one whole position, as written) at a time: memory stays one row.
    """
    ref = captured_logits[0].float().numpy()                        # [R, V]: bf16 is exact in float32
    row_of, seen, n_rows, worst, worst_at, bad = {p: i for i, p in enumerate(positions)}, [], 0, 0.0, "", 0
    pf = pq.ParquetFile(path)
    for g in range(pf.num_row_groups):
        t = pf.read_row_group(g, columns=["position", "token_id", "logit"])
        pos, ids, val = (t[c].to_numpy() for c in ("position", "token_id", "logit"))
        n_rows, p = n_rows + len(pos), int(pos[0]) if len(pos) else -1
        if p not in row_of or (pos != p).any() or not np.array_equal(ids, np.arange(ref.shape[1])):
            bad += 1
            continue
        seen.append(p)
        if (d := max_abs(val, ref[row_of[p]])) > worst:
            worst, worst_at = d, f"position {p}, first differing id {int(np.argmax(val != ref[row_of[p]]))}"
    bad += len(seen) - len(set(seen)) + len(set(positions) - set(seen))
    return [Check("logits_file_rows", f"logits.parquet has T x V = {ref.size} rows, one whole position per row "
                  "group, each position once", abs(n_rows - ref.size) + bad, 0, "error",
                  f"{n_rows} rows, {bad} bad, repeated or missing positions"),
            Check("logits_file_exact", "logits.parquet float32 == bf16 logits in capture.safetensors, all cells",
                  worst, 0, "error", worst_at)]


# ---------------------------------------------------------------- recomputations
def lm_head(model, tensors: dict, severity: str) -> Check:
    d = recompute.lm_head_recompute(model, tensors[capture.act_name("final_norm_out")],
                                    tensors[capture.act_name("logits")])
    return Check("lm_head_recompute", "the model's lm_head on stored final_norm_out vs stored logits, all positions",
                 d, 0, severity, "max abs diff")


def layer0_attention(model, tensors: dict, severity: str) -> list[Check]:
    return [Check(f"layer0_attention_{k}", f"layer-0 attention step {k}, recomputed from the captured step before "
                  "it, vs captured", d, 0, severity, "max abs diff")
            for k, d in recompute.layer0_attention_recompute(model, tensors).items()]


def residual_adds(tensors: dict, num_layers: int) -> list[Check]:
    # An elementwise add rounds the same on every device: an error check wherever it runs.
    out = []
    for i in range(num_layers):
        d = recompute.residual_adds_recompute(tensors, i)
        out.append(Check(f"residual_adds_layer{i}", f"layer {i}: resid_pre + attn_out == resid_mid and resid_mid "
                         "+ mlp_out == resid_post", max(d.values()), 0, "error",
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
    return [Check("capture_transparent", "a fresh plain forward (no hooks, this process) == the captured logits, "
                  "bit for bit", recompute.max_abs_diff(first, stored), 0, severity, f"positions={positions}"),
            Check("repeat_deterministic", "a second fresh plain forward == the first, bit for bit",
                  recompute.max_abs_diff(second, first), 0, severity, "same process")]


# ---------------------------------------------------------------- probabilities
def prob_sums(rows: dict[int, np.ndarray], temperatures: Sequence[float], tol64: float, tol32: float) -> list[Check]:
    """|sum - 1| of softmax(logits / T) in FP64 (error) and FP32 (report: over a large vocabulary
    FP32 can miss a 2e-6 tolerance, as the article's did at T=1 and T=2)."""
    tabs = {pos: sampling.probability_table(torch.from_numpy(row), list(temperatures)) for pos, row in rows.items()}
    out = []
    for t in temperatures:
        for kind, tol, severity in (("fp64", tol64, "error"), ("fp32", tol32, "report")):
            errs = {pos: getattr(tab[t], "sum_err" + kind[2:]) for pos, tab in tabs.items()}
            worst = max(errs, key=errs.get)
            out.append(Check(f"probs_{kind}_sum_T{t:g}".replace(".", "_"), f"|sum(softmax(logits / {t:g})) - 1| in "
                             f"{kind.upper()}", errs[worst], tol, severity, f"position {worst}"))
    return out


def table_recompute(table_path: Path, rows: dict[int, np.ndarray], temperatures: Sequence[float]) -> list[Check]:
    """table.parquet == a recomputation from logits.parquet; its probabilities keep the logits' order."""
    table, cols = read_parquet(table_path), [probs.prob_column(t) for t in temperatures]
    worst, worst_at, inversions, inv_at = 0.0, "", 0, ""
    for pos, row in rows.items():
        part, logits = table.filter(pc.equal(table["position"], pos)), torch.from_numpy(row)
        tabs = sampling.probability_table(logits, list(temperatures))
        want = {"token_id": np.arange(row.size), "logit": row, "rank": sampling.ranks(logits),
                **{c: tabs[t].p64 for c, t in zip(cols, temperatures)}}
        got = {c: part[c].to_numpy() if c in part.column_names else np.empty(0) for c in want}
        for c in want:
            if (d := max_abs(got[c], want[c])) > worst:
                worst, worst_at = d, f"position {pos}, column {c}"
        order = sampling.rank_order(logits)                 # logit descending
        for c in cols:
            n = int((np.diff(got[c][order]) > 0).sum()) if got[c].size == row.size else 0
            inversions, inv_at = inversions + n, f"position {pos}, {c}" if n else inv_at
    return [Check("probs_table_recompute", "table.parquet ids, logits, ranks and FP64 probabilities == a "
                  "recomputation from logits.parquet", worst, 0, "error", worst_at),
            Check("probs_keep_logit_order", "table.parquet: count of lower logits with a higher probability",
                  inversions, 0, "error", inv_at)]


def _kept_sets(filtered_path: Path) -> dict[tuple[int, str], dict]:
    sets: dict[tuple[int, str], dict] = {}
    for r in read_parquet(filtered_path, columns=["position", "filter", "token_id", "prob_before",
                                                  "prob_after"]).to_pylist():
        s = sets.setdefault((r["position"], r["filter"]), {"ids": [], "before": [], "after": []})
        for key, col in (("ids", "token_id"), ("before", "prob_before"), ("after", "prob_after")):
            s[key].append(r[col])
    return sets


def filtered(filtered_path: Path, rows: dict[int, np.ndarray], named: list[probs.NamedFilter]) -> list[Check]:
    """filtered.parquet == the recomputed kept sets; renormalised sums; top-p minimality."""
    sets, wrong, sum_err, sum_at, not_minimal, margins = _kept_sets(filtered_path), [], 0.0, "", [], ""
    for pos, row in rows.items():
        for f in named:
            got, want = sets.get((pos, f.name)), sampling.filter_distribution(torch.from_numpy(row), f.settings)
            if got is None or got["ids"] != want.ids.tolist() or max_abs(np.array(got["after"]), want.prob_after) \
                    or max_abs(np.array(got["before"]), want.prob_before):
                wrong.append(f"{f.name}@{pos}")
            if got is None:
                continue
            if (err := abs(math.fsum(got["after"]) - 1.0)) >= sum_err:
                sum_err, sum_at = err, f"{f.name} at position {pos}"
            if f.settings.top_p < 1.0 and not f.settings.is_greedy:
                kept, without = _top_p_masses(row, f.settings, got["ids"])
                if not kept >= f.settings.top_p > without:
                    not_minimal.append(f"{f.name}@{pos}")
                margins = f"{f.name}@{pos}: kept {kept:.9g} >= p {f.settings.top_p:g} > without last {without:.9g}"
    extra = set(sets) - {(p, f.name) for p in rows for f in named}
    return [Check("filtered_sets_recompute", "filtered.parquet kept ids and probabilities == recomputed from "
                  "logits.parquet (sets differing)", len(wrong) + len(extra), 0, "error",
                  ", ".join(wrong[:5] + [f"unexpected {n}@{p}" for p, n in sorted(extra)[:3]])),
            Check("filtered_renormalised_sum", "|sum(prob_after) - 1| of every stored kept set", sum_err, 1e-12,
                  "error", sum_at),
            Check("top_p_minimality", "top-p sets (p < 1): kept mass >= p and mass without the last kept id < p "
                  "(sets violating)", len(not_minimal), 0, "error", ", ".join(not_minimal[:5]) or margins)]


def _top_p_masses(row: np.ndarray, s: sampling.SamplingSettings, kept: list[int]) -> tuple[float, float]:
    """FP64 mass of the kept ids, with and without the least likely one, in the distribution
    top-p filtered: softmax(logits / T) renormalised over what top-k left (all ids if top_k = 0).
    (Membership is decided in float32, as in generate; FP64 could disagree only within float32
    rounding of p, and that would show here.)"""
    p = torch.softmax(torch.from_numpy(row).double() / s.temperature, dim=-1).numpy()
    if s.top_k:
        top_k = sampling.warp(torch.from_numpy(row), sampling.SamplingSettings(s.temperature, s.top_k))
        p = p / math.fsum(p[torch.isfinite(top_k).numpy()].tolist())
    masses = sorted(p[kept].tolist(), reverse=True)
    return math.fsum(masses), math.fsum(masses[:-1])


# ---------------------------------------------------------------- trajectories
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
    """model.generate == the stored ids of each branch (its no-cache run when one was recorded)."""
    out = []
    for b in sorted({r["branch"] for r in steps}):
        kv = not any(r["branch"] == b and not r["kv_cache"] for r in steps)
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


# ---------------------------------------------------------------- all of them
def run_all(stored: Stored, model, tokenizer, cfg: dict, device: torch.device, eos_ids: set[int]) -> list[Check]:
    """Every check, in pipeline order. cfg: the typed sections model, prompt, probs, sampling, checks."""
    ids, tensors, m, p_cfg, prompt = stored.token_ids, stored.tensors, cfg["model"], cfg["probs"], cfg["prompt"]
    sev_forward = device_severity(stored.devices["forward"], device_record(device))
    sev_steps = device_severity(stored.devices["trajectories"], stored.devices["forward"])
    mode = "all" if len(stored.logit_positions) == len(ids) else "last"
    rows = {p: logits_io.read_position(stored.logits, p)
            for p in probs.resolve_positions(p_cfg.positions, len(ids), stored.logit_positions)}
    last, steps, step_rows = stored.last_row(), read_parquet(stored.steps).to_pylist(), \
        step_logit_rows(stored.step_logits)
    return [
        tokenizer_retokenize(tokenizer, prompt.text, m.tokenizer.add_special_tokens, ids),
        tokenizer_round_trip(tokenizer, prompt.text, ids),
        *tokenizer_expected_ids(tokenizer, m.tokenizer.family, prompt.expected_ids_for(m.tokenizer.family),
                                prompt.text, ids),
        capture_input_ids(tensors, ids),
        *logits_file(stored.logits, tensors[capture.act_name("logits")], stored.logit_positions),
        lm_head(model, tensors, sev_forward),
        *layer0_attention(model, tensors, sev_forward),
        *residual_adds(tensors, len(capture.decoder_layers(model))),
        *future_attention(tensors),
        *fresh_forward(model, tensors, mode, sev_forward),
        *prob_sums(rows, p_cfg.temperatures, p_cfg.fp64_sum_tolerance, p_cfg.fp32_sum_tolerance),
        *table_recompute(stored.table, rows, p_cfg.temperatures),
        *filtered(stored.filtered, rows, probs.filters(p_cfg, cfg["sampling"])),
        *step1_logits(step_rows, last, sev_steps),
        *greedy_argmax(steps, step_rows, last),
        *kv_cache(steps, step_rows, cfg["checks"].kv_cache_atol),
        *generate_parity(model, ids, steps, cfg["sampling"], eos_ids, device),
    ]
