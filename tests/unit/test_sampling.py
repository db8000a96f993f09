"""pipeline.numerics.sampling on hand-built logits, against hand-computed expectations, numpy,
and the warpers `generate` itself builds (`decode.generate_warpers`, generate's own builder)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from pipeline.checks.rederive import kept_rule, softmax64
from pipeline.errors import UserError
from pipeline.model.decode import generate_warpers
from pipeline.numerics.sampling import (
    Distributions,
    KeptFigures,
    SamplingSettings,
    check_temperature,
    choose,
    filter_distribution,
    largest_logit,
    min_temperature,
    next_token_probs,
    probability_table,
    rank_of,
    rank_order,
    ranks,
    top_order,
    warp,
    warp_rows,
)

INF = float("inf")


def kept(scores: torch.Tensor) -> set[int]:
    return set(torch.nonzero(scores.flatten() != -INF).flatten().tolist())


@pytest.fixture(scope="module")
def generator_model():
    """Any model: generate_warpers uses only its builder, which reads the GenerationConfig."""
    cfg = Qwen2Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1)
    return Qwen2ForCausalLM(cfg).eval()


def generate_scores(model, logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    return generate_warpers(model, s)(None, logits.reshape(1, -1).to(torch.float32))[0]


# ---------------------------------------------------------------- hand-built logits
def test_temperature_divides_in_float32_and_leaves_the_input():
    x = torch.tensor([1.0, -2.0, -INF, 4.0], dtype=torch.bfloat16)
    before = x.clone()
    y = warp(x, SamplingSettings(temperature=2.0))
    assert y.dtype == torch.float32 and torch.equal(y, torch.tensor([0.5, -1.0, -INF, 2.0]))
    assert torch.equal(x, before)


def test_top_k_keeps_ties_with_the_kth_score():
    x = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert kept(warp(x, SamplingSettings(top_k=1))) == {1, 2}    # both equal maxima survive k=1
    assert kept(warp(x, SamplingSettings(top_k=2))) == {1, 2}
    assert kept(warp(x, SamplingSettings(top_k=3))) == {1, 2, 3}
    assert kept(warp(x, SamplingSettings(top_k=99))) == {0, 1, 2, 3}     # k > vocab keeps all


def test_top_p_one_dominant_id():
    x = torch.tensor([10.0, 0.0, 0.0, 0.0])
    assert kept(warp(x, SamplingSettings(top_p=0.9))) == {0}
    # id 0 holds 1 / (1 + 3 e^-10) = 0.99986 < 0.9999, so one of the tied zeros joins it: the highest id
    assert kept(warp(x, SamplingSettings(top_p=0.9999))) == {0, 3}


def test_top_p_flat_mass_exactly_p_keeps_that_set():
    x = torch.zeros(4)  # each id 0.25, sums exact in float32
    assert kept(warp(x, SamplingSettings(top_p=0.25))) == {3}  # one id reaches 0.25 exactly: the smallest set
    assert kept(warp(x, SamplingSettings(top_p=0.5))) == {2, 3}
    assert kept(warp(x, SamplingSettings(top_p=0.3))) == {2, 3}  # 0.25 < 0.3: two ids needed


def test_top_p_tie_at_the_cut_keeps_the_highest_ids_on_short_rows():
    # probabilities ~ [0.105, 0.285, 0.285, 0.285, 0.039]; the tie {1, 2, 3} straddles the cut
    x = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    for p, expected in [(0.2, {3}), (0.3, {2, 3}), (0.6, {1, 2, 3}), (0.9, {0, 1, 2, 3})]:
        assert kept(warp(x, SamplingSettings(top_p=p))) == expected


def test_top_p_tie_at_the_cut_on_long_rows_keeps_the_count_exact_arithmetic_gives():
    # 4096 ids of 4 values: CPU torch.sort is not stable here, so WHICH tied ids survive follows
    # the sort, while HOW MANY follows from the masses: the top group's m-th member is kept iff
    # the mass above it, (m - 1) * q, is < p.
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, (4096,), generator=g).float()
    p = 0.5
    counts = {v: int((x == v).sum()) for v in range(4)}
    q = math.exp(3) / math.fsum(n * math.exp(v) for v, n in counts.items())
    expected = math.ceil(p / q)
    assert expected < counts[3]                                     # the cut falls inside the top group
    survivors = kept(warp(x, SamplingSettings(top_p=p)))
    assert len(survivors) == expected and survivors <= set(torch.nonzero(x == 3).flatten().tolist())
    assert kept(warp(x, SamplingSettings(top_p=p))) == survivors    # deterministic


def test_masked_ids_are_never_kept_and_have_probability_zero():
    x = torch.tensor([-INF, -INF, 1.0, 0.0])
    assert kept(warp(x, SamplingSettings(top_p=0.9))) == {2, 3}
    assert kept(warp(x, SamplingSettings(top_p=0.5))) == {2}
    assert kept(warp(x, SamplingSettings(top_k=3))) == {2, 3}
    ks = filter_distribution(x, SamplingSettings())
    assert ks.ids.tolist() == [2, 3] and ks.prob_before.tolist() == pytest.approx([math.e / (math.e + 1),
                                                                                   1 / (math.e + 1)], rel=1e-15)
    assert next_token_probs(x, SamplingSettings())[:2].tolist() == [0.0, 0.0]
    table = probability_table(x, [0.5, 1.0])
    assert all(tab.p64[0] == tab.p64[1] == 0.0 and tab.sum_err64 < 1e-15 for tab in table.values())
    assert choose(x, SamplingSettings(), torch.Generator().manual_seed(0)) in (2, 3)


def test_top_p_one_is_off_even_where_a_warper_would_drop_underflow():
    x = torch.tensor([0.0, -200.0])  # exp(-200) underflows to 0 in float32
    assert kept(warp(x, SamplingSettings(top_p=1.0))) == {0, 1}   # generate adds no top-p warper at 1.0


def test_warp_order_temperature_then_top_k_then_top_p():
    x = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0], dtype=torch.bfloat16)
    out = warp(x, SamplingSettings(temperature=0.5, top_k=3, top_p=0.9))
    # scores [8, 6, 4, 2, 0]; top-3; softmax of [8, 6, 4]: 1 / (1 + e^-2 + e^-4) = 0.867 < 0.9: two ids
    assert kept(out) == {0, 1} and out[0].item() == 8.0 and out[1].item() == 6.0
    # T = 2: [2, 1.5, 1, 0.5, 0] -> 0.429 < 0.5, then 0.429 + 0.260 >= 0.5: two ids (at T = 1 one: 0.636)
    assert kept(warp(x, SamplingSettings(temperature=2.0, top_p=0.5))) == {0, 1}
    assert kept(warp(x, SamplingSettings(top_p=0.5))) == {0}


def test_warp_greedy_is_the_raw_float32_logits():
    x = torch.tensor([1.0, 5.0, 5.0], dtype=torch.bfloat16)
    assert torch.equal(warp(x, SamplingSettings(temperature=0.0, top_k=1)), x.float())


def test_rank_ties_by_lower_id():
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, -INF], dtype=torch.bfloat16)
    assert rank_order(x).tolist() == [1, 2, 3, 0, 4]
    assert ranks(x).tolist() == [4, 1, 2, 3, 5]


@given(st.lists(st.sampled_from([-INF, -1.0, 0.0, 0.5, 2.0, 3.0]), min_size=1, max_size=40),
       st.integers(1, 45), st.sampled_from([torch.bfloat16, torch.float32]))
@hyp_settings(max_examples=200, deadline=None)
def test_rank_of_and_top_order_are_the_full_sorts(values, n, dtype):
    """The trajectories' rank and top-n without sorting the vocabulary: on rows full of ties and masked ids, the
    very ranks and order of the stable sort (NaN, which sorts apart, takes the sort)."""
    x = torch.tensor(values, dtype=dtype)
    full = ranks(x)
    assert [rank_of(x, i) for i in range(len(values))] == full.tolist()
    assert top_order(x, n).tolist() == rank_order(x)[:n].tolist()
    assert top_order(x, n).tolist() == torch.argsort(x.float(), descending=True, stable=True)[:n].tolist()


def test_probability_table_bf16_against_numpy():
    x = torch.tensor([2.5, -1.0, 0.0, 2.5, -INF], dtype=torch.bfloat16)
    before = x.clone()
    tables = probability_table(x, [0.5, 1.0, 2.0])
    assert list(tables) == [0.5, 1.0, 2.0]
    assert torch.equal(x, before)
    v = x.float().numpy().astype(np.float64)
    for t, tab in tables.items():
        e = np.exp((v - v[np.isfinite(v)].max()) / t)
        np.testing.assert_allclose(tab.p64, e / e.sum(), rtol=1e-14, atol=0)
        assert tab.p64.dtype == np.float64 and tab.p32.dtype == np.float32
        assert tab.sum_err64 <= 1e-12 and tab.sum_err32 <= 1e-6
        assert tab.p64[4] == 0.0 and tab.p64[0] == tab.p64[3]
    assert tables[0.5].p64.max() > tables[1.0].p64.max() > tables[2.0].p64.max()


def test_filter_distribution_top_k_tie_order_and_renormalisation():
    x = torch.tensor([2.0, 1.0, 0.0, 1.0])
    ks = filter_distribution(x, SamplingSettings(temperature=1.0, top_k=2))
    assert ks.ids.tolist() == [0, 1, 3]  # a tie at the 2nd score keeps both; equal probabilities by id
    z = math.e ** 2 + 2 * math.e + 1
    assert ks.prob_before.tolist() == pytest.approx([math.e ** 2 / z, math.e / z, math.e / z], rel=1e-15)
    assert ks.count == 3 and ks.mass == pytest.approx(1 - 1 / z, rel=1e-15)
    kept_z = math.e ** 2 + 2 * math.e
    assert ks.prob_after.tolist() == pytest.approx([math.e ** 2 / kept_z, math.e / kept_z, math.e / kept_z], rel=1e-15)


def test_filter_distribution_greedy_keeps_the_lowest_argmax():
    x = torch.tensor([3.0, 5.0, 5.0, 1.0], dtype=torch.bfloat16)
    ks = filter_distribution(x, SamplingSettings(temperature=0.0, top_k=3))
    assert ks.ids.tolist() == [1] and ks.count == 1
    z = math.exp(3) + 2 * math.exp(5) + math.exp(1)
    assert ks.prob_before[0] == pytest.approx(math.exp(5) / z, rel=1e-15) and ks.prob_after.tolist() == [1.0]


def test_next_token_probs_are_softmax_of_generates_warped_scores(generator_model):
    x = torch.tensor([0.0, 2.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    greedy = SamplingSettings(temperature=0.0)
    assert choose(x, greedy, g) == 1
    e = np.exp(x.numpy() - 2.0)
    np.testing.assert_allclose(next_token_probs(x, greedy).numpy(), e / e.sum(), rtol=1e-6)
    s = SamplingSettings(temperature=0.7, top_k=2, top_p=1.0)
    probs = next_token_probs(x, s)
    assert probs.dtype == torch.float32 and probs.tolist()[0] == probs.tolist()[3] == 0.0
    assert torch.equal(probs, torch.softmax(generate_scores(generator_model, x, s), dim=-1))
    assert {choose(x, s, g) for _ in range(50)} == {1, 2}


# ---------------------------------------------------------------- temperatures the logits allow
def test_the_smallest_temperature_keeps_the_scaled_logits_finite_and_a_smaller_one_is_refused():
    for largest in (19.125, 30.0, 1e-3, 0.0):
        t = min_temperature(largest)
        check_temperature("sampling.temperature", t, largest)       # allowed: the division stays finite
        assert torch.isfinite(torch.tensor([largest, -largest]) / t).all()
        if largest:
            assert t == pytest.approx(largest / 3.4028234663852886e38, rel=0.02)
            assert not torch.isfinite(torch.tensor([largest]) / (t * 0.98)).all()
    with pytest.raises(UserError) as err:
        check_temperature("sampling.temperature", 1e-40, 19.125)
    assert str(err.value) == ("sampling.temperature=1e-40 is not allowed: 0 (greedy) or at least 5.68e-38 for this "
                              "run's logits (largest |logit| 19.125; a smaller temperature overflows float32)")
    check_temperature("sampling.temperature", 0.0, 19.125)          # greedy divides nothing
    assert largest_logit(torch.tensor([-INF, -3.0, 2.0])) == 3.0 and largest_logit(torch.tensor([-INF])) == 0.0


# ---------------------------------------------------------------- properties

# Values on a coarse grid so ties are common; -inf now and then.
logit_values = st.one_of(st.integers(-12, 12).map(lambda i: i / 4), st.just(-INF))
rows = st.lists(logit_values, min_size=1, max_size=300).filter(lambda v: any(math.isfinite(a) for a in v))
temperatures = st.sampled_from([0.3, 0.7, 1.0, 1.5, 4.0])
top_ks = st.integers(0, 40)
top_ps = st.one_of(st.just(1.0), st.floats(0.01, 1.0, exclude_max=True))


@hyp_settings(max_examples=150, deadline=None)
@given(values=rows, t=temperatures, k=top_ks, p=top_ps)
def test_warp_and_kept_set_match_generate_and_numpy(generator_model, values, t, k, p):
    """The scores equal those of the warpers generate builds; the kept set obeys numpy's rule
    (pipeline.checks.rederive); the probabilities are numpy's FP64 softmax, renormalised."""
    x = torch.tensor(values, dtype=torch.bfloat16)
    before = x.clone()
    s = SamplingSettings(temperature=t, top_k=k, top_p=p)
    ref = generate_scores(generator_model, x, s)
    assert torch.equal(warp(x, s), ref)
    ks = filter_distribution(x, s)
    assert set(ks.ids.tolist()) == kept(ref)
    assert kept_rule(x.float().numpy(), t, k, p).violation(ks.ids) is None
    want = softmax64(x.float().numpy(), t)[ks.ids]
    np.testing.assert_allclose(ks.prob_before, want, rtol=1e-13, atol=0)
    np.testing.assert_allclose(ks.prob_after, want / math.fsum(want.tolist()), rtol=1e-13, atol=0)
    assert torch.equal(x, before)


@hyp_settings(max_examples=150, deadline=None)
@given(values=rows, t=temperatures)
def test_probability_tables_sum_to_one_and_keep_logit_order(values, t):
    x = torch.tensor(values, dtype=torch.bfloat16)
    before = x.clone()
    tab = probability_table(x, [t])[t]
    assert tab.sum_err64 <= 1e-12
    v = x.double().numpy()
    i, j = np.meshgrid(np.arange(v.size), np.arange(v.size), indexing="ij")
    higher = v[i] > v[j]
    assert np.all(tab.p64[i][higher] >= tab.p64[j][higher])
    assert np.all(tab.p64[i][v[i] == v[j]] == tab.p64[j][v[i] == v[j]])
    r = ranks(x)
    assert sorted(r.tolist()) == list(range(1, v.size + 1))
    assert np.all(r[i][higher] < r[j][higher])
    assert torch.equal(x, before)


@hyp_settings(max_examples=150, deadline=None)
@given(values=rows, t=temperatures, k=top_ks, p=top_ps)
def test_a_sets_unordered_filter_figures_are_the_kept_sets(values, t, k, p):
    """A set's summary entries come from `kept_figures`, which never orders the kept ids; a single prompt's from
    the ordered KeptSet (prob desc, lower id first: numpy's lexsort). On rows full of ties and masked ids the two
    give the same floats, bit for bit (the first and the last kept id are where ties could tell them apart)."""
    x = torch.tensor(values, dtype=torch.bfloat16)
    s = SamplingSettings(temperature=t, top_k=k, top_p=p)
    ordered = Distributions(x).kept(s)
    p64 = softmax64(x.float().numpy(), t)
    ids = ordered.ids
    assert ids.tolist() == sorted(ids.tolist(), key=lambda i: (-ordered.prob_before[ids.tolist().index(i)], i))
    ordered_figures = KeptFigures(ordered.count, ordered.mass, int(ordered.ids[0]), float(ordered.prob_after[0]),
                                  math.fsum(ordered.prob_before[:-1].tolist()),
                                  abs(math.fsum(ordered.prob_after.tolist()) - 1.0))
    assert ordered_figures == Distributions(x).kept_figures(s)
    assert Distributions(x).kept_count_and_mass(s) == (ordered.count, ordered.mass)
    assert ordered.mass == math.fsum(Distributions(x).p64(t)[ids].tolist())
    np.testing.assert_allclose(ordered.prob_before, p64[ids], rtol=1e-13, atol=0)


@given(st.lists(st.sampled_from([-INF, INF, float("nan"), -3.5, -1.0, 0.0, 2.0]), min_size=1, max_size=20),
       st.sampled_from([torch.bfloat16, torch.float32, torch.float64]))
@hyp_settings(max_examples=100, deadline=None)
def test_largest_logit_is_the_largest_finite_magnitude(values, dtype):
    x = torch.tensor(values, dtype=dtype)
    finite = [abs(v) for v in values if math.isfinite(v)]
    assert largest_logit(x) == (max(finite) if finite else 0.0)


@hyp_settings(max_examples=100, deadline=None)
@given(values=rows, ts=st.lists(temperatures, min_size=1, max_size=4), k=top_ks, p=top_ps)
def test_warp_rows_are_the_single_warps(values, ts, k, p):
    """The probs stage warps a row's top-p filters at several temperatures as one batch (`warp_rows`, prefetched
    into `Distributions`): each row is `warp`'s floats for its settings alone, and the prefetched kept ids the ones a
    lone filter keeps, on tie-rich rows (where a sort's order among equal scores decides what top-p drops)."""
    x = torch.tensor(values, dtype=torch.bfloat16)
    batch = warp_rows(x, ts, k, p)
    assert batch.shape == (len(ts), len(values))
    for t, row in zip(ts, batch):
        assert torch.equal(row, warp(x, SamplingSettings(t, k, p)))
    settings = [SamplingSettings(t, k, p) for t in ts]
    fetched = Distributions(x)
    fetched.prefetch(settings)
    for s in settings:
        assert fetched.kept(s).ids.tolist() == Distributions(x).kept(s).ids.tolist()


def test_warp_rows_on_a_vocabulary_of_ties():
    """A 152k-id bf16 row (ties everywhere, as a real model's): three temperatures batched give the single warps'
    floats, so which of equal scores top-p keeps is the same (the sort is per row, whatever the batch)."""
    g = torch.Generator().manual_seed(29)
    x = (torch.randn(152_064, generator=g) * 2).to(torch.bfloat16)
    for row, t in zip(warp_rows(x, [0.5, 1.0, 2.0], 0, 0.9), (0.5, 1.0, 2.0)):
        assert torch.equal(row, warp(x, SamplingSettings(t, 0, 0.9)))
