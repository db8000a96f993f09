"""The checks stage's work: re-derive every recorded number from the stored artifacts and model.

Each check is a small function returning a `pipeline.checks.verdicts.Check` (this module: tokenizer,
capture, recomputations, probabilities; `pipeline.checks.trajectory`: the decoding steps).
Earlier stages' own verdicts (facts.json / summary.json booleans) are never used as
measurements: every number is recomputed here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pipeline.checks import recompute
from pipeline.checks.trajectory import generate_parity, greedy_argmax, kv_cache, step1_logits, step_logit_rows
from pipeline.checks.verdicts import Check, diff_detail, max_abs, mismatches
from pipeline.model import capture, loader
from pipeline.numerics import probs, sampling
from pipeline.store import logits_io, paths
from pipeline.store.artifacts import parquet_facts, read_json, read_parquet, read_safetensors


# ---------------------------------------------------------------- stored artifacts
@dataclass(frozen=True)
class Stored:
    """What the checks read: token ids, the capture, where it ran, and the tables' paths.

    The probs and trajectories outputs are None when that stage has no output folder (it
    stopped: e.g. on non-finite logits); their checks are then one failed `<stage>_outputs`.
    """

    token_ids: list[int]
    token_text: list[str]
    tensors: dict[str, torch.Tensor]     # capture.safetensors
    devices: dict[str, dict]             # forward / trajectories -> {"device", "gpu_name"} they ran on
    logits: Path
    table: Path | None
    filtered: Path | None
    steps: Path | None
    step_logits: Path | None

    @property
    def missing(self) -> tuple[str, ...]:
        """The stages whose outputs are absent, in pipeline order."""
        return tuple(stage for stage, p in (("probs", self.table), ("trajectories", self.steps)) if p is None)

    @property
    def logit_positions(self) -> list[int]:
        # From the shapes, not from facts.json: all positions, or the last one.
        n, rows = len(self.token_ids), self.tensors[capture.act_name("logits")].shape[1]
        return list(range(n)) if rows == n else [n - 1]

    def last_row(self) -> np.ndarray:
        """logits.parquet at the last prompt position (float32 = the exact bf16 values)."""
        return logits_io.read_position(self.logits, len(self.token_ids) - 1)


OPTIONAL_STAGES = ("probs", "trajectories")   # they refuse non-finite logits; forward and logits record them


def load(use: Callable[[tuple[str, str]], Path], root: Path | str) -> Stored:
    """Read the artifacts through `use` (StageRun.use: records each one as an input).

    An OPTIONAL_STAGES stage without an output folder (DVC removes a failed stage's outputs)
    is recorded as missing; any other absent or partial output stays an error (from `use`).
    """
    def optional(item: tuple[str, str]) -> Path | None:
        return use(item) if item[0] not in OPTIONAL_STAGES or paths.stage_dir(item[0], root).exists() else None

    tokens = read_parquet(use(paths.TOKENS), columns=["token_id", "text"])
    facts, step_logits = read_json(use(paths.FORWARD_FACTS)), optional(paths.STEP_LOGITS)
    traj = parquet_facts(step_logits) if step_logits else {}
    devices = {"forward": {"device": facts.get("device"), "gpu_name": facts.get("gpu_name")},
               "trajectories": {"device": traj.get("device"), "gpu_name": traj.get("gpu_name")}}
    return Stored(tokens["token_id"].to_pylist(), tokens["text"].to_pylist(), read_safetensors(use(paths.CAPTURE)),
                  devices, use(paths.LOGITS), optional(paths.TABLE), optional(paths.FILTERED), optional(paths.STEPS),
                  step_logits)


def _where(record: dict) -> str:
    device = torch.device(record.get("device") or "cpu")
    if device.type != "cuda":
        return device.type
    return f"{device.type} ({record.get('gpu_name') or 'GPU model not recorded'})"


def device_difference(a: tuple[str, dict], b: tuple[str, dict]) -> str:
    """"" when two computations ((label, {"device", "gpu_name"})) ran on the same kind of device
    and GPU model, else a sentence saying where each ran. A CUDA run whose GPU model was not
    recorded counts as another GPU: nothing says its kernels were these."""
    (la, ra), (lb, rb) = a, b
    if _where(ra) == _where(rb) and "not recorded" not in _where(ra):
        return ""
    return f"report, not error: {la} ran on {_where(ra)}, {lb} on {_where(rb)}, whose kernels may round differently"


def kernel_bound(checks: Sequence[Check], a: tuple[str, dict], b: tuple[str, dict]) -> list[Check]:
    """Checks comparing a computation of run `a` with one of run `b`, bit for bit: on another
    device or GPU model the kernels differ, and so may the bits with nothing broken, so there
    they become reports whose detail says why (an audit of a GPU run on a CPU never fails on
    them); on the same kind of device they stay as made (errors)."""
    why = device_difference(a, b)
    if not why:
        return list(checks)
    return [replace(c, severity="report", detail=f"{c.detail}; {why}" if c.detail else why, device_note=why)
            for c in checks]


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


def logits_finite(captured_logits: torch.Tensor, positions: list[int]) -> Check:
    """Count of NaN / Inf logits in the capture, naming the positions (and first ids) that have them.

    The forward and logits stages record non-finite logits as computed; probs and
    trajectories refuse them, so this check is where such a run is recorded as failed.
    """
    logits, found = captured_logits[0], {}                      # [R, V]; row -> (count, first ids)
    for start in range(0, logits.shape[0], 64):     # 64 rows at a time: a bool mask of [R, V] summed in
        bad = ~torch.isfinite(logits[start:start + 64])  # int64 was this stage's largest allocation
        for r in bad.any(dim=-1).nonzero().flatten().tolist():
            found[start + r] = (int(bad[r].count_nonzero()), bad[r].nonzero().flatten()[:3].tolist())
    rows = sorted(found)
    shown = rows if len(rows) <= 3 else [rows[0], rows[1], rows[-1]]
    per_row = [f"position {positions[r]}: {found[r][0]} ids (first: {found[r][1]})" for r in shown]
    detail = f"positions {_ranges([positions[r] for r in rows])} ({len(rows)} of {len(positions)}); " + \
        "; ".join(per_row) if rows else f"{logits.numel()} values, all finite"
    return Check("logits_finite", "count of NaN / Inf values among the captured logits (every position and id)",
                 sum(n for n, _ in found.values()), 0, "error", detail)


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def outputs_missing(stage: str) -> Check:
    """A stage whose outputs the checks need did not complete: its checks could not run."""
    return Check(f"{stage}_outputs", f"artifacts/{stage} is there for its checks", math.nan, 0, "error",
                 f"artifacts/{stage} is missing: the {stage} stage did not complete (see logits_finite), "
                 f"so its checks did not run")


def capture_input_ids(tensors: dict, stored_ids: list[int]) -> Check:
    return _ids("capture_input_ids", "input_ids in capture.safetensors == tokens.parquet ids",
                tensors["input_ids"][0].tolist(), stored_ids)


def logits_file(path: Path, captured_logits: torch.Tensor, positions: list[int]) -> list[Check]:
    """logits.parquet (float32) == the captured logits in every cell; T x V rows, each position once.

    One row group (= one whole position, as written) at a time, against that captured row
    widened alone: memory stays one row (bf16 is exact in float32).
    """
    ref = captured_logits[0]                                        # [R, V], computed dtype
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
        want = ref[row_of[p]].float().numpy()
        if (d := max_abs(val, want)) > worst:
            worst, worst_at = d, f"position {p}, first differing id {int(np.argmax(val != want))}"
    bad += len(seen) - len(set(seen)) + len(set(positions) - set(seen))
    return [Check("logits_file_rows", f"logits.parquet has T x V = {ref.numel()} rows, one whole position per row "
                  "group, each position once", abs(n_rows - ref.numel()) + bad, 0, "error",
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
                  "bit for bit", max_abs(first, stored), 0, severity, f"positions={positions}"),
            Check("repeat_deterministic", "a second fresh plain forward == the first, bit for bit",
                  max_abs(second, first), 0, severity, "same process")]


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


# ---------------------------------------------------------------- all of them
def run_all(stored: Stored, model, tokenizer, cfg: dict, device: torch.device, eos_ids: set[int]) -> list[Check]:
    """Every check, in pipeline order. cfg: the typed sections model, prompt, probs, sampling, checks.

    A missing probs or trajectories stage (`Stored.missing`) replaces its checks with one
    failed `<stage>_outputs` check; the others run as usual.
    """
    ids, tensors, m, p_cfg, prompt = stored.token_ids, stored.tensors, cfg["model"], cfg["probs"], cfg["prompt"]
    # Where each compared computation ran: the stored runs, and this process (the checks stage or an audit).
    here, fwd, traj = ("this check", loader.device_record(model, device)), ("forward", stored.devices["forward"]), \
        ("trajectories", stored.devices["trajectories"])
    mode = "all" if len(stored.logit_positions) == len(ids) else "last"
    transparent, repeat = fresh_forward(model, tensors, mode, "error")
    rows = {p: logits_io.read_position(stored.logits, p)
            for p in probs.resolve_positions(p_cfg.positions, len(ids), stored.logit_positions)}
    out = [
        tokenizer_retokenize(tokenizer, prompt.text, m.tokenizer.add_special_tokens, ids),
        tokenizer_round_trip(tokenizer, prompt.text, ids),
        *tokenizer_expected_ids(tokenizer, m.tokenizer.family, prompt.expected_ids_for(m.tokenizer.family),
                                prompt.text, ids),
        capture_input_ids(tensors, ids),
        logits_finite(tensors[capture.act_name("logits")], stored.logit_positions),
        *logits_file(stored.logits, tensors[capture.act_name("logits")], stored.logit_positions),
        *kernel_bound([lm_head(model, tensors, "error"), *layer0_attention(model, tensors, "error")], fwd, here),
        *residual_adds(tensors, len(capture.decoder_layers(model))),
        *future_attention(tensors),
        *kernel_bound([transparent], fwd, here), repeat,      # repeat: two passes of this process
        *prob_sums(rows, p_cfg.temperatures, p_cfg.fp64_sum_tolerance, p_cfg.fp32_sum_tolerance),
    ]
    if stored.table is None:
        out.append(outputs_missing("probs"))
    else:
        out += [*table_recompute(stored.table, rows, p_cfg.temperatures),
                *filtered(stored.filtered, rows, probs.filters(p_cfg, cfg["sampling"]))]
    if stored.steps is None:
        return out + [outputs_missing("trajectories")]
    last, steps, step_rows = stored.last_row(), read_parquet(stored.steps).to_pylist(), \
        step_logit_rows(stored.step_logits)
    greedy = greedy_argmax(steps, step_rows, last)
    return out + [
        *kernel_bound(step1_logits(step_rows, last, "error"), traj, fwd),
        *kernel_bound(greedy[:1], traj, fwd), *greedy[1:],          # step 1 vs the forward's argmax; own rows
        *kv_cache(steps, step_rows, cfg["checks"].kv_cache_atol),
        *kernel_bound(generate_parity(model, ids, steps, cfg["sampling"], eos_ids, device), traj, here),
    ]
