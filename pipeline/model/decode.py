"""Decode one branch token by token, recording each step's logits and the token drawn.

The loop is the transparent twin of `model.generate` for a batch of one: same float32
scores, same warpers, same `torch.multinomial`; only the RNG is a dedicated CPU
`torch.Generator` seeded once per branch instead of the global one. `generate_reference`
runs generate itself so the two can be compared token for token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from pipeline import progress
from pipeline.errors import UserError
from pipeline.numerics.sampling import SamplingSettings, choose, next_token_probs


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


def _check_finite(logits: torch.Tensor, step: int, position: int) -> None:
    # multinomial on NaN probabilities fails with an opaque message (or, for greedy,
    # argmax silently picks a NaN): stop with the positions instead.
    bad = torch.nonzero(~torch.isfinite(logits.float())).flatten()
    if bad.numel():
        raise UserError(f"step {step}: logits at position {position} are not finite for {bad.numel()} ids "
                        f"(first: {bad[:5].tolist()}): the model produced NaN/Inf; no token chosen")


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


LOGITS_TO_KEEP = {"all": 0, "last": 1}   # capture.positions -> the forward's logits_to_keep


def prefill(model: torch.nn.Module, prompt_ids: list[int], kv_cache: bool, positions: str = "all") -> Prefill:
    """The whole prompt in one pass, as step 1 of a branch.

    The logits of the positions the forward stage's capture computed (`capture.positions`:
    every position by default, logits_to_keep=0, unlike later steps): the same call as the
    capture, so the last row is the captured row bit for bit on any device. A 1-row LM-head
    matmul gave the same bits on CPU in bf16 (measured for tiny_qwen2 and gemma3_270m) but
    is not promised to: in float32 it can differ by an ulp
    on CPU (see test_capture's positions=last test), GPU GEMMs pick kernels by shape, and
    the checks compare step 1 with the capture at tolerance 0.
    """
    _check(prompt_ids)
    keep = LOGITS_TO_KEEP[positions]
    model.eval()
    ids = [int(i) for i in prompt_ids]
    with torch.inference_mode():
        if kv_cache:
            # transformers 5.24 names the cache `cache` (`past_key_values` is deprecated).
            out = model(input_ids=torch.tensor([ids], device=_device(model)), cache=None, use_cache=True,
                        logits_to_keep=keep)
        else:
            out = model(input_ids=torch.tensor([ids], device=_device(model)), use_cache=False, logits_to_keep=keep)
        # Copy the row: keeping a view would pin the whole [1, T, vocab] logits.
        logits = out.logits[0, -1].to("cpu", copy=True)
    return Prefill(tuple(ids), kv_cache, logits, out.cache if kv_cache else None)


def run_branch(
    model: torch.nn.Module,
    prompt_ids: list[int],
    settings: SamplingSettings,
    max_new_tokens: int,
    seed: int,
    kv_cache: bool,
    eos_ids: set[int],
    shared: Prefill | None = None,
    positions: str = "all",
) -> list[Step]:
    """Generate up to max_new_tokens after prompt_ids; stop early after an id in eos_ids.

    kv_cache=False re-runs the whole prefix every step (the reference path); kv_cache=True
    runs the prompt once and then feeds one token at a time with the cache. Step 1 is
    `prefill` (or `shared`, that pass done once for several branches) with the capture's
    `positions`; every later step computes the logits of the last position only
    (logits_to_keep=1, as `generate` does).
    """
    _check(prompt_ids)
    ids = [int(i) for i in prompt_ids]
    if shared is not None and (shared.kv_cache != kv_cache or list(shared.prompt_ids) != ids):
        raise ValueError(f"shared prefill (kv_cache={shared.kv_cache}, {len(shared.prompt_ids)} prompt ids) is not "
                         f"this branch's (kv_cache={kv_cache}, {len(ids)} prompt ids)")
    model.eval()
    device = _device(model)
    generator = torch.Generator().manual_seed(seed)  # CPU: replays torch.manual_seed(seed)
    steps: list[Step] = []
    cache = None
    with torch.inference_mode():
        for step in progress.bar(range(1, max_new_tokens + 1), max_new_tokens,
                                 f"decode {'kv-cache' if kv_cache else 'full-prefix'}", "token"):
            if step == 1:
                if shared is None:
                    first = prefill(model, ids, kv_cache, positions)
                    logits, cache = first.logits, first.cache
                else:   # read, never extended: this branch continues from its own copies
                    logits, cache = shared.logits.clone(), copy.deepcopy(shared.cache)
            else:
                if kv_cache:
                    out = model(input_ids=torch.tensor([ids[-1:]], device=device), cache=cache, use_cache=True,
                                logits_to_keep=1)
                    cache = out.cache
                else:
                    out = model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
                logits = out.logits[0, -1].to("cpu", copy=True)
                del out
            _check_finite(logits, step, len(ids) - 1)
            token = choose(logits, settings, generator)
            prob = float(next_token_probs(logits, settings)[token])
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


def generate_reference(
    model: torch.nn.Module,
    prompt_ids: list[int],
    settings: SamplingSettings,
    max_new_tokens: int,
    seed: int,
    kv_cache: bool,
    eos_ids: set[int] | frozenset[int] = frozenset(),
) -> list[int]:
    """The new token ids `model.generate` produces for the same branch (for the parity check).

    Every sampling knob is passed explicitly: a None would fall back to the model's
    generation_config or to generate's global default top_k=50. top_k=0 and top_p=1.0 make
    generate add no warper, as in `run_branch`. Processors a hub generation_config may
    switch on (repetition penalty, min_p, ...) are set neutral, so only our filter applies.
    Token parity is a CPU check: on CUDA generate draws from the device's global generator.
    """
    _check(prompt_ids)
    if max_new_tokens == 0:
        return []  # generate rejects max_new_tokens=0
    model.eval()
    eos = sorted(int(i) for i in eos_ids)
    knobs: dict = {"do_sample": not settings.is_greedy}
    if not settings.is_greedy:
        knobs.update(
            temperature=float(settings.temperature), top_k=int(settings.top_k), top_p=float(settings.top_p)
        )
    neutral = dict(
        repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0, min_new_tokens=None, min_p=None,
        typical_p=1.0, top_h=None, epsilon_cutoff=0.0, eta_cutoff=0.0, bad_words_ids=None,
        suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None,
    )  # fmt: skip
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
            **knobs,
            **neutral,
        )
    return [int(t) for t in out[0, input_ids.shape[1] :]]
