"""Compare a run with the figures a published reference run reports (pipeline/reference/*.yaml).

`gather` collects each figure's measured counterpart from the stored artifacts into plain
data shaped like the reference file; `compare(measured, reference, part)` turns the pair
into Checks, each with its tolerance: ids, texts, shapes, logits and consistency values
exact; probabilities to the printed digits (4 decimals: |diff| <= 0.5e-4); embedding
coordinates to 6 decimals (<= 0.5e-6).

Severity: figures fixed by the model files and tokenizer (ids, pieces, byte split, vocabulary
and layer sizes, embedding rows) are `error`; figures of the run (logits, probabilities,
trajectories, recompute values) are `report`, as another GPU or library version may round
differently without anything being broken. Figures that depend on the prompt are only
compared when the prompt is the reference prompt.

The tokenizer part also runs for any model with the reference's tokenizer family and the
same prompt (tiny_qwen2 ships the real Qwen tokenizer, so it reproduces those figures).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from pipeline.checks.suite import Stored
from pipeline.checks.verdicts import Check, diff_detail, mismatches
from pipeline.errors import UserError
from pipeline.model import capture, tokenization
from pipeline.numerics import sampling
from pipeline.store.artifacts import read_once, read_parquet

REFERENCE_DIR = Path(__file__).resolve().parents[1] / "reference"   # pipeline/reference/
# Tokenizer family of each reference run, in conf/model terms (the files state the model id).
TOKENIZER_FAMILY = {"seed_article": "qwen2"}
PRINTED_4 = 0.5e-4        # a value printed with 4 decimals
PRINTED_6 = 0.5e-6        # ... with 6 decimals
_MISSING = object()


NOT_FIGURES = ("fingerprints",)    # pipeline/reference/fingerprints.yaml: cross-machine hashes (tests), not figures


def load_reference(name: str) -> dict:
    path = REFERENCE_DIR / f"{name}.yaml"
    if not path.is_file() or name in NOT_FIGURES:
        known = ", ".join(sorted(p.stem for p in REFERENCE_DIR.glob("*.yaml") if p.stem not in NOT_FIGURES))
        raise UserError(f"model.reference_figures={name!r}: no {path.name} in pipeline/reference/ (known: {known})")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@read_once
def _prompt_of(path: Path) -> str:
    return yaml.safe_load(path.read_text(encoding="utf-8"))["prompt"]


def reference_prompt(name: str) -> str:
    """`load_reference(name)["prompt"]`, its file parsed once per process (`read_once`): the checks ask it for
    every prompt of a set, and a parse takes about 20 ms."""
    path = REFERENCE_DIR / f"{name}.yaml"
    if not path.is_file() or name in NOT_FIGURES:
        load_reference(name)            # refuses it, naming the known references
    return _prompt_of(path)


def applicable(reference_figures: str | None, family: str, prompt: str) -> list[tuple[str, str]]:
    """(reference name, "all" | "tokenizer") to compare for this model and prompt."""
    if reference_figures:
        return [(reference_figures, "all")]
    return [(name, "tokenizer") for name, fam in TOKENIZER_FAMILY.items()
            if fam == family and reference_prompt(name) == prompt]


def run(stored: Stored, model, tokenizer, cfg: dict, results: list[Check],
        which: list[tuple[str, str]] | None = None) -> list[Check]:
    """The reference comparisons `which` (default: `applicable` for cfg) for the checks stage."""
    if which is None:
        which = applicable(cfg["model"].reference_figures, cfg["model"].tokenizer.family, cfg["prompt"].text)
    out = []
    for name, part in which:
        ref = load_reference(name)
        measured = {"prompt": cfg["prompt"].text,
                    "tokenize": gather_tokenizer(stored.token_ids, stored.token_text, tokenizer,
                                                 ref["tokenize"]["byte_split_example"]["text"])}
        if part == "all":
            measured |= gather_run(stored, model, tokenizer, cfg, results, ref)
        out += compare(measured, ref, part)
    return out


# ---------------------------------------------------------------- measured figures
def gather_tokenizer(token_ids: list[int], token_text: list[str], tokenizer, example: str) -> dict:
    split = tokenizer(example, add_special_tokens=False).input_ids
    byte_level = tokenization.is_byte_level(tokenizer)
    return {"token_ids": list(token_ids),
            "pieces": {p: [i, t] for p, (i, t) in enumerate(zip(token_ids, token_text))},
            "byte_split_example": {"text": example, "ids": split, "decodes_alone": [
                tokenization.decodes_alone(tokenization.piece_bytes(piece, byte_level))
                for piece in tokenizer.convert_ids_to_tokens(split)]},
            "tokenizer_len": len(tokenizer)}


def _by_name(results: list[Check], prefix: str) -> float:
    values = [c.measured for c in results if c.name.startswith(prefix)]
    return max(values) if values else math.nan


def _filter_settings(key: str) -> sampling.SamplingSettings | None:
    """top_k_2 -> top-k 2; top_p_0.9_kept_count -> top-p 0.9 (the reference reports them at T=1)."""
    if m := re.fullmatch(r"top_k_(\d+)", key):
        return sampling.SamplingSettings(1.0, int(m.group(1)), 1.0)
    if m := re.fullmatch(r"top_p_([0-9.]+)_kept_count", key):
        return sampling.SamplingSettings(1.0, 0, float(m.group(1)))
    return None


def gather_run(stored: Stored, model, tokenizer, cfg: dict, results: list[Check], ref: dict) -> dict:
    """The measured counterpart of every run figure in `ref` (ids / temperatures it names)."""
    t, last = stored.tensors, stored.last_row()
    logits = torch.from_numpy(last)
    embed = t[capture.act_name("embed")]
    rows = {tid: (embed[0, stored.token_ids.index(tid)] if tid in stored.token_ids
                  else model.get_input_embeddings().weight[tid]) for tid in ref.get("embedding_first4", {})}
    pt = ref["probability_table_fp64"]
    temps = {k: float(k[1:]) for k in pt if k.startswith("T")}
    tables = sampling.probability_table(logits, list(temps.values()))
    prob_table: dict[str, Any] = {}
    for key, temp in temps.items():
        ids = [i for i in pt[key] if i != "rest"]
        p64 = tables[temp].p64
        prob_table[key] = {**{i: float(p64[i]) for i in ids}, "rest": math.fsum(np.delete(p64, ids).tolist())}
    tol32 = pt["fp32_sum_check"]["tolerance"]
    prob_table["fp32_sum_check"] = {"tolerance": tol32,
                                    "exceeded_at": [t_ for t_, tab in tables.items() if tab.sum_err32 > tol32]}
    filters: dict[str, Any] = {}
    for key in ref.get("filters", {}):
        kept = sampling.filter_distribution(logits, _filter_settings(key))
        filters[key] = kept.count if key.endswith("_kept_count") else dict(zip(kept.ids.tolist(),
                                                                               kept.prob_after.tolist()))
    steps = read_parquet(stored.steps).to_pylist() if stored.steps else []   # None: trajectories stopped
    run_steps = {b: sorted((r for r in steps if r["branch"] == b and not r["kv_cache"]), key=lambda r: r["step"])
                 for b in ("sample", "greedy")}
    n = ref.get("max_new_tokens")   # the reference's steps: a longer run is compared on its first n
    first = {b: r[:n] for b, r in run_steps.items()}
    s = cfg["sampling"]
    kv_choices = [c.measured for c in results if c.name.startswith("kv_cache_choices_")]
    return {
        "shapes": {"input_ids": list(t["input_ids"].shape), "embeddings": list(embed.shape),
                   "num_hidden_layers": len(capture.decoder_layers(model)),
                   "final_hidden_after_norm": list(t[capture.act_name("final_norm_out")].shape),
                   "logits": list(t[capture.act_name("logits")].shape),
                   "lm_head_weight": list(model.get_output_embeddings().weight.shape)},
        "embedding_first4": {tid: row[:4].float().tolist() for tid, row in rows.items()},
        "lm_head_input_last_position_first4": t[capture.act_name("final_norm_out")][0, -1, :4].float().tolist(),
        "last_position_top3_logits": [
            {"token_id": int(i), "text": tokenizer.decode([int(i)], skip_special_tokens=False,
                                                          clean_up_tokenization_spaces=False), "logit": float(last[i])}
            for i in sampling.rank_order(logits)[:3]],
        "probability_table_fp64": prob_table,
        "filters": filters,
        "sampling_branch": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed,
                            "steps": [[r["prefix_len"], r["token_id"], r["text_so_far"]] for r in first["sample"]]},
        "greedy_branch": {"token_ids": [r["token_id"] for r in first["greedy"]],
                          "text": first["greedy"][-1]["text_so_far"] if first["greedy"] else None},
        "max_new_tokens": {"configured": s.max_new_tokens,
                           "stop_reasons": {b: _stop_within(r, n) for b, r in run_steps.items()}},
        "consistency_checks": {
            "lm_head_recompute_max_abs_diff": _by_name(results, "lm_head_recompute"),
            "layer0_attention_recompute_max_abs_diff": _by_name(results, "layer0_attention_"),
            "layer0_residual_adds_recompute_max_abs_diff": _by_name(results, "residual_adds_layer0"),
            "layer0_future_attention_weight_max": _by_name(results, "future_attention_layer0"),
            "kv_cache_vs_full_prefix": {"max_abs_diff": _by_name(results, "kv_cache_logits_"),
                                        "atol": cfg["checks"].kv_cache_atol,
                                        "choices_differ": max(kv_choices, default=math.nan)}},
    }


def _stop_within(steps: list[dict], n: int | None) -> str | None:
    """Why a run's first n steps ended: `max_new_tokens` when it ran past them (as if the limit were n),
    else its own stop reason (`eos` before or at step n; None: no steps)."""
    if n is not None and len(steps) > n:
        return "max_new_tokens"
    return steps[-1]["stop_reason"] if steps else None


# ---------------------------------------------------------------- comparison
def _get(d: Any, *keys) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return _MISSING
        d = d[k]
    return d


def exact(name: str, what: str, got: Any, want: Any, severity: str) -> Check:
    """Equal values: lists count differing positions (+ length difference), others 0 or 1."""
    if got is _MISSING:
        return Check(name, what, math.nan, 0, severity, "not measured")
    if isinstance(got, list) and isinstance(want, list):
        return Check(name, what, mismatches(got, want), 0, severity, diff_detail(got, want))
    n = 0 if got == want else 1
    return Check(name, what, n, 0, severity, f"got {got!r}, reference {want!r}"[:240] if n else "")


def close(name: str, what: str, got: Any, want: dict | list, tol: float, severity: str) -> Check:
    """max |got - want| over the reference's entries (dict keys or list positions); missing = NaN."""
    keys = list(want) if isinstance(want, dict) else list(range(len(want)))
    if isinstance(got, list):
        got = dict(enumerate(got)) if len(got) == len(want) else {}
    if not isinstance(got, dict):
        got = {}
    diffs = {k: abs(float(got[k]) - float(want[k])) if k in got else math.nan for k in keys}
    worst = max(diffs, key=lambda k: math.inf if math.isnan(diffs[k]) else diffs[k])
    measured = math.nan if any(math.isnan(d) for d in diffs.values()) else diffs[worst]
    return Check(name, what, measured, tol, severity,
                 f"worst at {worst!r}: {got.get(worst, 'missing')!r} vs {want[worst]!r}")


_FIGURES: list[tuple[str, bool, Callable[[dict, dict], list[Check]]]] = []


def _figure(part: str, prompt_dependent: bool):
    def register(fn):
        _FIGURES.append((part, prompt_dependent, fn))
        return fn
    return register


@_figure("tokenizer", prompt_dependent=False)
def _prompt(m, r):
    return [exact("ref_prompt", "prompt.text == the reference prompt (else prompt-dependent figures are skipped)",
                  m.get("prompt", _MISSING), r["prompt"], "report")]


@_figure("tokenizer", prompt_dependent=True)
def _token_ids(m, r):
    return [exact("ref_token_ids", "prompt token ids == the reference's", _get(m, "tokenize", "token_ids"),
                  r["tokenize"]["token_ids"], "error")]


@_figure("tokenizer", prompt_dependent=True)
def _pieces(m, r):
    want = {p: list(v) for p, v in r["tokenize"]["pieces"].items()}
    got = _get(m, "tokenize", "pieces")
    got = {p: list(got[p]) if p in got else None for p in want} if isinstance(got, dict) else {p: None for p in want}
    bad = [p for p in want if got[p] != want[p]]
    return [Check("ref_pieces", f"[id, readable piece] at positions {list(want)} == the reference's (positions "
                  "differing)", len(bad), 0, "error", "; ".join(f"{p}: {got[p]} vs {want[p]}" for p in bad[:3]))]


@_figure("tokenizer", prompt_dependent=False)
def _byte_split(m, r):
    want, got = r["tokenize"]["byte_split_example"], _get(m, "tokenize", "byte_split_example")
    if got is _MISSING:
        return [exact("ref_byte_split", "", got, want, "error")]
    alone = sum(bool(x) for x in got["decodes_alone"])
    return [Check("ref_byte_split", f"{want['text']!r} -> ids {want['ids']}, no piece decodable alone "
                  "(differing ids + pieces that decode alone)", mismatches(got["ids"], want["ids"]) + alone, 0,
                  "error", f"ids {got['ids']}, decodes alone {got['decodes_alone']}")]


@_figure("run", prompt_dependent=False)
def _model_sizes(m, r):
    return [exact("ref_tokenizer_len", "len(tokenizer)", _get(m, "tokenize", "tokenizer_len"),
                  r["tokenize"]["tokenizer_len"], "error"),
            *(exact(f"ref_shape_{k}", f"{k} == the reference's", _get(m, "shapes", k), r["shapes"][k], "error")
              for k in ("num_hidden_layers", "lm_head_weight") if k in r["shapes"]),
            *(close(f"ref_embedding_first4_{tid}", f"first 4 embedding coordinates of id {tid}, to the printed "
                    "6 decimals", _get(m, "embedding_first4", tid), want, PRINTED_6, "error")
              for tid, want in r.get("embedding_first4", {}).items())]


@_figure("run", prompt_dependent=True)
def _shapes_and_logits(m, r):
    top_got, top_want = _get(m, "last_position_top3_logits"), r["last_position_top3_logits"]
    col = (lambda rows, k: [x[k] for x in rows] if isinstance(rows, list) else _MISSING)
    return [*(exact(f"ref_shape_{k}", f"shape of {k} == the reference's", _get(m, "shapes", k), v, "report")
              for k, v in r["shapes"].items() if k not in ("num_hidden_layers", "lm_head_weight")),
            exact("ref_lm_head_input_first4", "LM-head input, last position, first 4 coordinates (bf16, exact)",
                  _get(m, "lm_head_input_last_position_first4"), r["lm_head_input_last_position_first4"], "report"),
            exact("ref_top3_ids", "top-3 ids at the last position", col(top_got, "token_id"),
                  col(top_want, "token_id"), "report"),
            exact("ref_top3_logits", "top-3 raw bf16 logits (exact)", col(top_got, "logit"),
                  [float(x) for x in col(top_want, "logit")], "report"),
            exact("ref_top3_text", "top-3 texts", col(top_got, "text"), col(top_want, "text"), "report")]


@_figure("run", prompt_dependent=True)
def _probabilities(m, r):
    pt = r["probability_table_fp64"]
    fp32 = _get(m, "probability_table_fp64", "fp32_sum_check", "exceeded_at")
    want32 = {float(x) for x in pt["fp32_sum_check"]["exceeded_at"]}
    return [*(close(f"ref_prob_{k.replace('.', '_')}", f"FP64 probabilities at {k} (3 ids + rest), to the printed "
                    "4 decimals", _get(m, "probability_table_fp64", k), v, PRINTED_4, "report")
              for k, v in pt.items() if k.startswith("T")),
            Check("ref_fp32_sum_exceeded_at",
                  f"temperatures where FP32 |sum - 1| > {pt['fp32_sum_check']['tolerance']:g}"
                  " == the reference's (size of the symmetric difference)",
                  math.nan if fp32 is _MISSING else len({float(x) for x in fp32} ^ want32), 0, "report",
                  f"measured {fp32 if fp32 is not _MISSING else 'missing'}, reference {sorted(want32)}")]


@_figure("run", prompt_dependent=True)
def _filters(m, r):
    return [exact(f"ref_filter_{k.replace('.', '_')}", f"{k} at T=1", _get(m, "filters", k), v, "report")
            if not isinstance(v, dict) else
            close(f"ref_filter_{k.replace('.', '_')}", f"{k} at T=1, renormalised, to the printed 4 decimals",
                  _get(m, "filters", k), v, PRINTED_4, "report") for k, v in r["filters"].items()]


@_figure("run", prompt_dependent=True)
def _trajectories(m, r):
    sb, settings = r["sampling_branch"], ("temperature", "top_k", "top_p", "seed")
    got_settings = {k: _get(m, "sampling_branch", k) for k in settings}
    stops = _get(m, "max_new_tokens", "stop_reasons")
    return [exact("ref_sampling_settings", "sampling temperature, top_k, top_p, seed", got_settings,
                  {k: sb[k] for k in settings}, "report"),
            exact("ref_sample_steps", "sample branch (no cache): [prefix_len, id, text so far] per step",
                  _get(m, "sampling_branch", "steps"), [list(x) for x in sb["steps"]], "report"),
            exact("ref_greedy_token_ids", "greedy branch ids", _get(m, "greedy_branch", "token_ids"),
                  r["greedy_branch"]["token_ids"], "report"),
            exact("ref_greedy_text", "greedy branch text", _get(m, "greedy_branch", "text"),
                  r["greedy_branch"]["text"], "report"),
            exact("ref_max_new_tokens", f"max_new_tokens >= the reference's {r['max_new_tokens']}, and every branch "
                  "ran its first that many steps without EOS (a longer run is compared on them)",
                  [_at_least(_get(m, "max_new_tokens", "configured"), r["max_new_tokens"]),
                   *(stops.values() if isinstance(stops, dict) else [None])],
                  [True, *(["max_new_tokens"] * (len(stops) if isinstance(stops, dict) else 1))],
                  "report")]


def _at_least(configured: Any, n: int) -> bool | None:
    return configured >= n if isinstance(configured, int) else None


@_figure("run", prompt_dependent=False)
def _consistency(m, r):
    out = [exact(f"ref_{k.removesuffix('_max_abs_diff').removesuffix('_weight_max')}", f"{k} (this run's check)",
                 _get(m, "consistency_checks", k), v, "report")
           for k, v in r["consistency_checks"].items() if not isinstance(v, str)]
    kv = _get(m, "consistency_checks", "kv_cache_vs_full_prefix")
    if "kv_cache_vs_full_prefix" in r["consistency_checks"]:
        outside = math.nan if kv is _MISSING else float(kv["max_abs_diff"] > kv["atol"])
        expected = "outside" in r["consistency_checks"]["kv_cache_vs_full_prefix"]
        out.append(Check("ref_kv_cache_finding", "KV cache vs full prefix: logits outside checks.kv_cache_atol "
                         f"reproduced ({'expected' if expected else 'not expected'} by the reference)",
                         abs(outside - float(expected)), 0, "report",
                         "" if kv is _MISSING else f"max abs diff {kv['max_abs_diff']:g}, atol {kv['atol']:g}, "
                         f"steps with a different choice {kv['choices_differ']:g}"))
    return out


def compare(measured: dict, reference: dict, part: str = "all") -> list[Check]:
    """One Check per reference figure; part "tokenizer" compares the tokenizer figures only."""
    if part not in ("all", "tokenizer"):
        raise ValueError(f"part {part!r}: all or tokenizer")
    same_prompt = measured.get("prompt") == reference["prompt"]
    out = []
    for fig_part, prompt_dependent, fn in _FIGURES:
        if (part == "tokenizer" and fig_part != "tokenizer") or (prompt_dependent and not same_prompt):
            continue
        out += fn(measured, reference)
    return out
