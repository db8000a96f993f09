"""The logit lens: every layer's residual stream read through the model's own final norm and LM head.

Layer 0 is `blocks.0.resid_pre`, the residual stream as the first decoder layer receives it: it
equals `embed` for most families, but GPT-2 adds its position embeddings and Granite scales by
embedding_multiplier before it, so `embed` alone would not be the stream. Layer i (1..L) is
`blocks.{i-1}.resid_post`; layer L is the last block's output, whose lens logits are the model's
own logits bit for bit (the checks stage proves it, `lens_final_layer_exact`).

Each layer's stored residual [1, T, H] goes through the model's final norm module (so each
position is normalised with its own statistics), then `head.lm_head_rows` (the model's own
lm_head, Granite's logits_scaling, a final softcap where the family has one), in the compute
dtype, on the rows the model itself made logits for (every position, or the last with
capture.positions=last: the norm sees every position, as in the model's pass). Then, per
position, an FP64 softmax at T = 1 over the full output size. Memory: one layer's [1, T, V]
logits at a time, one position's FP64 row at a time; never [L, T, V].
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from pipeline.errors import bad_value
from pipeline.model.capture import act_name, decoder_layers, family
from pipeline.model.head import lm_head_rows

LENS_SCHEMA = pa.schema([pa.field(name, kind, nullable=False) for name, kind in (
    ("layer", pa.int32()), ("position", pa.int32()), ("rank", pa.int32()), ("token_id", pa.int32()),
    ("logit", pa.float32()),        # the compute dtype's value (bf16 and fp16 are exact in float32)
    ("prob", pa.float64()))])       # FP64 softmax at T = 1 over the full output size
SUMMARY_SCHEMA = pa.schema([
    pa.field("layer", pa.int32(), nullable=False), pa.field("position", pa.int32(), nullable=False),
    pa.field("entropy", pa.float64(), nullable=False),          # nats, of the layer's FP64 distribution
    pa.field("final_top1_id", pa.int32(), nullable=False),      # argmax of the model's own logits there
    pa.field("final_top1_rank", pa.int32(), nullable=False),    # its rank at this layer (1 = top)
    pa.field("final_top1_prob", pa.float64(), nullable=False),  # its probability at this layer
    pa.field("kl_final", pa.float64(), nullable=False),         # KL(final || layer), nats, FP64
])
LAYER0 = act_name("resid_pre", 0)


def residual_names(num_layers: int) -> list[str]:
    """The capture name read at each lens layer 0..L."""
    return [LAYER0] + [act_name("resid_post", i) for i in range(num_layers)]


def final_norm(model: nn.Module, resid: torch.Tensor) -> torch.Tensor:
    """The model's own final norm module on a stored residual [1, T, H] (its own statistics per position)."""
    norm = model.get_submodule(family(model).final_norm)
    with torch.inference_mode():
        return norm(resid.to(next(norm.parameters()).device))


def layer_logits(model: nn.Module, resid: torch.Tensor, rows: int) -> torch.Tensor:
    """[1, rows, V] in the compute dtype: final norm, then the LM head as the model applies it."""
    return lm_head_rows(model, final_norm(model, resid), rows)


def top_ids(z: torch.Tensor, k: int) -> torch.Tensor:
    """The k best ids of an FP64 row, logit descending, equal logits by lower id (the project's rank rule)."""
    kth = torch.topk(z, k).values[-1]
    candidates = torch.nonzero(z >= kth).flatten()               # every id tied with the k-th too
    order = np.lexsort((candidates.numpy(), -z[candidates].numpy()))
    return candidates[torch.from_numpy(order[:k])]


def rank_of(z: torch.Tensor, token: int) -> int:
    """1-based rank of `token` in an FP64 row under the same rule (ties by lower id)."""
    v = z[token]
    return int((z > v).sum()) + int((z[:token] == v).sum()) + 1


@dataclass(frozen=True)
class PositionLens:
    """One (layer, position): the top-k rows and the summary figures."""

    ids: list[int]
    logits: list[float]
    probs: list[float]
    entropy: float
    final_top1_id: int
    final_top1_rank: int
    final_top1_prob: float
    kl_final: float


@dataclass(frozen=True, eq=False)
class FinalRow:
    """The model's own logits row at a position as every layer's lens there compares with it: its FP64
    log-softmax and softmax and its top-1 id (the lowest id among the maxima)."""

    logp: torch.Tensor
    p: torch.Tensor
    top1: int

    @classmethod
    def of(cls, final_row: torch.Tensor) -> FinalRow:
        zf = final_row.detach().to("cpu", torch.float64)
        logp = torch.log_softmax(zf, -1)
        return cls(logp, torch.exp(logp), int(torch.argmax(zf)))


KEEP_FINAL_ROWS = 8     # `run` computes a position's FinalRow once for every layer when it has at most this many rows
                        # (2.4 MB each for 152k ids; a set's capture.positions=last has one), else once per layer


def position_lens(row: torch.Tensor, final_row: torch.Tensor, top_k: int, final: FinalRow | None = None) \
        -> PositionLens:
    """One layer's logits row and the model's own logits row at that position (both the compute dtype;
    `final`: `FinalRow.of(final_row)` where the caller keeps it for the position's other layers)."""
    z = row.detach().to("cpu", torch.float64)
    final = final or FinalRow.of(final_row)
    logq, logp = torch.log_softmax(z, -1), final.logp
    q, p = torch.exp(logq), final.p
    ids = top_ids(z, top_k)
    f = final.top1
    # KL(final || layer) = sum p (ln p - ln q) over p > 0; written as one sum of differences, it is 0
    # exactly where the two rows are the same bits (layer L).
    kl = float(torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum())
    entropy = float(-torch.where(q > 0, q * logq, torch.zeros_like(q)).sum())
    return PositionLens(ids.tolist(), row.detach().float().cpu()[ids].tolist(), q[ids].tolist(), entropy,
                        f, rank_of(z, f), float(q[f]), kl)


def layers(model: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """(lens layer, its [1, R, V] logits), one layer at a time (R: the rows the model made logits for)."""
    rows = tensors[act_name("logits")].shape[1]
    for layer, name in enumerate(residual_names(len(decoder_layers(model)))):
        yield layer, layer_logits(model, tensors[name], rows)


def run(model: nn.Module, tensors: dict[str, torch.Tensor], positions: list[int], top_k: int) \
        -> tuple[pa.Table, pa.Table]:
    """(lens.parquet, lens_summary.parquet) tables of one prompt's capture; `positions`: the prompt
    positions of the logits rows (facts.json's logit_positions)."""
    final = tensors[act_name("logits")][0]
    if final.shape[0] != len(positions):
        raise ValueError(f"{final.shape[0]} logits rows for {len(positions)} positions")
    lens: dict[str, list] = {n: [] for n in LENS_SCHEMA.names}
    summary: dict[str, list] = {n: [] for n in SUMMARY_SCHEMA.names}
    finals = [FinalRow.of(final[r]) for r in range(len(positions))] if len(positions) <= KEEP_FINAL_ROWS else None
    for layer, logits in layers(model, tensors):
        for r, pos in enumerate(positions):
            one = position_lens(logits[0, r], final[r], top_k, finals[r] if finals else None)
            n = len(one.ids)
            for k, v in (("layer", [layer] * n), ("position", [pos] * n), ("rank", range(1, n + 1)),
                         ("token_id", one.ids), ("logit", one.logits), ("prob", one.probs)):
                lens[k].extend(v)
            for k, v in (("layer", layer), ("position", pos), ("entropy", one.entropy),
                         ("final_top1_id", one.final_top1_id), ("final_top1_rank", one.final_top1_rank),
                         ("final_top1_prob", one.final_top1_prob), ("kl_final", one.kl_final)):
                summary[k].append(v)
        del logits
    return pa.table(lens, schema=LENS_SCHEMA), pa.table(summary, schema=SUMMARY_SCHEMA)


def check_top_k(top_k: int, output_size: int) -> None:
    if top_k > output_size:
        raise bad_value("lens.top_k", top_k, f"an integer in [1, {output_size}] (this model's output size)")
