"""pipeline.model.input_attribution on tiny_qwen2 (the conf's architecture and seed, float32): Captum's
integrated gradients and input x gradient per prompt token, and the completeness of the gradients."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.errors import UserError
from pipeline.model import input_attribution as ia
from pipeline.model import tiny
from tests.helpers import conf

T = 10


@functools.cache
def _tiny_qwen2():
    src = conf.option("model", "tiny_qwen2")["source"]
    return tiny.build(dict(src["architecture"]), src["seed"], 151643).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 150000, (1, T), generator=torch.Generator().manual_seed(3))


def _targets(model, ids, positions=(4, T - 1), k=2):
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return [(p, int(t)) for p in positions for t in torch.topk(logits[p], k).indices]


PAD = 151643                                        # the Qwen tokenizer's pad (<|endoftext|>); it has no BOS
QWEN = SimpleNamespace(pad_token_id=PAD, unk_token_id=None, eos_token_id=PAD, bos_token_id=None)


@pytest.fixture(scope="module")
def baseline(ids):
    return ia.baseline_ids(ids, QWEN)


def test_completeness_improves_with_steps_and_holds_at_32(ids, baseline):
    model = _tiny_qwen2()
    targets = _targets(model, ids)
    gaps = {n: ia.completeness(ia.attribute(model, ids, targets, baseline, n_steps=n)) for n in (2, ia.IG_STEPS)}
    rel = {n: (g["gap"] / g["difference"].abs()).max() for n, g in gaps.items()}
    assert rel[ia.IG_STEPS] < rel[2]
    assert gaps[ia.IG_STEPS]["within"].all(), gaps[ia.IG_STEPS]
    assert not gaps[2]["within"].all()          # the check can fail: 2 steps leave a gap beyond the bound


def test_the_baseline_is_pads_with_the_bos_kept():
    ids = torch.tensor([[2, 17, 2, 40]])
    gemma = SimpleNamespace(pad_token_id=0, unk_token_id=3, eos_token_id=1, bos_token_id=2)
    assert ia.baseline_ids(ids, gemma).tolist() == [[2, 0, 2, 0]]
    assert ia.baseline_ids(ids, SimpleNamespace(**{**vars(gemma), "pad_token_id": None})).tolist() == [[2, 3, 2, 3]]
    assert ia.baseline_ids(ids, QWEN).tolist() == [[PAD] * 4]
    none = SimpleNamespace(pad_token_id=None, unk_token_id=None, eos_token_id=None, bos_token_id=2)
    with pytest.raises(UserError, match="the tokenizer has no pad, unk or eos token"):
        ia.baseline_ids(ids, none)


def test_table_shape_and_what_each_figure_is(ids, baseline):
    model = _tiny_qwen2()
    targets = _targets(model, ids, positions=(T - 1,), k=1)
    table = ia.attribute(model, ids, targets, baseline, n_steps=4)
    assert list(table.columns) == list(ia.COLUMNS)
    assert set(table["method"]) == set(ia.METHODS) and len(table) == 2 * T
    (position, token), = targets
    with torch.no_grad():
        logit = float(model(input_ids=ids).logits[0, position, token])
        base = float(model(input_ids=baseline).logits[0, position, token])
    assert np.allclose(table["logit_input"], logit, rtol=0, atol=1e-4 * abs(logit))
    assert np.allclose(table["logit_baseline"], base, rtol=0, atol=1e-4 * abs(base))
    # input x gradient by hand: embeddings times the gradient of the logit, summed over the hidden size
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    model(inputs_embeds=embeds).logits[0, position, token].backward()
    want = (embeds * embeds.grad).sum(-1)[0].detach().double().numpy()
    got = table[table["method"] == "input_x_gradient"].sort_values("source_position")["attribution"].to_numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert all(p.requires_grad for p in model.parameters())      # the weights' flags are put back


def test_evenly_spaced_nodes_are_captums_public_layer_integrated_gradients(ids):
    """alpha_power=1 through Captum's `_attribute` on the embeddings equals its public LayerIntegratedGradients
    on the embedding layer with the baseline's token ids (riemann_middle): the private entry point still means
    what the module relies on, and the baseline is what LIG would make of the ids."""
    from captum.attr import LayerIntegratedGradients

    model = _tiny_qwen2()
    (position, token), = _targets(model, ids, positions=(T - 1,), k=1)
    baseline = torch.full_like(ids, 7)                 # a token whose row is not zero
    table = ia.attribute(model, ids, [(position, token)], baseline, n_steps=8, alpha_power=1)
    by_ids, _ = ia._logit_fns(model, position, token)
    public = LayerIntegratedGradients(by_ids, model.get_input_embeddings()).attribute(
        ids, baselines=baseline, n_steps=8, method="riemann_middle")
    got = table[table["method"] == "integrated_gradients"]["attribution"].to_numpy()
    want = public[0].sum(-1).detach().double().numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_the_nodes_are_dense_near_the_baseline_only_where_it_is_the_zero_vector(ids, baseline):
    model = _tiny_qwen2()
    assert not model.get_input_embeddings().weight[PAD].any()         # the init zeroes the padding row
    assert ia.path_alpha_power(model, ids, baseline) == ia.ALPHA_POWER
    assert ia.path_alpha_power(model, ids, torch.full_like(ids, 7)) == 1
    assert ia.path_alpha_power(model, ids, ids.clone()) == 1          # nothing moves


def test_nodes_integrate_polynomials_exactly_in_the_limit():
    weights, alphas = ia.nodes(400, 4)
    assert abs(sum(weights) - 1.0) < 1e-5                      # integral of 1 da over [0, 1]
    assert abs(sum(w * a for w, a in zip(weights, alphas)) - 0.5) < 1e-5
    with pytest.raises(ValueError, match="n_steps=0"):
        ia.nodes(0, 4)


def test_bad_inputs_are_named(ids, baseline):
    model = _tiny_qwen2()
    with pytest.raises(ValueError, match=f"target position {T}: must be in"):
        ia.attribute(model, ids, [(T, 0)], baseline)
    with pytest.raises(ValueError, match="n_steps=0, alpha_power=4: both must be integers >= 1"):
        ia.attribute(model, ids, [(T - 1, 0)], baseline, n_steps=0)
    with pytest.raises(ValueError, match=r"baseline ids \(1, 3\) must have the input's shape"):
        ia.attribute(model, ids, [(T - 1, 0)], baseline[:, :3])
    bf16 = tiny.build(dict(conf.option("model", "tiny_qwen2")["source"]["architecture"]), 1,
                      151643).to(torch.bfloat16)
    with pytest.raises(ValueError, match="input attribution runs in float32; the model is torch.bfloat16"):
        ia.attribute(bf16, ids, [(T - 1, 0)], baseline)
