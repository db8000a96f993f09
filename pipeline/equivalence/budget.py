"""The equivalence stage's memory plan, made before anything loads: which variations run for a prompt,
which are skipped (their row says so), and the one-line stop when even those cannot fit.

The bound is the chain's goal (docs/cost_and_scale.md): a stage's peak above its loaded model at most
BOUND x 4TV, 4TV being 4 bytes x T prompt tokens x V (one float32 [T, V]). The stage holds the record's
capture throughout; the variations run one after another, each adding its own work on top and releasing
it before the next. A variation whose predicted work takes the stage over the bound is not run. The
models the variations load (sdpa, float32, float16; the kernels subprocess) are models, outside the
bound, but inside the free memory: when the largest variation that runs, with the record and the
models, does not fit in the memory free now, the stage stops before it loads anything.

Figures are `pipeline.model.memory`'s estimates (config and weight headers only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import UserError
from pipeline.model import memory
from pipeline.model.capture import CaptureSpec

BOUND = 2.5                 # x 4TV: the chain's goal for every stage's peak above its loaded model
FLOOR = 256 * 2**20         # a short prompt's bound (4TV of 25 tokens is 15 MB: the model's own work dominates)
BATCH = {"batch_2": 2, "batch_8": 8}
DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Plan:
    """One prompt's plan: bytes by variation (its own work above the record), what is skipped and why."""

    tokens: int
    bound: int                       # bytes above the loaded model
    held: int                        # the record's capture, held throughout
    work: dict[str, int]             # variation -> its own predicted work (bytes)
    models: dict[str, int]           # variation -> the weights it loads beside the stage's model
    skipped: dict[str, str]          # variation -> the row's note

    def runs(self, variation: str) -> bool:
        return variation not in self.skipped


def four_tv(tokens: int, vocab: int) -> int:
    return 4 * tokens * vocab


def widths(tokens: int, fillers: list[list[int]]) -> dict[str, int]:
    """Each batch variation's padded width: its longest row (the prompt, the fillers cycled beside it)."""
    return {b: max([tokens, *(len(fillers[i % len(fillers)]) for i in range(n - 1))]) for b, n in BATCH.items()}


def _pass(e: memory.Estimate, rows: int = 1) -> int:
    """One forward pass of `rows` sequences above its weights, outputs aside: a layer's eager attention (sdpa's
    counted the same, an upper bound) and the activations."""
    return rows * (e.attention + e.activations)


def predict(snapshot, dtype: torch.dtype, tokens: int, spec: CaptureSpec, variations: tuple[str, ...],
            width: dict[str, int], vocab: int, trust_remote_code: bool = False) -> Plan:
    """The plan for a T-token prompt; width: a batch variation -> its padded width (the longest row)."""
    est = memory.estimate(snapshot, dtype, tokens, spec, trust_remote_code)
    work, models = {}, {}
    for v in variations:
        if v == "sdpa":                 # its logits, and as much again for the hidden states it returns
            work[v], models[v] = _pass(est) + 2 * est.logits, est.weights
        elif v in BATCH:                # the LM head sees the prompt's row only (variations.lm_head_rows)
            wide = memory.estimate(snapshot, dtype, width[v], spec, trust_remote_code)
            work[v] = _pass(wide, BATCH[v]) + est.logits
        elif v in DTYPES:               # a full capture in that dtype; during the pass its attention, after it
            other = memory.estimate(snapshot, DTYPES[v], tokens, spec, trust_remote_code)     # one tensor rounded
            work[v] = other.captured + max(_pass(other), est.logits)                        # to the record's dtype
            models[v] = other.weights
        elif v == "threads_1":          # a full capture
            work[v] = _pass(est) + est.captured
        elif v == "kernels":            # the subprocess's capture, loaded back here; the subprocess loads a model
            work[v], models[v] = est.captured, est.weights + _pass(est) + est.captured
        else:                           # kv_cache: the trajectories' stored step logits
            work[v] = 0
    bound = max(int(BOUND * four_tv(tokens, vocab)), FLOOR)
    skipped = {v: _note(v, tokens, est.captured + w, bound) for v, w in work.items() if est.captured + w > bound}
    return Plan(tokens, bound, est.captured, work, models, skipped)


def _note(v: str, tokens: int, need: int, bound: int) -> str:
    return (f"not run: at {tokens} tokens it would need about {need / memory.GIB:.2f} GiB above the loaded model "
            f"(predicted, the record's capture with it), over this stage's bound {BOUND} x 4TV = "
            f"{bound / memory.GIB:.2f} GiB; a shorter prompt runs it "
            f"(equivalence.variations without {v} leaves it out)")


def guard(plan: Plan, model_weights: int, prompt_id: str, free=None) -> None:
    """One line, before anything loads, when the largest running variation with the record and the models
    does not fit in the memory free now."""
    running = {v: w + plan.models.get(v, 0) for v, w in plan.work.items() if plan.runs(v)}
    if not running:
        return
    worst = max(running, key=running.get)
    need = model_weights + plan.held + running[worst]
    have = (free or memory.free_bytes)(torch.device("cpu"), False)
    if need > have:
        raise UserError(f"not enough memory for the equivalence stage on prompt {prompt_id} ({plan.tokens} tokens): "
                        f"its {worst} variation needs about {need / memory.GIB:.2f} GiB with the record and the "
                        f"models but {have / memory.GIB:.2f} GiB are free: use equivalence.variations without "
                        f"{worst}, or capture.positions=last, or a shorter prompt")
