"""Turn one row of next-token logits into probabilities, filtered sets and a chosen token.

The filters ARE transformers' warpers (`TemperatureLogitsWarper`, `TopKLogitsWarper`,
`TopPLogitsWarper`), built with the rules `generate` builds them by, so a decode loop built
on `choose` draws exactly the tokens of `model.generate(do_sample=True, ...)` by
construction: generate casts the last row to float32, applies temperature -> top-k -> top-p,
takes `softmax` in float32 and calls `torch.multinomial`. The FP64 tables beside them are
for reporting and never feed the draw. Settings arrive validated (pipeline.config.schema).

Masked ids: a logit of -inf (a model that rules an id out) is an id with probability 0
everywhere here; NaN and +inf are refused by the stages before these functions run.

Ties at the top-p cut (the warper's rule): HOW MANY of a group of equal scores are kept is
fixed by the cumulative mass; WHICH of them follows `torch.sort(descending=False)` (not
stable): on CPU the highest ids of the group for rows of <= 16 entries, for longer rows
deterministic for a given row, build and device but in no id order.

Ranks: rank 1 is the highest logit; equal logits rank by lower token id first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pipeline.errors import bad_value
from pipeline.numerics.exactsum import fsum

_NEG_INF = -float("inf")
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINIEST = float(np.nextafter(np.float32(0), np.float32(1)))   # smallest subnormal


@dataclass(frozen=True)
class SamplingSettings:
    """One sampling branch's filter. temperature 0 = greedy; top_k 0 and top_p 1.0 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def warpers(settings: SamplingSettings) -> LogitsProcessorList:
    """The warpers generate's `_get_logits_processor` adds for do_sample=True and one beam:
    none for T == 1.0, top_k == 0, top_p == 1.0; min_tokens_to_keep=1."""
    out = LogitsProcessorList()
    if settings.temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(settings.temperature)))
    if settings.top_k != 0:
        out.append(TopKLogitsWarper(top_k=int(settings.top_k), min_tokens_to_keep=1))
    if settings.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(settings.top_p), min_tokens_to_keep=1))
    return out


def warp(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Float32 scores after temperature -> top-k -> top-p (filtered ids = -inf), input unchanged.

    Cast to float32 first, as generate does before its processors (whose `__call__` ignores
    input_ids), and shaped [1, vocab] as its batch of one (the top-p warper needs a batch
    dimension), then back to the input's shape. Greedy applies no warper (generate with
    do_sample=False doesn't either).
    """
    scores = logits.to(dtype=torch.float32, copy=True)
    return scores if settings.is_greedy else warpers(settings)(None, scores.reshape(1, -1)).reshape(logits.shape)


def _row_warpers(t: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """`warpers` for one row of `warp_rows`. At T = 1.0 (where generate adds no temperature warper) the list is that
    of another temperature with its temperature warper at 1.0, which divides by 1.0, the identity bit for bit, so
    that every row's list has the same shape; a list not of that shape is returned as `warpers` builds it."""
    own = warpers(SamplingSettings(t, top_k, top_p))
    if t != 1.0:
        return own
    probe = warpers(SamplingSettings(2.0, top_k, top_p))
    aligned = LogitsProcessorList(TemperatureLogitsWarper(1.0) if isinstance(w, TemperatureLogitsWarper) else w
                                  for w in probe)
    rest = [type(w) for w in aligned if not isinstance(w, TemperatureLogitsWarper)]
    return aligned if rest == [type(w) for w in own] else own


def _same(a, b) -> bool:
    return type(a) is type(b) and vars(a) == vars(b)


def warp_rows(logits: torch.Tensor, temperatures: list[float], top_k: int, top_p: float) -> torch.Tensor:
    """[len(temperatures), vocab]: row i is `warp(logits, SamplingSettings(temperatures[i], top_k, top_p))`, the same
    floats, for temperatures > 0. Each row's warpers are `warpers`' own, in its order; a warper the rows share (top-k,
    top-p: the same class and settings) runs once over the stacked rows, one that differs (the temperature) row by
    row. Every op of those warpers (topk, sort, softmax, cumsum, scatter) works along the vocabulary row by row, and
    one sort of three rows spreads over the cores where three sorts of one row take one each
    (`tests/unit/test_sampling.py` holds the rows to `warp`'s). Lists of different shapes: each row warped alone."""
    if any(t <= 0 for t in temperatures):
        raise ValueError(f"warp_rows needs temperatures > 0, got {temperatures}")
    lists = [_row_warpers(t, top_k, top_p) for t in temperatures]
    if len({len(w) for w in lists}) > 1:
        return torch.stack([warp(logits, SamplingSettings(t, top_k, top_p)).reshape(-1) for t in temperatures])
    rows = logits.to(dtype=torch.float32, copy=True).reshape(1, -1).repeat(len(temperatures), 1)
    for step in zip(*lists):
        if all(_same(w, step[0]) for w in step):
            rows = step[0](None, rows)
        else:
            rows = torch.cat([w(None, rows[i:i + 1]) for i, w in enumerate(step)])
    return rows


def next_token_probs(logits_row: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The float32 distribution `choose` draws from: softmax of the warped row.

    Shaped [1, vocab] while computing, like generate's batch of one, so every op sees the
    same layout. Greedy draws nothing; it returns softmax of the raw float32 logits (T = 1),
    the probability a greedy step reports for its token.
    """
    scores = warp(logits_row.reshape(1, -1), settings)
    return nn.functional.softmax(scores, dim=-1)[0]


def choose(logits_row: torch.Tensor, settings: SamplingSettings, generator: torch.Generator,
           probs: torch.Tensor | None = None) -> int:
    """Next token id: argmax of the raw logits when greedy, else one multinomial draw.

    argmax returns the lowest id among equal maxima (as generate's). The draw uses the
    caller's CPU generator, which replays `torch.manual_seed(seed)`'s global stream. `probs`:
    `next_token_probs(logits_row, settings)` where the caller has it already.
    """
    if settings.is_greedy:
        return int(torch.argmax(logits_row))
    probs = next_token_probs(logits_row.cpu(), settings) if probs is None else probs
    return int(torch.multinomial(probs.reshape(1, -1), num_samples=1, generator=generator)[0, 0])


# ---------------------------------------------------------------- temperatures the logits allow
def largest_logit(logits: torch.Tensor | np.ndarray) -> float:
    """max |logit| over the finite ids (masked -inf ids excluded); 0.0 when none is finite."""
    values = torch.as_tensor(logits).detach().float()
    if values.numel() == 0:
        return 0.0
    largest = values.abs().max()            # |x| and max are exact
    if torch.isfinite(largest):             # no inf or NaN: every id is finite
        return float(largest)
    finite = values[torch.isfinite(values)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _overflows(largest: float, t: float) -> bool:
    # The very division the warper makes: a float32 tensor by a Python float (IEEE, in float32;
    # a T below float32's smallest subnormal becomes 0 there, and 0 / 0 is NaN).
    return not bool(torch.isfinite(torch.tensor([largest], dtype=torch.float32) / t).all())


def min_temperature(largest: float) -> float:
    """The smallest temperature (3 significant digits, rounded up) whose float32 logits / T
    stays finite for logits up to `largest` in absolute value."""
    t = float(f"{max(largest / _F32_MAX, _F32_TINIEST):.3g}")
    while _overflows(largest, t):
        t = float(f"{t * 1.01:.3g}")
    return t


def check_temperature(key: str, t: float, largest: float, greedy: bool = True) -> None:
    """Refuse a temperature > 0 whose scaled logits overflow float32 (they would become inf,
    the kept set everything and the draw NaN); 0 (greedy, where `greedy`) divides nothing."""
    if t > 0 and _overflows(largest, t):
        raise bad_value(key, t, f"{'0 (greedy) or ' if greedy else ''}at least {min_temperature(largest):.3g} for "
                                f"this run's logits (largest |logit| {largest:g}; a smaller temperature overflows "
                                f"float32)")


# ---------------------------------------------------------------- FP64 tables
@dataclass(frozen=True, eq=False)
class ProbTable:
    """softmax(logits / T) over all ids: p64 via float64, p32 via float32, and |sum - 1| of each."""

    temperature: float
    p64: np.ndarray  # [vocab] float64
    p32: np.ndarray  # [vocab] float32
    sum_err64: float
    sum_err32: float


def _sum_error(p: np.ndarray) -> float:
    # fsum is exact (math.fsum's correctly rounded sum), so the error measured is the table's, not the summation's.
    return abs(fsum(p) - 1.0)


def _softmax64(row: torch.Tensor, t: float) -> np.ndarray:
    return torch.softmax(row.to(torch.float64) / t, dim=-1).numpy()


def probability_table(logits: torch.Tensor, temperatures: list[float]) -> dict[float, ProbTable]:
    """One ProbTable per temperature (validated > 0) for a 1-D logits row of any dtype (e.g. bf16)."""
    row = Distributions(logits)
    return {t: row.table(t) for t in temperatures}


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


def rank_of(logits: torch.Tensor, token_id: int) -> int:
    """ranks(logits)[token_id] without sorting the vocabulary: 1 + the ids scoring higher + the lower ids
    scoring the same (the stable sort's tie order). A row holding NaN (which sorts apart) takes the sort."""
    values = logits.detach().cpu()          # compared in the row's own dtype: exact, as after widening to float64
    if values.isnan().any():
        return int(ranks(logits)[token_id])
    v = values[token_id]
    return 1 + int((values > v).sum()) + int((values[:token_id] == v).sum())


def top_order(logits: torch.Tensor, n: int) -> np.ndarray:
    """rank_order(logits)[:n] without sorting the vocabulary: the ids scoring at least the n-th highest score,
    sorted among themselves (logit descending, lower id first). A row holding NaN takes the full sort."""
    values = logits.detach().cpu()          # compared in the row's own dtype: exact, as after widening to float64
    if n >= values.numel() or values.isnan().any():
        return rank_order(logits)[:n]
    kth = torch.topk(values, n).values[-1]                                 # the n-th highest score
    ids = torch.nonzero(values >= kth).flatten().numpy()                   # ascending: ties by lower id
    return ids[np.argsort(-values[ids].to(torch.float64).numpy(), kind="stable")][:n]


@dataclass(frozen=True, eq=False)
class KeptSet:
    """The ids a branch can draw, best first (probability desc, then id asc)."""

    ids: np.ndarray  # [count] int64
    prob_before: np.ndarray  # [count] float64, softmax(logits / T) over all ids
    prob_after: np.ndarray  # [count] float64, renormalised over the kept ids
    count: int
    mass: float  # sum of prob_before over the kept ids


@dataclass(frozen=True)
class KeptFigures:
    """What a filter's summary entry records of its KeptSet: count and mass, the first kept id (`ids[0]`) and its
    renormalised probability, the mass without the last kept id (`fsum(prob_before[:-1])`) and
    |fsum(prob_after) - 1|."""

    count: int
    mass: float
    top_id: int
    top_prob_after: float
    mass_without_last: float
    renormalised_sum_error: float


def filter_distribution(logits: torch.Tensor, settings: SamplingSettings) -> KeptSet:
    """What the filter keeps of a 1-D logits row, with FP64 probabilities.

    Membership comes from `warp` (float32, exactly what sampling uses); ids that are -inf
    on input are never kept. Greedy keeps the argmax only, and since softmax(l / 0) is
    undefined its probabilities are reported at T = 1.
    """
    return Distributions(logits).kept(settings)


def _unmasked(scores: torch.Tensor) -> np.ndarray:
    """The ids a warped row keeps (its scores not -inf), ascending."""
    return torch.nonzero(scores.flatten() != _NEG_INF).flatten().numpy().astype(np.int64)


class Distributions:
    """One 1-D logits row's FP64 / FP32 tables by temperature and its filters' kept sets, each computed once
    and shared (read only): the probs stage asks the same row for the same softmax, entropy and filter from
    its tables, summaries and prompt metrics. Every value is the one `probability_table` / `filter_distribution`
    give for the row alone (they are this class, used once)."""

    def __init__(self, logits: torch.Tensor):
        if logits.ndim != 1:
            raise ValueError(f"expected 1-D logits, got shape {tuple(logits.shape)}")
        self.row = logits.detach().cpu()
        self._p64: dict[float, np.ndarray] = {}
        self._tables: dict[float, ProbTable] = {}
        self._entropy: dict[float, float] = {}
        self._kept: dict[SamplingSettings, KeptSet] = {}
        self._members: dict[SamplingSettings, np.ndarray] = {}
        self._total: dict[float, float] = {}
        self._mass: dict[SamplingSettings, float] = {}

    def p64(self, t: float) -> np.ndarray:
        """softmax(logits / t) in float64 over every id."""
        if t not in self._p64:
            self._p64[t] = _softmax64(self.row, t)
            self._p64[t].flags.writeable = False
        return self._p64[t]

    def total(self, t: float) -> float:
        """fsum(p64(t)): the exact sum of every id's FP64 probability, rounded once (a table's sum error, and the
        mass of a filter that keeps every id)."""
        if t not in self._total:
            self._total[t] = fsum(self.p64(t))
        return self._total[t]

    def table(self, t: float) -> ProbTable:
        if t not in self._tables:
            p64 = self.p64(t)
            p32 = torch.softmax(self.row.float() / t, dim=-1).numpy()
            self._tables[t] = ProbTable(t, p64, p32, abs(self.total(t) - 1.0), _sum_error(p32))
        return self._tables[t]

    def entropy_nats(self, t: float) -> float:
        """-sum p ln p of softmax(logits / t) over the ids of p > 0 (an exact sum of the terms)."""
        if t not in self._entropy:
            p = self.p64(t)
            nz = p[p > 0]
            self._entropy[t] = float(-fsum(nz * np.log(nz)))
        return self._entropy[t]

    def prefetch(self, settings: list[SamplingSettings]) -> None:
        """The kept ids of several filters at once where that shares work: top-p filters that differ only in
        temperature warp as the rows of one `warp_rows` call (one sort over the cores instead of one per filter).
        Each filter's ids are those `_kept_ids` would compute alone, the very floats behind them."""
        groups: dict[tuple[int, float], list[SamplingSettings]] = {}
        for s in dict.fromkeys(settings):
            if not s.is_greedy and s.top_p < 1.0 and s not in self._members:
                groups.setdefault((s.top_k, s.top_p), []).append(s)
        for (top_k, top_p), group in groups.items():
            if len(group) > 1:
                rows = warp_rows(self.row, [s.temperature for s in group], top_k, top_p)
                for s, scores in zip(group, rows):
                    self._members[s] = _unmasked(scores)

    def _kept_ids(self, settings: SamplingSettings) -> np.ndarray:
        """The ids the filter keeps, ascending."""
        if settings not in self._members:
            if settings.is_greedy:
                ids = np.array([int(torch.argmax(self.row))], dtype=np.int64)
            else:
                ids = _unmasked(warp(self.row, settings))
            self._members[settings] = ids
        return self._members[settings]

    def _filter_p64(self, settings: SamplingSettings) -> np.ndarray:
        """The FP64 distribution a filter's probabilities are reported in: at its temperature, greedy at T = 1."""
        return self.p64(1.0 if settings.is_greedy else settings.temperature)

    def kept(self, settings: SamplingSettings) -> KeptSet:
        if settings not in self._kept:
            p64 = self._filter_p64(settings)
            kept = self._kept_ids(settings)             # ascending, so a stable sort puts equal ones by lower id
            kept = kept[np.argsort(-p64[kept], kind="stable")]
            before = p64[kept]
            mass = self.kept_count_and_mass(settings)[1]
            self._kept[settings] = KeptSet(kept, before, before / mass, int(kept.size), mass)
        return self._kept[settings]

    def kept_count_and_mass(self, settings: SamplingSettings) -> tuple[int, float]:
        """`kept(settings)`'s count and mass without ordering the kept ids (an exact sum is the same in any
        order; a filter that keeps every id has the table's total)."""
        ids = self._kept_ids(settings)
        if settings not in self._mass:
            p64 = self._filter_p64(settings)
            self._mass[settings] = self.total(1.0 if settings.is_greedy else settings.temperature) \
                if ids.size == p64.size else fsum(p64[ids])
        return int(ids.size), self._mass[settings]

    def kept_figures(self, settings: SamplingSettings) -> KeptFigures:
        """A filter's summary figures, those of `kept(settings)` (its first id, the mass without its last) computed
        without sorting the kept ids: what summary.json records of a filter, whether filtered.parquet stores its
        rows or not."""
        ids = self._kept_ids(settings)
        count, mass = self.kept_count_and_mass(settings)
        before = self._filter_p64(settings)[ids]
        top = int(np.argmax(before))                            # the first of the highest: the lowest id of them
        last = before.size - 1 - int(np.argmin(before[::-1]))   # the last of the lowest: the highest id of them
        return KeptFigures(count, mass, int(ids[top]), float(before[top] / mass),
                           fsum(np.delete(before, last)), abs(fsum(before / mass) - 1.0))
