"""pipeline.model.decode on a tiny random Qwen2: token-for-token and logit-for-logit parity with
model.generate, whose own loop is the reference throughout."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from pipeline.config.schema import SamplingConfig
from pipeline.errors import UserError
from pipeline.model import decode, trajectories
from pipeline.model.decode import generate_reference, prefill, run_branch
from pipeline.numerics.sampling import SamplingSettings

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
    assert ours == generate_reference(model, PROMPT, s, N, seed, kv_cache=False).ids


@pytest.mark.parametrize("s", SETTINGS[::3], ids=str)
def test_sampled_tokens_equal_generate_bf16(models, s):
    model = models[torch.bfloat16]
    for seed in (3, 4):
        ours = tokens(run_branch(model, PROMPT, s, N, seed, kv_cache=False, eos_ids=set()))
        assert ours == generate_reference(model, PROMPT, s, N, seed, kv_cache=False).ids


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


def test_every_generation_config_knob_is_handled_explicitly():
    # A knob a new transformers adds fails here until decode places it (OURS, NEUTRAL or INERT).
    fields = set(GenerationConfig().to_dict())
    placed = [*decode.OURS, *decode.NEUTRAL, *decode.INERT]
    assert len(placed) == len(set(placed)) and set(placed) == fields, set(placed) ^ fields


# Hub checkpoints ship generation_config.json; generate fills every knob a call leaves None from
# it. Each trap below changes the distribution, the ids allowed, when decoding stops or how many
# sequences come back, if it leaks into the reference (`ours`: the ids the clean run draws).
def traps(ours: list[int]) -> dict:
    return dict(
        do_sample=True, temperature=0.3, top_k=2, top_p=0.5, repetition_penalty=1.5, min_p=0.9, typical_p=0.5,
        no_repeat_ngram_size=1, epsilon_cutoff=0.2, eta_cutoff=0.2, min_new_tokens=3, num_beams=2,
        num_return_sequences=2, sequence_bias={(7,): 9.0}, renormalize_logits=True, guidance_scale=3.0,
        remove_invalid_values=True, exponential_decay_length_penalty=(1, 1.5), suppress_tokens=[ours[1]],
        begin_suppress_tokens=[ours[0]], bad_words_ids=[[ours[2]]], forced_eos_token_id=6, max_length=7,
        length_penalty=2.0, encoder_repetition_penalty=1.5, encoder_no_repeat_ngram_size=2, low_memory=True,
        eos_token_id=[ours[0]], pad_token_id=ours[0],
    )  # fmt: skip


@pytest.mark.parametrize("kv_cache", [False, True])
def test_reference_ignores_the_models_generation_config(models, kv_cache):
    model = copy.deepcopy(models[torch.float32])
    s = SamplingSettings(temperature=1.0, top_k=5, top_p=0.8)
    ours = tokens(run_branch(model, PROMPT, s, N, 1, kv_cache, set()))
    model.generation_config = GenerationConfig(**traps(ours))
    assert generate_reference(model, PROMPT, s, N, 1, kv_cache=kv_cache).ids == ours
    greedy = tokens(run_branch(model, PROMPT, GREEDY, N, 0, kv_cache, set()))
    model.generation_config = GenerationConfig(**traps(greedy))
    assert generate_reference(model, PROMPT, GREEDY, N, 0, kv_cache=kv_cache).ids == greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_equals_generate_without_sampling(models, dtype):
    model = models[dtype]
    ours = tokens(run_branch(model, PROMPT, GREEDY, N, 0, kv_cache=False, eos_ids=set()))
    ids = torch.tensor([PROMPT])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N, use_cache=False
    )
    assert ours == out[0, len(PROMPT) :].tolist()


def generate_scores(model, s: SamplingSettings, n: int, seed: int, kv_cache: bool):
    """model.generate's ids, raw logits and warped scores per step (its own loop, our knobs)."""
    torch.manual_seed(seed)
    ids = torch.tensor([PROMPT])
    sample = {} if s.is_greedy else dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=not s.is_greedy, max_new_tokens=n,
                         use_cache=kv_cache, output_scores=True, output_logits=True, return_dict_in_generate=True,
                         **sample, **decode.NEUTRAL)
    return out.sequences[0, len(PROMPT):].tolist(), [x[0] for x in out.logits], [x[0] for x in out.scores]


@pytest.mark.parametrize("kv_cache", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_step_computes_the_logits_generate_computes_bit_for_bit(models, dtype, kv_cache):
    # Step 1 included: one row of logits, as generate's prompt pass (in float32 an all-rows LM head
    # can round the last row an ulp away from it).
    model = models[dtype]
    s = SamplingSettings(1.5, 5, 0.8)
    steps = run_branch(model, PROMPT, s, N, 4, kv_cache, set())
    ids, logits, _ = generate_scores(model, s, N, 4, kv_cache)
    assert tokens(steps) == ids
    assert all(st.logits.dtype == dtype and st.logits.shape == (512,) for st in steps)
    assert all(torch.equal(st.logits.float(), row) for st, row in zip(steps, logits, strict=True))


def test_steps_record_position_prob_and_stop(models):
    model = models[torch.float32]
    s = SamplingSettings(temperature=1.5, top_k=5, top_p=0.8)
    steps = run_branch(model, PROMPT, s, N, 1, False, set())
    assert [st.step for st in steps] == list(range(1, N + 1))
    assert [st.prefix_len for st in steps] == [len(PROMPT) + i for i in range(N)]
    assert [st.stop_reason for st in steps] == [None] * (N - 1) + ["max_new_tokens"]
    _, _, scores = generate_scores(model, s, N, 1, False)          # generate's warped scores: what it draws from
    for st, sc in zip(steps, scores, strict=True):
        assert st.prob == float(torch.softmax(sc, -1)[st.token_id]) and 0 < st.prob <= 1
    g = run_branch(model, PROMPT, GREEDY, 2, 0, False, set())
    _, logits, _ = generate_scores(model, GREEDY, 2, 0, False)
    assert g[0].prob == float(torch.softmax(logits[0], -1)[g[0].token_id])


def test_eos_stops_the_branch(models):
    model = models[torch.float32]
    greedy = tokens(run_branch(model, PROMPT, GREEDY, N, 0, False, set()))
    eos = greedy[1]
    stop_at = greedy.index(eos) + 1  # 2 unless step 1 already chose it
    steps = run_branch(model, PROMPT, GREEDY, N, 0, False, {eos})
    assert tokens(steps) == greedy[:stop_at]
    assert steps[-1].stop_reason == "eos" and all(st.stop_reason is None for st in steps[:-1])
    assert generate_reference(model, PROMPT, GREEDY, N, 0, False, eos_ids={eos}).ids == greedy[:stop_at]


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
        assert tokens(cached) == generate_reference(model, PROMPT, s, N, 2, kv_cache=True).ids


def test_zero_max_new_tokens(models):
    model = models[torch.float32]
    assert run_branch(model, PROMPT, GREEDY, 0, 0, False, set()) == []
    assert generate_reference(model, PROMPT, GREEDY, 0, 0, False).ids == []


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
def test_every_forward_call_is_the_one_generate_makes(models, kv_cache):
    # logits_to_keep and the number of ids fed, call by call: the prompt pass included
    model = models[torch.bfloat16]
    with _Calls(model) as ours:
        run_branch(model, PROMPT, SamplingSettings(1.0), 3, 0, kv_cache, set())
    with _Calls(model) as theirs:
        generate_reference(model, PROMPT, SamplingSettings(1.0), 3, 0, kv_cache)
    fed = [len(PROMPT), 1, 1] if kv_cache else [len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2]
    assert ours == theirs == [(1, n) for n in fed]


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
    assert [fed for _, fed in calls if fed == len(PROMPT)] == [len(PROMPT)] * 2    # one prompt pass per mode
    assert [(r.branch, r.kv_cache) for r in runs] == [("sample", False), ("sample", True),
                                                      ("greedy", False), ("greedy", True)]
    for r in runs:
        alone = run_branch(model, PROMPT, r.settings, 3, 3, r.kv_cache, set())
        assert tokens(r.steps) == tokens(alone)
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(alone, r.steps))


def test_masked_ids_are_never_drawn_and_a_temperature_that_overflows_is_refused(models):
    model = copy.deepcopy(models[torch.float32])
    masked = torch.arange(512) % 2 == 0                       # a model that rules out every even id
    model.lm_head.register_forward_hook(lambda module, args, out: out.masked_fill(masked, -float("inf")))
    for kv_cache in (False, True):
        for s, seed in ((SamplingSettings(1.0), 3), (SamplingSettings(0.7, 5, 0.8), 4), (GREEDY, 0)):
            steps = run_branch(model, PROMPT, s, N, seed, kv_cache, set())
            assert all(st.token_id % 2 == 1 and st.prob > 0 for st in steps)
            assert tokens(steps) == generate_reference(model, PROMPT, s, N, seed, kv_cache).ids
    with pytest.raises(UserError, match=r"^sampling.temperature=1e-40 is not allowed: 0 \(greedy\) or at least "):
        run_branch(model, PROMPT, SamplingSettings(1e-40), 2, 0, False, set())
