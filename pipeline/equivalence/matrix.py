"""The equivalence stage's computation: per chosen prompt, every configured variation against the record.

Per prompt, one partition `artifacts/equivalence/equivalence/prompt_id=<id>/equivalence.parquet`: one
row per variation (the kv_cache variation one row per trajectory branch, `kv_cache_<branch>`), its
figures from `numerics.compare`; the manifest's facts say what each variation ran with. Beside it
`variant_logits/prompt_id=<id>/variant_logits.parquet`: each forward variation's own logits at the
recorded positions, the rows its figures were computed from (`pipeline.store.variant_logits`), what
the explorer's Equivalence tab compares with the record. The kv_cache rows' step logits are the
trajectories' step_logits.parquet already and are not copied. The checks on those rows
(`pipeline.checks.equivalence`) go to the stage's own checks.parquet.

Memory (`budget`): the variations run one at a time, each variant's logits compared in chunks of
positions and streamed to variant_logits.parquet before the next runs; a variation predicted over the
stage's bound is a row saying so, and the stage stops in one line before any load when what runs
cannot fit in the memory free.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pipeline.config import prompt_set
from pipeline.config.schema import CaptureConfig, EquivalenceConfig
from pipeline.equivalence import budget
from pipeline.equivalence import variations as v
from pipeline.errors import bad_value
from pipeline.model import capture, loader
from pipeline.numerics import compare, divergence
from pipeline.store import logits_io
from pipeline.store.artifacts import read_parquet, read_safetensors

SCHEMA = pa.schema([("variation", pa.string()), ("compared", pa.string()), ("n_positions", pa.int32()),
                    ("max_abs_diff", pa.float64()), ("mean_abs_diff", pa.float64()),
                    ("top1_changed", pa.list_(pa.int32())), ("kept_recorded", pa.int32()),
                    ("kept_variant", pa.int32()), ("kept_jaccard", pa.float64()),
                    ("kept_recorded_ids", pa.list_(pa.int32())), ("kept_variant_ids", pa.list_(pa.int32())),
                    ("kl_mean", pa.float64()), ("kl_max", pa.float64()), ("kl_last", pa.float64()),
                    ("bit_identical", pa.bool_()),
                    ("first_differing_tensor", pa.string()), ("note", pa.string())])
# No timing column: the same run gives the same bytes; each variation's seconds are in the manifest's facts.
CHUNK = 2**23        # logits compared per chunk (x 8 bytes for each float64 copy compare makes)


def chosen(cfg: EquivalenceConfig, report_prompt: str | None, ids: list[str]) -> list[str]:
    """equivalence.prompts, or (null) the prompt the report details: one line for an id the run lacks."""
    if cfg.prompts is None:
        return [prompt_set.detailed(report_prompt, ids)]
    for pid in cfg.prompts:
        if pid not in ids:
            raise bad_value("equivalence.prompts", pid, "null or a list of the run's prompt ids: " + ", ".join(ids))
    return list(cfg.prompts)


def recorded(capture_path: Path, facts: dict) -> v.Recorded:
    tensors = read_safetensors(capture_path)
    return v.Recorded(facts["input_ids"], facts["logit_positions"], tensors, divergence.capture_order(capture_path))


def row(name: str, compared: str, rec_logits: torch.Tensor, var: v.Variant, positions: list[int]) -> dict:
    figures = chunked(rec_logits, var.logits, positions) if var.logits is not None else compare.empty(var.note)
    return {"variation": name, "compared": compared, "n_positions": len(positions), **figures,
            "first_differing_tensor": var.first_differing_tensor, "note": var.note}


def chunked(rec_logits: torch.Tensor, var_logits: torch.Tensor, positions: list[int]) -> dict:
    """`compare.compare` over chunks of positions, merged: its float64 copies of [P, V] would be several
    4TV at once on a long prompt. Means weighted by the chunk's rows; the kept sets and kl_last are the
    last position's, so the last chunk's."""
    if tuple(rec_logits.shape) != tuple(var_logits.shape):
        raise ValueError(f"logits {list(rec_logits.shape)} vs {list(var_logits.shape)}: expected two equal [P, V]")
    step = max(1, CHUNK // max(1, rec_logits.shape[-1]))
    parts = [(len(positions[i:i + step]), compare.compare(rec_logits[i:i + step], var_logits[i:i + step],
                                                          positions[i:i + step]))
             for i in range(0, len(positions), step)]
    n, last = len(positions), parts[-1][1]

    def worst(k):
        values = [f[k] for _, f in parts]
        return math.nan if any(math.isnan(x) for x in values) else max(values)
    return {**last, "max_abs_diff": worst("max_abs_diff"), "kl_max": worst("kl_max"),
            "mean_abs_diff": sum(m * f["mean_abs_diff"] for m, f in parts) / n,
            "kl_mean": sum(m * f["kl_mean"] for m, f in parts) / n,
            "top1_changed": [p for _, f in parts for p in f["top1_changed"]],
            "bit_identical": all(f["bit_identical"] for _, f in parts)}


def forward_rows(rec: v.Recorded, s: v.Setup, cfg: EquivalenceConfig, model, fillers, pad_id: int,
                 plan: budget.Plan):
    """(row, ran_with, variant logits [P, V] or None) per configured forward variation, in the configured order;
    one variation's tensors are released before the next runs (the caller drops the logits it was given)."""
    make = {"sdpa": lambda: v.sdpa_variant(rec, s, model),
            "batch_2": lambda: v.batch_variant(rec, s, model, fillers, 2, pad_id),
            "batch_8": lambda: v.batch_variant(rec, s, model, fillers, 8, pad_id),
            "float32": lambda: v.dtype_variant(rec, s, torch.float32),
            "float16": lambda: v.dtype_variant(rec, s, torch.float16),
            "threads_1": lambda: v.threads_variant(rec, s, model),
            "kernels": lambda: v.kernels_variant(rec, s)}
    for name in cfg.variations:
        if name in make:
            start = time.perf_counter()
            var = make[name]() if plan.runs(name) else v.Variant(None, None, plan.skipped[name], {})
            seconds = round(time.perf_counter() - start, 3)
            yield row(name, "logits at the prompt positions", rec.logits, var, rec.positions), \
                {**var.ran_with, "seconds": seconds}, var.logits
            del var


def step_runs(steps_path: Path, step_rows: Path | list) -> dict[tuple[str, bool], list[tuple[int, int, np.ndarray]]]:
    """(branch, kv_cache) -> [(step, token_id, float32 logits row)], from the trajectories stage's files: steps.parquet
    and its step logits (a step_logits.parquet, or the rows `trajectories.step_rows` gives)."""
    tokens = {(r["branch"], r["kv_cache"], r["step"]): r["token_id"]
              for r in read_parquet(steps_path, columns=["branch", "kv_cache", "step", "token_id"]).to_pylist()}
    out: dict = {}
    rows = logits_io.read_step_logits(step_rows) if isinstance(step_rows, Path) else step_rows
    for k, _, logits in rows:
        key = (k["branch"], k["kv_cache"], k["step"])
        out.setdefault(key[:2], []).append((key[2], tokens[key], logits))
    return {k: sorted(rows, key=lambda r: r[0]) for k, rows in out.items()}


def kv_rows(runs: dict) -> list[dict]:
    """Per branch run with and without the cache: the stored step logits, compared while both runs share
    their prefix (steps up to the first differing token; after it the two see other inputs)."""
    out = []
    for branch in sorted({b for b, _ in runs}):
        full, cached = runs.get((branch, False)), runs.get((branch, True))
        if not full or not cached:
            continue
        shared = []
        for (s, tok_a, a), (_, tok_b, b) in zip(full, cached):
            shared.append((s, a, b))
            if tok_a != tok_b:
                break
        var = v.Variant(torch.from_numpy(np.stack([b for _, _, b in shared])), None,
                        f"stored step logits of steps {shared[0][0]}-{shared[-1][0]} (the shared prefix), "
                        "kv_cache=true vs false; no recompute", {"kv_cache": True})
        rec = torch.from_numpy(np.stack([a for _, a, _ in shared]))
        out.append(row(f"kv_cache_{branch}", "step logits", rec, var, [s for s, _, _ in shared]))
    return out


def setup(cap: CaptureConfig, snapshot: Path, trust_remote_code: bool) -> v.Setup:
    spec = capture.CaptureSpec(attention_layers=cap.attention_layers, positions=cap.positions)
    return v.Setup(snapshot, loader.resolve_dtype(cap.dtype), loader.resolve_device(cap.device),
                   cap.attn_implementation, spec, cap.kernels, trust_remote_code)


def fillers_and_pad(snapshot: Path, cfg: EquivalenceConfig, trust_remote_code: bool) -> tuple[list[list[int]], int]:
    tok = loader.load_tokenizer(snapshot, trust_remote_code)
    fillers = [tok(text, add_special_tokens=False)["input_ids"] for text in cfg.fillers]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return fillers, int(pad if pad is not None else 0)


@dataclass(frozen=True)
class Matrix:
    """What the checks need: how the record was made, the fillers, and per prompt (record, rows)."""

    setup: v.Setup
    fillers: list[list[int]]
    pad_id: int
    prompts: dict[str, tuple[v.Recorded, list[dict]]]
    ran_with: dict[str, dict]          # variation -> what it ran with and its seconds (the manifest's facts)

    def facts(self) -> dict:
        """For the manifest only, set after every table is written: Parquet metadata carries a stage's facts,
        and the seconds would make the same run's tables differ byte for byte."""
        return {"recorded": v.ran_with(self.setup), "variations": self.ran_with, "prompts": sorted(self.prompts)}


def plan(s: v.Setup, cfg: EquivalenceConfig, facts: dict, fillers: list[list[int]], weights: int,
         pid: str) -> budget.Plan:
    """A chosen prompt's memory plan, from its recorded facts (facts.json); one line (before any load) when what
    runs cannot fit in the memory free."""
    t = len(facts["input_ids"])
    out = budget.predict(s.snapshot, s.dtype, t, s.spec, cfg.variations, budget.widths(t, fillers),
                         int(facts["output_size"]), s.trust_remote_code)
    budget.guard(out, weights, pid)
    return out
