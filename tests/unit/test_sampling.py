"""pipeline.sampling: transforms on hand-built logits, parity with transformers' warpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pipeline.errors import UserError
from pipeline.numerics.sampling import (
    SamplingSettings,
    Temperature,
    TopK,
    TopP,
    choose,
    filter_distribution,
    next_token_probs,
    probability_table,
    rank_order,
    ranks,
    warp,
)

INF = float("inf")


def kept(scores: torch.Tensor) -> set[int]:
    return set(torch.nonzero(scores.flatten() != -INF).flatten().tolist())


def hf_warpers(s: SamplingSettings) -> LogitsProcessorList:
    """The warpers generate's `_get_logits_processor` builds for do_sample=True."""
    out = LogitsProcessorList()
    if s.temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(s.temperature)))
    if s.top_k != 0:
        out.append(TopKLogitsWarper(top_k=s.top_k, min_tokens_to_keep=1))
    if s.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1))
    return out


def hf_scores(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    return hf_warpers(s)(None, logits.reshape(1, -1).to(torch.float32))[0]


# ---------------------------------------------------------------- hand-built logits


def test_temperature_divides_and_leaves_input():
    x = torch.tensor([1.0, -2.0, -INF, 4.0])
    before = x.clone()
    y = Temperature(2.0)(x)
    assert torch.equal(y, torch.tensor([0.5, -1.0, -INF, 2.0]))
    assert torch.equal(x, before) and y.data_ptr() != x.data_ptr()


def test_top_k_keeps_ties_with_kth_score():
    x = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert kept(TopK(1)(x)) == {1, 2}  # both equal maxima survive k=1
    assert kept(TopK(2)(x)) == {1, 2}
    assert kept(TopK(3)(x)) == {1, 2, 3}
    assert kept(TopK(99)(x)) == {0, 1, 2, 3}  # k > vocab keeps all


def test_top_k_zero_is_off_and_returns_a_new_tensor():
    x = torch.tensor([0.0, -INF, 5.0])
    y = TopK(0)(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_top_p_one_dominant_id():
    x = torch.tensor([10.0, 0.0, 0.0, 0.0])
    assert kept(TopP(0.9)(x)) == {0}
    # id 0 holds ~0.99986 < 0.9999, so one of the tied zeros joins it: the highest id
    assert kept(TopP(0.9999)(x)) == {0, 3}


def test_top_p_flat_mass_exactly_p_keeps_that_set():
    x = torch.zeros(4)  # each id 0.25, sums exact in float32
    assert kept(TopP(0.25)(x)) == {3}  # one id reaches 0.25 exactly: smallest set
    assert kept(TopP(0.5)(x)) == {2, 3}
    assert kept(TopP(0.3)(x)) == {2, 3}  # 0.25 < 0.3: two ids needed


def test_top_p_tie_at_cut_keeps_highest_ids_on_short_rows():
    # probs ~ [0.105, 0.285, 0.285, 0.285, 0.039]; the tie {1, 2, 3} straddles the cut.
    x = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    for p, expected in [(0.2, {3}), (0.3, {2, 3}), (0.6, {1, 2, 3}), (0.9, {0, 1, 2, 3})]:
        out = TopP(p)(x)
        assert kept(out) == expected
        assert kept(out) == kept(TopPLogitsWarper(p)(None, x[None]))


def test_top_p_tie_at_cut_on_long_rows_matches_warper_and_count_is_fixed():
    # 4096 ids, 4 distinct values: CPU torch.sort is not stable here, so which tied ids
    # survive follows the sort, not the id order; how many survive does not.
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, (4096,), generator=g).float()
    p = 0.5
    ours = TopP(p)(x)
    assert kept(ours) == kept(TopPLogitsWarper(p)(None, x[None]))
    assert kept(TopP(p)(x)) == kept(ours)  # deterministic
    top = x == 3.0
    n_top = int(top.sum())
    survivors = kept(ours)
    # stable-sort reference: count from the cumulative sum, which ignores tie order
    values = torch.sort(x).values
    cum = values.softmax(-1).cumsum(-1)
    n_stable = int((cum > 1 - p).sum())
    assert len(survivors) == n_stable
    assert 0 < n_stable < n_top  # the cut does fall inside the top tie group
    assert survivors <= set(torch.nonzero(top).flatten().tolist())


def test_top_p_with_minus_inf_entries():
    x = torch.tensor([-INF, -INF, 1.0, 0.0])
    assert kept(TopP(0.9)(x)) == {2, 3}
    assert kept(TopP(0.5)(x)) == {2}


def test_top_p_one_is_off_even_where_the_warper_would_drop_underflow():
    x = torch.tensor([0.0, -200.0])  # exp(-200) underflows to 0 in float32
    assert kept(TopP(1.0)(x)) == {0, 1}
    assert kept(TopPLogitsWarper(1.0)(None, x[None])) == {0}  # why generate adds none at 1.0


def test_warp_order_temperature_then_top_k_then_top_p():
    x = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0], dtype=torch.bfloat16)
    s = SamplingSettings(temperature=0.5, top_k=3, top_p=0.9)
    out = warp(x, s)
    assert out.dtype == torch.float32
    assert torch.equal(out, hf_scores(x, s))
    assert kept(out) == {0, 1}
    assert out[0].item() == 8.0  # divided by T before filtering


def test_warp_greedy_is_raw_float32_logits():
    x = torch.tensor([1.0, 5.0, 5.0], dtype=torch.bfloat16)
    assert torch.equal(warp(x, SamplingSettings(temperature=0.0, top_k=1)), x.float())


def test_rank_ties_by_lower_id():
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, -INF], dtype=torch.bfloat16)
    assert rank_order(x).tolist() == [1, 2, 3, 0, 4]
    assert ranks(x).tolist() == [4, 1, 2, 3, 5]


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
    assert ks.ids.tolist() == [0, 1, 3]  # tie at the 2nd score keeps both; equal probs by id
    p = torch.softmax(x.double(), -1).numpy()
    np.testing.assert_array_equal(ks.prob_before, p[[0, 1, 3]])
    assert ks.count == 3 and ks.mass == pytest.approx(1 - p[2], abs=1e-15)
    np.testing.assert_allclose(ks.prob_after, p[[0, 1, 3]] / (1 - p[2]), rtol=1e-14)


def test_filter_distribution_greedy_keeps_lowest_argmax():
    x = torch.tensor([3.0, 5.0, 5.0, 1.0], dtype=torch.bfloat16)
    ks = filter_distribution(x, SamplingSettings(temperature=0.0, top_k=3))
    assert ks.ids.tolist() == [1] and ks.count == 1
    assert ks.prob_before[0] == pytest.approx(float(torch.softmax(x.double(), -1)[1]), abs=1e-15)
    assert ks.prob_after.tolist() == [1.0]


def test_next_token_probs_and_greedy_choice():
    x = torch.tensor([0.0, 2.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    greedy = SamplingSettings(temperature=0.0)
    assert choose(x, greedy, g) == 1
    assert torch.equal(next_token_probs(x, greedy), torch.softmax(x, -1))
    s = SamplingSettings(temperature=0.7, top_k=2, top_p=1.0)
    probs = next_token_probs(x, s)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.nn.functional.softmax(hf_scores(x, s), dim=-1))
    assert {choose(x, s, g) for _ in range(50)} == {1, 2}


def test_choose_replays_the_global_seeded_draw():
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    s = SamplingSettings(temperature=1.3, top_k=10, top_p=0.9)
    g = torch.Generator().manual_seed(42)
    ours = [choose(x, s, g) for _ in range(20)]
    torch.manual_seed(42)
    probs = torch.nn.functional.softmax(hf_scores(x, s)[None], dim=-1)
    theirs = [int(torch.multinomial(probs, num_samples=1)[0, 0]) for _ in range(20)]
    assert ours == theirs and len(set(ours)) > 1


# ---------------------------------------------------------------- validation

BAD = [
    (dict(temperature=True), "sampling.temperature", "True"),
    (dict(temperature=-0.5), "sampling.temperature", "-0.5"),
    (dict(temperature=math.nan), "sampling.temperature", "nan"),
    (dict(temperature=math.inf), "sampling.temperature", "inf"),
    (dict(temperature="1"), "sampling.temperature", "'1'"),
    (dict(top_k=True), "sampling.top_k", "True"),
    (dict(top_k=-1), "sampling.top_k", "-1"),
    (dict(top_k=2.0), "sampling.top_k", "2.0"),
    (dict(top_p=0.0), "sampling.top_p", "0.0"),
    (dict(top_p=1.5), "sampling.top_p", "1.5"),
    (dict(top_p=math.nan), "sampling.top_p", "nan"),
    (dict(top_p=False), "sampling.top_p", "False"),
]


@pytest.mark.parametrize(("kwargs", "key", "shown"), BAD)
def test_settings_reject_bad_values(kwargs, key, shown):
    with pytest.raises(UserError) as err:
        SamplingSettings(**kwargs)
    assert str(err.value).startswith(f"{key}={shown} is not allowed")


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: Temperature(0.0), "sampling.temperature"),
        (lambda: Temperature(False), "sampling.temperature"),
        (lambda: TopK(1.5), "sampling.top_k"),
        (lambda: TopK(-3), "sampling.top_k"),
        (lambda: TopP(0), "sampling.top_p"),
        (lambda: TopP(1.01), "sampling.top_p"),
        (lambda: probability_table(torch.zeros(3), [1.0, 0.0]), "probs.temperatures"),
    ],
)
def test_transforms_reject_bad_values(make, key):
    with pytest.raises(UserError, match=key):
        make()


def test_settings_accept_edges():
    s = SamplingSettings(temperature=0, top_k=np.int64(3), top_p=1)
    assert s.is_greedy and not SamplingSettings(temperature=1e-3).is_greedy


# ---------------------------------------------------------------- properties

# Values on a coarse grid so ties are common; -inf now and then.
logit_values = st.one_of(st.integers(-12, 12).map(lambda i: i / 4), st.just(-INF))
rows = st.lists(logit_values, min_size=1, max_size=300).filter(lambda v: any(math.isfinite(a) for a in v))
temperatures = st.sampled_from([0.3, 0.7, 1.0, 1.5, 4.0])
top_ks = st.integers(0, 40)
top_ps = st.one_of(st.just(1.0), st.floats(0.01, 1.0, exclude_max=True))


@hyp_settings(max_examples=150, deadline=None)
@given(values=rows, k=top_ks, p=top_ps)
def test_kept_sets_equal_transformers_warpers(values, k, p):
    x = torch.tensor(values, dtype=torch.float32)
    before = x.clone()
    if k > 0:
        assert kept(TopK(k)(x)) == kept(TopKLogitsWarper(k)(None, x[None]))
    if p < 1.0:
        assert torch.equal(TopP(p)(x), TopPLogitsWarper(p)(None, x[None])[0])
    assert torch.equal(x, before)


@hyp_settings(max_examples=150, deadline=None)
@given(values=rows, t=temperatures, k=top_ks, p=top_ps)
def test_warp_and_kept_set_match_generate_processors(values, t, k, p):
    x = torch.tensor(values, dtype=torch.bfloat16)
    before = x.clone()
    s = SamplingSettings(temperature=t, top_k=k, top_p=p)
    ref = hf_scores(x, s)
    assert torch.equal(warp(x, s), ref)
    ks = filter_distribution(x, s)
    assert set(ks.ids.tolist()) == kept(ref)
    assert ks.count == len(ks.ids) >= 1
    assert abs(math.fsum(ks.prob_after.tolist()) - 1) <= 1e-12
    assert ks.mass == pytest.approx(math.fsum(ks.prob_before.tolist()), abs=1e-15)
    # best first: probability desc, ties by id asc
    order = np.lexsort((ks.ids, -ks.prob_before))
    assert order.tolist() == list(range(ks.count))
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
