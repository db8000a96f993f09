"""pipeline.model.decode on a tiny random Qwen2: token-for-token parity with model.generate."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from pipeline.config.schema import SamplingConfig
from pipeline.model import trajectories
from pipeline.model.decode import generate_reference, prefill, run_branch
from pipeline.numerics.sampling import SamplingSettings, next_token_probs

PROMPT = [11, 7, 300, 42, 5]
N = 5
GREEDY = SamplingSettings(temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A 32-wide model gains nothing from threads; on a busy shared CPU, intra-op threads
    # oversubscribe and make each generate call 20x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models() -> dict[torch.dtype, Qwen2ForCausalLM]:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        # Random init is near flat; a wider LM head gives peaked, seed-sensitive draws.
        model.lm_head.weight.normal_(0.0, 0.5)
    return {torch.float32: model, torch.bfloat16: copy.deepcopy(model).to(torch.bfloat16)}


def tokens(steps) -> list[int]:
    return [s.token_id for s in steps]


SETTINGS = [
    SamplingSettings(temperature=t, top_k=k, top_p=p)
    for t, k, p in itertools.product([0.7, 1.0, 1.5], [0, 5], [1.0, 0.8])
]


@pytest.mark.parametrize(("seed", "s"), list(enumerate(SETTINGS)), ids=str)
def test_sampled_tokens_equal_generate_fp32(models, seed, s):
    model = models[torch.float32]
    ours = tokens(run_branch(model, PROMPT, s, N, seed, kv_cache=False, eos_ids=set()))
    assert len(ours) == N
    assert ours == generate_reference(model, PROMPT, s, N, seed, kv_cache=False)


@pytest.mark.parametrize("s", SETTINGS[::3], ids=str)
def test_sampled_tokens_equal_generate_bf16(models, s):
    model = models[torch.bfloat16]
    for seed in (3, 4):
        ours = tokens(run_branch(model, PROMPT, s, N, seed, kv_cache=False, eos_ids=set()))
        assert ours == generate_reference(model, PROMPT, s, N, seed, kv_cache=False)


def test_seeds_matter_and_sampling_is_not_greedy(models):
    # Guards the parity tests against a model so peaked that every draw is the argmax.
    model = models[torch.float32]
    s = SamplingSettings(temperature=1.0)
    runs = {tuple(tokens(run_branch(model, PROMPT, s, N, seed, False, set()))) for seed in range(4)}
    greedy = tuple(tokens(run_branch(model, PROMPT, GREEDY, N, 0, False, set())))
    assert len(runs) >= 3 and runs != {greedy}


def test_branch_does_not_touch_the_global_rng(models):
    state = torch.get_rng_state()
    run_branch(models[torch.float32], PROMPT, SamplingSettings(1.0), 3, 9, False, set())
    assert torch.equal(torch.get_rng_state(), state)


def test_reference_ignores_the_models_generation_config(models):
    # Hub checkpoints ship generation_config.json; generate fills every knob we leave None
    # from it. Each trap below would change or cut short the trajectory if it leaked in.
    model = copy.deepcopy(models[torch.float32])
    s = SamplingSettings(temperature=1.0, top_k=5, top_p=0.8)
    ours = tokens(run_branch(model, PROMPT, s, N, 1, False, set()))
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.3, top_k=2, top_p=0.5, repetition_penalty=1.5, min_p=0.2,
        no_repeat_ngram_size=1, eos_token_id=[ours[0]], pad_token_id=ours[0],
    )  # fmt: skip
    assert generate_reference(model, PROMPT, s, N, 1, kv_cache=False) == ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_equals_generate_without_sampling(models, dtype):
    model = models[dtype]
    ours = tokens(run_branch(model, PROMPT, GREEDY, N, 0, kv_cache=False, eos_ids=set()))
    ids = torch.tensor([PROMPT])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N, use_cache=False
    )
    assert ours == out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("kv_cache", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_step_one_logits_are_the_forward_logits_bit_for_bit(models, dtype, kv_cache):
    model = models[dtype]
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    steps = run_branch(model, PROMPT, SamplingSettings(1.0), 2, 0, kv_cache, set())
    assert steps[0].logits.dtype == dtype and steps[0].logits.shape == (512,)
    assert torch.equal(steps[0].logits, expected)


def test_steps_record_position_prob_and_stop(models):
    model = models[torch.float32]
    s = SamplingSettings(temperature=1.5, top_k=5, top_p=0.8)
    steps = run_branch(model, PROMPT, s, N, 1, False, set())
    assert [st.step for st in steps] == list(range(1, N + 1))
    assert [st.prefix_len for st in steps] == [len(PROMPT) + i for i in range(N)]
    assert [st.stop_reason for st in steps] == [None] * (N - 1) + ["max_new_tokens"]
    for st in steps:
        probs = next_token_probs(st.logits, s)
        assert st.prob == float(probs[st.token_id]) and 0 < st.prob <= 1
    g = run_branch(model, PROMPT, GREEDY, 2, 0, False, set())
    assert g[0].prob == float(torch.softmax(g[0].logits.float(), -1)[g[0].token_id])


def test_eos_stops_the_branch(models):
    model = models[torch.float32]
    greedy = tokens(run_branch(model, PROMPT, GREEDY, N, 0, False, set()))
    eos = greedy[1]
    stop_at = greedy.index(eos) + 1  # 2 unless step 1 already chose it
    steps = run_branch(model, PROMPT, GREEDY, N, 0, False, {eos})
    assert tokens(steps) == greedy[:stop_at]
    assert steps[-1].stop_reason == "eos" and all(st.stop_reason is None for st in steps[:-1])
    assert generate_reference(model, PROMPT, GREEDY, N, 0, False, eos_ids={eos}) == greedy[:stop_at]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_cache_branch_records_every_step(models, dtype):
    model = models[dtype]
    s = SamplingSettings(temperature=1.0, top_k=5)
    cached = run_branch(model, PROMPT, s, N, 2, kv_cache=True, eos_ids=set())
    full = run_branch(model, PROMPT, s, N, 2, kv_cache=False, eos_ids=set())
    assert len(cached) == N
    assert all(st.logits.dtype == dtype and st.logits.shape == (512,) for st in cached)
    assert torch.equal(cached[0].logits, full[0].logits)  # same single prompt pass
    if dtype == torch.float32:
        # float32 cache vs full prefix: equal up to rounding, and so are the tokens here
        assert tokens(cached) == tokens(full)
        for a, b in zip(cached, full):
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        assert tokens(cached) == generate_reference(model, PROMPT, s, N, 2, kv_cache=True)


def test_zero_max_new_tokens(models):
    model = models[torch.float32]
    assert run_branch(model, PROMPT, GREEDY, 0, 0, False, set()) == []
    assert generate_reference(model, PROMPT, GREEDY, 0, 0, False) == []


class _Calls:
    """Records the logits_to_keep and the number of fed tokens of every forward of `model`."""

    def __init__(self, model):
        self.calls: list[tuple[int, int]] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.calls.append((kwargs.get("logits_to_keep", 0), kwargs["input_ids"].shape[1]))

    def __enter__(self):
        return self.calls

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("kv_cache", [False, True])
def test_step_one_computes_every_row_later_steps_only_the_last(models, kv_cache):
    # Step 1 makes the capture's call (all rows: its last row is the captured row bit for bit
    # on any device); later steps need one row only, as generate computes them.
    model = models[torch.bfloat16]
    with _Calls(model) as calls:
        run_branch(model, PROMPT, SamplingSettings(1.0), 3, 0, kv_cache, set())
    fed = [len(PROMPT), 1, 1] if kv_cache else [len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2]
    assert calls == [(0, fed[0]), (1, fed[1]), (1, fed[2])]


@pytest.mark.parametrize("kv_cache", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_step_one_follows_capture_positions(models, dtype, kv_cache):
    """capture.positions=last computes one row (logits_to_keep=1): step 1 makes that same call,
    so its logits are the captured row bit for bit, whatever a 1-row matmul rounds to."""
    from pipeline.model import capture
    model = models[dtype]
    with _Calls(model) as calls:
        steps = run_branch(model, PROMPT, SamplingSettings(1.0), 2, 0, kv_cache, set(), positions="last")
    assert calls[0] == (1, len(PROMPT))
    captured = capture.plain_forward_logits(model, torch.tensor([PROMPT]), "last")[0, -1]
    assert torch.equal(steps[0].logits, captured)


@pytest.mark.parametrize("kv_cache", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shared_prefill_changes_nothing_and_is_not_consumed(models, dtype, kv_cache):
    model = models[dtype]
    shared = prefill(model, PROMPT, kv_cache)
    logits_before = shared.logits.clone()
    for s, seed in ((SamplingSettings(1.0, 5), 2), (GREEDY, 0), (SamplingSettings(1.0, 5), 2)):
        alone = run_branch(model, PROMPT, s, N, seed, kv_cache, set())
        with _Calls(model) as calls:
            reused = run_branch(model, PROMPT, s, N, seed, kv_cache, set(), shared=shared)
        assert all(keep == 1 for keep, _ in calls) and len(calls) == N - 1   # no prompt pass of its own
        assert [(a.step, a.prefix_len, a.token_id, a.prob, a.stop_reason) for a in alone] == \
            [(b.step, b.prefix_len, b.token_id, b.prob, b.stop_reason) for b in reused]
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(alone, reused))
        assert reused[0].logits is not shared.logits
    assert torch.equal(shared.logits, logits_before)
    if kv_cache:   # each branch extended its own copy of the cache
        assert shared.cache.get_seq_length() == len(PROMPT)


def test_shared_prefill_must_match_the_branch(models):
    model = models[torch.float32]
    with pytest.raises(ValueError, match="shared prefill"):
        run_branch(model, PROMPT, GREEDY, 2, 0, True, set(), shared=prefill(model, PROMPT, False))
    with pytest.raises(ValueError, match="shared prefill"):
        run_branch(model, PROMPT[:-1], GREEDY, 2, 0, False, set(), shared=prefill(model, PROMPT, False))


def test_run_all_does_one_prompt_pass_per_cache_mode(models):
    model = models[torch.bfloat16]
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, seed=3, max_new_tokens=3,
                         branches=("sample", "greedy"), kv_cache=(False, True), top_n=5)
    with _Calls(model) as calls:
        runs = trajectories.run_all(model, PROMPT, cfg, set())
    assert [(keep, fed) for keep, fed in calls if keep == 0] == [(0, len(PROMPT))] * 2
    assert [(r.branch, r.kv_cache) for r in runs] == [("sample", False), ("sample", True),
                                                      ("greedy", False), ("greedy", True)]
    for r in runs:
        alone = run_branch(model, PROMPT, r.settings, 3, 3, r.kv_cache, set())
        assert tokens(r.steps) == tokens(alone)
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(alone, r.steps))
