"""Turn one row of next-token logits into probabilities, filtered sets and a chosen token.

The transforms copy transformers' warpers op for op (same dtype, same sort, same
comparisons), so a decode loop built on `choose` draws exactly the tokens of
`model.generate(do_sample=True, ...)`: generate casts the last row to float32, applies
temperature -> top-k -> top-p, takes `softmax` in float32 and calls `torch.multinomial`.
The FP64 tables beside them are for reporting and never feed the draw.

Ranks: rank 1 is the highest logit; equal logits rank by lower token id first.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.errors import bad_value

_NEG_INF = -float("inf")


def _is_real(x: object) -> bool:
    # bool is an int in Python; a YAML `true` must not pass as temperature 1.
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_temperature(t: object, allow_zero: bool) -> None:
    if not _is_real(t) or not math.isfinite(t) or t < 0 or (t == 0 and not allow_zero):
        allowed = "a finite number >= 0 (0 = greedy)" if allow_zero else "a finite number > 0"
        raise bad_value("sampling.temperature", t, allowed)


def _check_top_k(k: object) -> None:
    if not _is_int(k) or k < 0:
        raise bad_value("sampling.top_k", k, "an integer >= 0 (0 = off)")


def _check_top_p(p: object) -> None:
    if not _is_real(p) or not 0 < p <= 1:
        raise bad_value("sampling.top_p", p, "a number in (0, 1] (1.0 = off)")


@dataclass(frozen=True)
class Temperature:
    """scores / t, as `TemperatureLogitsWarper`. t == 0 (greedy) is the caller's business."""

    t: float

    def __post_init__(self) -> None:
        _check_temperature(self.t, allow_zero=False)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.t


@dataclass(frozen=True)
class TopK:
    """Keep every id scoring >= the k-th highest score (so ties with it too); k == 0 is off.

    Same ops as `TopKLogitsWarper(top_k=k, filter_value=-inf)`.
    """

    k: int

    def __post_init__(self) -> None:
        _check_top_k(self.k)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if self.k == 0:
            return scores.clone()
        k = min(self.k, scores.size(-1))
        kth = torch.topk(scores, k)[0][..., -1, None]
        return scores.masked_fill(scores < kth, _NEG_INF)


@dataclass(frozen=True)
class TopP:
    """Nucleus filter, the kept set of `TopPLogitsWarper(top_p=p, min_tokens_to_keep=1)`; p == 1.0 is off.

    Rule (the warper's): sort scores ascending, take the cumulative softmax in the scores'
    dtype (float32 in generate), remove ids whose cumulative <= 1 - p, never remove the
    last (highest) one. In exact arithmetic that keeps an id iff the mass ranked strictly
    above it is < p: the smallest set whose mass reaches p. The threshold is evaluated in
    float32, so at a boundary within float32 rounding the count may differ from FP64's.

    Ties at the cut: the cumulative values do not depend on how equal scores are ordered,
    so HOW MANY of a tied group are kept is fixed. WHICH of them are kept is whatever
    `torch.sort(descending=False)` (stable=False, as the warper calls it) puts last. On CPU
    that sort is stable for rows of <= 16 entries, so there the highest token ids of the
    tied group are kept (e.g. logits [1, 2, 2, 2, 0], p=0.3 keeps ids {2, 3}); for longer
    rows it is not stable, and the choice is deterministic for a given row, torch build and
    device but follows no id order. We call the very same sort so the kept set, and hence
    the draw, matches generate's. (p == 1.0 is an identity here, as generate adds no warper;
    the warper itself would still drop ids whose float32 probability underflows to 0.)
    """

    p: float

    def __post_init__(self) -> None:
        _check_top_p(self.p)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if self.p == 1.0:
            return scores.clone()
        sorted_scores, sorted_ids = torch.sort(scores, descending=False)  # unstable on purpose: = warper
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - self.p)
        remove_sorted[..., -1:] = False  # min_tokens_to_keep = 1
        remove = remove_sorted.scatter(-1, sorted_ids, remove_sorted)
        return scores.masked_fill(remove, _NEG_INF)


@dataclass(frozen=True)
class SamplingSettings:
    """One sampling branch's filter. temperature 0 = greedy; top_k 0 and top_p 1.0 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        _check_temperature(self.temperature, allow_zero=True)
        _check_top_k(self.top_k)
        _check_top_p(self.top_p)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _transforms(settings: SamplingSettings) -> list:
    # generate's `_get_logits_processor`: it skips T == 1.0, top_k == 0 and top_p == 1.0.
    out = []
    if settings.temperature != 1.0:
        out.append(Temperature(settings.temperature))
    if settings.top_k != 0:
        out.append(TopK(settings.top_k))
    if settings.top_p < 1.0:
        out.append(TopP(settings.top_p))
    return out


def warp(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Float32 scores after temperature -> top-k -> top-p (filtered ids = -inf).

    Cast to float32 first, as generate does before its processors. Greedy applies no
    warper (generate with do_sample=False doesn't either): the float32 logits come back.
    """
    scores = logits.to(dtype=torch.float32, copy=True)
    if settings.is_greedy:
        return scores
    for transform in _transforms(settings):
        scores = transform(scores)
    return scores


def next_token_probs(logits_row: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The float32 distribution `choose` draws from: softmax of the warped row.

    Shaped [1, vocab] while computing, like generate's batch of one, so every op sees the
    same layout. Greedy draws nothing; it returns softmax of the raw float32 logits (T = 1),
    the probability a greedy step reports for its token.
    """
    scores = warp(logits_row.reshape(1, -1), settings)
    return nn.functional.softmax(scores, dim=-1)[0]


def choose(logits_row: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> int:
    """Next token id: argmax of the raw logits when greedy, else one multinomial draw.

    argmax returns the lowest id among equal maxima (as generate's). The draw uses the
    caller's CPU generator, which replays `torch.manual_seed(seed)`'s global stream.
    """
    if settings.is_greedy:
        return int(torch.argmax(logits_row))
    probs = next_token_probs(logits_row.cpu(), settings).reshape(1, -1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])


@dataclass(frozen=True, eq=False)
class ProbTable:
    """softmax(logits / T) over all ids: p64 via float64, p32 via float32, and |sum - 1| of each."""

    temperature: float
    p64: np.ndarray  # [vocab] float64
    p32: np.ndarray  # [vocab] float32
    sum_err64: float
    sum_err32: float


def _sum_error(p: np.ndarray) -> float:
    # fsum is exact, so the error measured is the table's, not the summation's.
    return abs(math.fsum(p.astype(np.float64).tolist()) - 1.0)


def probability_table(logits: torch.Tensor, temperatures: list[float]) -> dict[float, ProbTable]:
    """One ProbTable per temperature for a 1-D logits row of any dtype (e.g. bf16)."""
    if logits.ndim != 1:
        raise ValueError(f"expected 1-D logits, got shape {tuple(logits.shape)}")
    for t in temperatures:
        if not _is_real(t) or not math.isfinite(t) or t <= 0:
            raise bad_value("probs.temperatures", t, "finite numbers > 0")
    row = logits.detach().cpu()
    tables = {}
    for t in temperatures:
        p64 = torch.softmax(row.to(torch.float64) / t, dim=-1).numpy()
        p32 = torch.softmax(row.float() / t, dim=-1).numpy()
        tables[t] = ProbTable(t, p64, p32, _sum_error(p64), _sum_error(p32))
    return tables


def rank_order(logits: torch.Tensor) -> np.ndarray:
    """Token ids best first: logit descending, equal logits by lower id (stable sort)."""
    values = logits.detach().cpu().to(torch.float64).numpy()
    return np.argsort(-values, kind="stable")


def ranks(logits: torch.Tensor) -> np.ndarray:
    """rank[id], 1-based: 1 = highest logit, ties ranked by lower token id."""
    order = rank_order(logits)
    out = np.empty(order.size, dtype=np.int64)
    out[order] = np.arange(1, order.size + 1)
    return out


@dataclass(frozen=True, eq=False)
class KeptSet:
    """The ids a branch can draw, best first (probability desc, then id asc)."""

    ids: np.ndarray  # [count] int64
    prob_before: np.ndarray  # [count] float64, softmax(logits / T) over all ids
    prob_after: np.ndarray  # [count] float64, renormalised over the kept ids
    count: int
    mass: float  # sum of prob_before over the kept ids


def filter_distribution(logits: torch.Tensor, settings: SamplingSettings) -> KeptSet:
    """What the filter keeps of a 1-D logits row, with FP64 probabilities.

    Membership comes from `warp` (float32, exactly what sampling uses); ids that are -inf
    on input are never kept. Greedy keeps the argmax only, and since softmax(l / 0) is
    undefined its probabilities are reported at T = 1.
    """
    if logits.ndim != 1:
        raise ValueError(f"expected 1-D logits, got shape {tuple(logits.shape)}")
    row = logits.detach().cpu()
    t = 1.0 if settings.is_greedy else settings.temperature
    p64 = torch.softmax(row.to(torch.float64) / t, dim=-1).numpy()
    if settings.is_greedy:
        kept = np.array([int(torch.argmax(row))], dtype=np.int64)
    else:
        scores = warp(row.reshape(1, -1), settings)[0]  # [1, vocab] like `choose`, same sort
        kept = torch.nonzero(scores != _NEG_INF).flatten().numpy().astype(np.int64)
    kept = kept[np.lexsort((kept, -p64[kept]))]
    before = p64[kept]
    mass = math.fsum(before.tolist())
    return KeptSet(kept, before, before / mass, int(kept.size), mass)
