"""Decode one branch token by token, recording each step's logits and the token drawn.

The loop is the transparent twin of `model.generate` for a batch of one: the same forward
calls (one row of logits per step, the prompt pass included), the same float32 scores,
warpers and `torch.multinomial`; only the RNG is a dedicated CPU `torch.Generator` seeded
once per branch instead of the global one. `generate_reference` runs generate itself, with
every knob of the model's generation_config that could change its draws switched off, so
the two can be compared token for token and logit for logit.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass

import torch

from pipeline import progress
from pipeline.errors import UserError
from pipeline.numerics.sampling import SamplingSettings, check_temperature, choose, largest_logit, next_token_probs


@dataclass(frozen=True, eq=False)
class Step:
    """One generated token and the numbers it came from."""

    step: int  # 1-based
    prefix_len: int  # tokens fed before this one (prompt + earlier steps)
    token_id: int
    logits: torch.Tensor  # [vocab], model dtype, bit-exact copy of the last position's row (on CPU)
    prob: float  # float32 probability of token_id under the distribution drawn from (greedy: raw softmax)
    stop_reason: str | None  # "eos" | "max_new_tokens" | None


def _check(prompt_ids: list[int]) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids: at least one token id is needed")


def _check_logits(logits: torch.Tensor, settings: SamplingSettings, step: int, position: int) -> None:
    """Refuse what would break the draw with an opaque message: NaN or +inf logits (-inf is a
    masked id, as in generate), no finite logit at all, or a temperature that overflows them."""
    values = logits.float()
    top = float(values.max())       # NaN if any is NaN; +inf if any is +inf; -inf if every id is masked
    if top != top or top == float("inf"):
        bad = torch.nonzero(values.isnan() | (values == float("inf"))).flatten()
        raise UserError(f"step {step}: logits at position {position} are not finite for {bad.numel()} ids "
                        f"(first: {bad[:5].tolist()}): the model produced NaN/Inf (NaN or +inf; -inf, a masked "
                        f"id, is allowed); no token chosen")
    if top == -float("inf"):
        raise UserError(f"step {step}: logits at position {position} are -inf for every id: no token chosen")
    if not settings.is_greedy:              # greedy divides nothing
        check_temperature("sampling.temperature", settings.temperature, largest_logit(values))


def _device(model: torch.nn.Module) -> torch.device:
    # Where the ids go: the embedding's device (spread over GPUs, accelerate moves the rest).
    return model.get_input_embeddings().weight.device


@dataclass(frozen=True, eq=False)
class Prefill:
    """Step 1's forward pass over the prompt, computed once and shared by every branch that
    starts from it (same prompt, same kv_cache): the pass is deterministic, so each branch
    recomputing it would get these very bits again."""

    prompt_ids: tuple[int, ...]
    kv_cache: bool
    logits: torch.Tensor  # [vocab], model dtype, the last prompt position's row (on CPU)
    cache: object | None  # the model's cache after the prompt (kv_cache=True); branches extend copies


def prefill(model: torch.nn.Module, prompt_ids: list[int], kv_cache: bool) -> Prefill:
    """The whole prompt in one pass, as step 1 of a branch: the logits of the last position
    only (logits_to_keep=1), the call generate makes. (The forward stage's capture computes
    every position; in float32 a 25-row LM-head matmul can round its last row an ulp away from
    a 1-row one, so step 1 follows generate and the checks recompute it from the capture's
    LM-head input, one row.)"""
    _check(prompt_ids)
    model.eval()
    ids = [int(i) for i in prompt_ids]
    with torch.inference_mode():
        if kv_cache:
            # transformers 5.24 names the cache `cache` (`past_key_values` is deprecated).
            out = model(input_ids=torch.tensor([ids], device=_device(model)), cache=None, use_cache=True,
                        logits_to_keep=1)
        else:
            out = model(input_ids=torch.tensor([ids], device=_device(model)), use_cache=False, logits_to_keep=1)
        logits = out.logits[0, -1].to("cpu", copy=True)
    if kv_cache and getattr(out, "cache", None) is None:     # RecurrentGemma: a CausalLMOutput with no cache
        raise UserError(f"model_type={model.config.model_type!r} cannot be decoded with a KV cache: its output "
                        f"({type(out).__name__}) returns no cache, and the trajectories' KV-cache path extends one")
    return Prefill(tuple(ids), kv_cache, logits, out.cache if kv_cache else None)


@functools.cache
def _takes_position_ids(model_class: type) -> bool:
    return "position_ids" in inspect.signature(model_class.forward).parameters


def next_logits(model: torch.nn.Module, ids: list[int], cache) -> tuple[torch.Tensor, object | None]:
    """One decoding step after the prompt pass: the last position's logits (on CPU, model dtype)
    and the extended cache. With a cache only the newest id is fed (the model places it after
    the cached positions); without, the whole prefix again."""
    device = _device(model)
    if cache is not None:
        # the newest id's position, given as generate gives it (`prepare_inputs_for_generation`: the attention
        # mask's cumsum - 1, where forward takes position_ids): a model may not derive it from the cache (Bamba's
        # forward takes arange(1), position 0, when none is given)
        where = ({"position_ids": torch.tensor([[len(ids) - 1]], device=device)}
                 if _takes_position_ids(type(model)) else {})
        out = model(input_ids=torch.tensor([ids[-1:]], device=device), cache=cache, use_cache=True, logits_to_keep=1,
                    **where)
    else:
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
    return out.logits[0, -1].to("cpu", copy=True), out.cache if cache is not None else None


def run_branch(
    model: torch.nn.Module,
    prompt_ids: list[int],
    settings: SamplingSettings,
    max_new_tokens: int,
    seed: int,
    kv_cache: bool,
    eos_ids: set[int],
    shared: Prefill | None = None,
) -> list[Step]:
    """Generate up to max_new_tokens after prompt_ids; stop early after an id in eos_ids.

    kv_cache=False re-runs the whole prefix every step (the reference path); kv_cache=True
    runs the prompt once and then feeds one token at a time with the cache. Step 1 is
    `prefill` (or `shared`, that pass done once for several branches); every step computes
    the logits of the last position only (logits_to_keep=1, as `generate` does).
    """
    _check(prompt_ids)
    ids = [int(i) for i in prompt_ids]
    if shared is not None and (shared.kv_cache != kv_cache or list(shared.prompt_ids) != ids):
        raise ValueError(f"shared prefill (kv_cache={shared.kv_cache}, {len(shared.prompt_ids)} prompt ids) is not "
                         f"this branch's (kv_cache={kv_cache}, {len(ids)} prompt ids)")
    model.eval()
    generator = torch.Generator().manual_seed(seed)  # CPU: replays torch.manual_seed(seed)
    steps: list[Step] = []
    cache = None
    with torch.inference_mode():
        for step in progress.bar(range(1, max_new_tokens + 1), max_new_tokens,
                                 f"decode {'kv-cache' if kv_cache else 'full-prefix'}", "token"):
            if step == 1:
                if shared is None:
                    first = prefill(model, ids, kv_cache)
                    logits, cache = first.logits, first.cache
                else:   # read, never extended: this branch continues from its own copies
                    logits, cache = shared.logits.clone(), copy.deepcopy(shared.cache)
            else:
                logits, cache = next_logits(model, ids, cache if kv_cache else None)
            _check_logits(logits, settings, step, len(ids) - 1)
            probs = next_token_probs(logits, settings)
            token = choose(logits, settings, generator, probs)
            prob = float(probs[token])
            if token in eos_ids:
                stop = "eos"
            elif step == max_new_tokens:
                stop = "max_new_tokens"
            else:
                stop = None
            steps.append(Step(step, len(ids), token, logits, prob, stop))
            ids.append(token)
            if stop is not None:
                break
    return steps


# Every field of transformers' GenerationConfig, handled explicitly (test_decode checks the
# list is complete, so a knob a new transformers adds fails a test until it is placed here).
# generate fills each knob a call leaves None from the model's generation_config.json, so
# those that would change the distribution, the ids allowed, when decoding stops, how a step
# is computed or how many sequences come back are passed with the value that switches them
# off (a keyword, even None, beats the model's file).
OURS = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "use_cache", "eos_token_id",
        "pad_token_id", "output_logits", "return_dict_in_generate")
NEUTRAL = {
    # processors and warpers: the distribution and the ids allowed
    "min_p": None, "top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "guidance_scale": None,
    "renormalize_logits": False, "remove_invalid_values": False, "exponential_decay_length_penalty": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": None, "watermarking_config": None,
    "token_healing": False,
    # the search: one sampled or greedy sequence, no beams, no assistant, no special modes
    "num_beams": 1, "num_return_sequences": 1, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "length_penalty": 1.0, "early_stopping": False, "penalty_alpha": None, "dola_layers": None,
    "constraints": None, "force_words_ids": None, "low_memory": None, "use_mtp": None,
    "prompt_lookup_num_tokens": None, "assistant_early_exit": None, "speculation_type": None,
    # when it stops (max_new_tokens and eos are ours)
    "max_length": None, "max_time": None, "stop_strings": None,
    # how a step is computed: a dynamic cache, no chunked prefill, no compilation
    "cache_implementation": None, "cache_config": None, "max_cache_len": None, "prefill_chunk_size": None,
    "compile_config": None, "disable_compile": True, "continuous_batching_config": None,
}
# No effect on the tokens or logits here: output format, ids generate needs without input ids
# or for encoder-decoders, and the assistant's own settings (no assistant is used).
INERT = ("output_attentions", "output_hidden_states", "output_scores", "bos_token_id", "decoder_start_token_id",
         "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
         "max_matching_ngram_size", "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight",
         "_from_model_config", "transformers_version")


@dataclass(frozen=True, eq=False)
class Generated:
    """What `model.generate` produced for one branch: the new ids and the raw float32 logits
    it computed at each step (before any warper), one [vocab] row per id."""

    ids: list[int]
    logits: list[torch.Tensor]


def generate_reference(
    model: torch.nn.Module,
    prompt_ids: list[int],
    settings: SamplingSettings,
    max_new_tokens: int,
    seed: int,
    kv_cache: bool,
    eos_ids: set[int] | frozenset[int] = frozenset(),
) -> Generated:
    """The new token ids and step logits `model.generate` produces for the same branch (for the
    parity checks).

    Every sampling knob is passed explicitly: a None would fall back to the model's
    generation_config or to generate's global default top_k=50. top_k=0 and top_p=1.0 make
    generate add no warper, as in `run_branch`; everything else is NEUTRAL. Token parity is a
    CPU check: on CUDA generate draws from the device's global generator.
    """
    _check(prompt_ids)
    if max_new_tokens == 0:
        return Generated([], [])  # generate rejects max_new_tokens=0
    model.eval()
    eos = sorted(int(i) for i in eos_ids)
    knobs: dict = {"do_sample": not settings.is_greedy}
    if not settings.is_greedy:
        knobs.update(
            temperature=float(settings.temperature), top_k=int(settings.top_k), top_p=float(settings.top_p)
        )
    input_ids = torch.tensor([list(prompt_ids)], device=_device(model))
    torch.manual_seed(seed)  # generate draws from the global CPU generator
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            use_cache=kv_cache,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else None,
            output_logits=True,
            return_dict_in_generate=True,
            **knobs,
            **NEUTRAL,
        )
    ids = [int(t) for t in out.sequences[0, input_ids.shape[1] :]]
    return Generated(ids, [row[0].to("cpu", copy=True) for row in out.logits])


def generate_warpers(model: torch.nn.Module, settings: SamplingSettings):
    """The processors `model.generate(do_sample=True)` builds for these settings, by generate's
    own builder (`_get_logits_processor`, private in transformers 5.24: pinned) from a config
    with every other knob unset: a second derivation of `pipeline.numerics.sampling.warpers`
    for the checks. Call it as `processors(None, scores)` on [1, vocab] float32 scores."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=float(settings.temperature), top_k=int(settings.top_k),
                              top_p=float(settings.top_p))
    return model._get_logits_processor(generation_config=config, input_ids_seq_length=1)
