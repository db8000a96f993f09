"""Mutation score of the checks: does some `error` check catch a wrong computation?

Each mutant is one bug a real implementation could have, injected with monkeypatch into the
pipeline's own functions. The chain re-runs in this process from the first stage the bug
touches (the stages' real entry points, in a hard-linked copy of one clean tiny_qwen2 run),
then the checks stage's computation runs with the bug still in place (a bug in code the
checks share would blind them too), and at least one `error` check must fail. A mutant that
survives means a missing check.

The clean run samples with temperature 0.8, top-k 50 and top-p 0.9 so that the sampling
branch goes through every warper. Bugs that cannot change any number on this input are not
mutants here: temperature applied after top-k (the kept set is the same: dividing by T keeps
the order) and the tokenizer run without special tokens (the Qwen tokenizer adds none).

`test_mutation_score` prints the score and the killing checks (pytest shows it; run the whole
module to get it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import yaml
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pipeline.checks import stage as checks_stage
from pipeline.config import schema
from pipeline.model import capture, decode, loader, tokenization, trajectories
from pipeline.model import lens as model_lens
from pipeline.model.capture_file import CapturedLogits
from pipeline.numerics import probs, sampling
from pipeline.store import logits_io, paths
from tests.helpers.partitions import part
from tests.reliability.conftest import link_copy, one_thread, run_stage_here

SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}
INF = float("inf")


# ---------------------------------------------------------------- injecting a bug
def patch_everywhere(mp: pytest.MonkeyPatch, module, name: str, new) -> None:
    """Replace module.name, and every `from module import name` copy in pipeline/ and stages/."""
    old = getattr(module, name)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith(("pipeline.", "stages.")) and getattr(mod, name, None) is old:
            mp.setattr(mod, name, new)


def wrap(mp: pytest.MonkeyPatch, module, name: str, make: Callable[[Callable], Callable]) -> None:
    """patch_everywhere with make(original)."""
    patch_everywhere(mp, module, name, make(getattr(module, name)))


class OneMoreTopP(TopPLogitsWarper):
    """Top-p keeping the best id it should have removed as well."""

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)
        removed = (out == -INF) & (scores > -INF)
        if removed.any():
            best = torch.where(removed, scores, -INF).argmax()
            out = out.clone()
            out.view(-1)[best] = scores.view(-1)[best]
        return out


class OneFewerTopP(TopPLogitsWarper):
    """Top-p dropping its least likely kept id (when it keeps more than one)."""

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)
        kept = out > -INF
        if int(kept.sum()) > 1:
            out = out.masked_fill(torch.arange(out.numel()).view_as(out) == torch.where(kept, out, INF).argmin(), -INF)
        return out


class LowestIdsTopP(TopPLogitsWarper):
    """Top-p with the tie rule flipped: of the tie group at the cut, the lowest ids are kept."""

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)
        kept = out > -INF
        group = scores == scores[kept].min()
        n = int((kept & group).sum())
        keep = kept & ~group
        keep.view(-1)[torch.nonzero(group.view(-1)).flatten()[:n]] = True
        return scores.masked_fill(~keep, -INF)


def _warpers_with(top_p_cls=TopPLogitsWarper, k_shift: int = 0, temperature_last: bool = False):
    def build(settings):
        ws = []
        if settings.top_k:
            ws.append(TopKLogitsWarper(top_k=max(1, settings.top_k + k_shift), min_tokens_to_keep=1))
        if settings.top_p < 1.0:
            ws.append(top_p_cls(top_p=float(settings.top_p), min_tokens_to_keep=1))
        if settings.temperature != 1.0:
            ws.insert(len(ws) if temperature_last else 0, TemperatureLogitsWarper(float(settings.temperature)))
        return LogitsProcessorList(ws)
    return build


def _p64(how: Callable[[torch.Tensor, float], torch.Tensor]):
    """A row's FP64 table (`Distributions.table`, what probability_table and the probs stage read) with p64
    computed another way."""
    def make(orig):
        def table(self, t):
            return dataclasses.replace(orig(self, t), p64=how(self.row, t).double().numpy())
        return table
    return make


def _method(mp: pytest.MonkeyPatch, cls, name: str, make: Callable[[Callable], Callable]) -> None:
    mp.setattr(cls, name, make(getattr(cls, name)))


def _captured(change: Callable[[torch.nn.Module, dict], None]):
    """run_capture, then `change(model, tensors)` in place: a capture that records a wrong tensor."""
    def make(orig):
        def run(model, input_ids, spec):
            tensors = orig(model, input_ids, spec)
            with torch.no_grad():
                change(model, tensors)
            return tensors
        return run
    return make


def _no_final_norm(model, t):
    t["logits"] = model.lm_head(t[f"blocks.{len(capture.decoder_layers(model)) - 1}.resid_post"])


def _lm_head_transposed(model, t):
    w = model.lm_head.weight                                   # [V, H]; .view instead of .t()
    t["logits"] = t["final_norm_out"] @ w.view(w.shape[1], w.shape[0])


def _rope_from_one(orig):
    def fwd(model, input_ids, positions):
        n = input_ids.shape[1]
        model.forward = functools.partial(type(model).forward, model, position_ids=torch.arange(1, n + 1)[None])
        try:
            return orig(model, input_ids, positions)
        finally:
            del model.forward
    return fwd


def _kv_rope_shifted(orig):
    def step(model, ids, cache):
        if cache is None:
            return orig(model, ids, cache)
        out = model(input_ids=torch.tensor([ids[-1:]]), cache=cache, use_cache=True, logits_to_keep=1,
                    position_ids=torch.tensor([[len(ids)]]))       # should be len(ids) - 1
        return out.logits[0, -1].to("cpu", copy=True), out.cache
    return step


def _positional(index: int, value):
    def make(orig):
        def call(*args, **kwargs):
            args = list(args)
            args[index] = value
            return orig(*args, **kwargs)
        return call
    return make


def _shift_rows(orig):
    def rows(self):
        pairs = list(orig(self))
        return [(p, pairs[max(i - 1, 0)][1]) for i, (p, _) in enumerate(pairs)]
    return rows


def _previous_step_logits(orig):
    def rows(runs):
        pairs, keys = orig(runs)
        return [(p, pairs[i - 1][1] if keys[i]["step"] > 1 else r) for i, (p, r) in enumerate(pairs)], keys
    return rows


def _first_position(orig):
    def table(position, row, temperatures, dist=None):
        return orig(position, logits_io.read_position(part(paths.LOGITS, "."), 0), temperatures)
    return table


def _filter_rows_at_t1(orig):
    def rows(position, row, flt, dist, rows=True):
        out, summary = orig(position, row, flt, dist, rows)
        if rows:
            out["temperature"] = [1.0] * len(out["temperature"])
        return out, summary
    return rows


def _temperature_twice(orig):
    """prompt_metrics.parquet's figures at T * T, labelled T."""
    def table(prompt_id, position, row, temperatures, named, vocab, dist=None):
        out = orig(prompt_id, position, row, tuple(t * t for t in temperatures), named, vocab)
        return out.set_column(out.schema.get_field_index("temperature"), "temperature",
                              pa.array(sorted(temperatures), pa.float64()))     # T * T keeps the order
    return table


def _no_renormalisation(orig):
    def kept(self, settings):
        k = orig(self, settings)
        return dataclasses.replace(k, prob_after=k.prob_before)
    return kept


def _lens_without_norm(mp: pytest.MonkeyPatch) -> None:
    """Ecco's bug: the lens reads each layer's residual straight into the LM head."""
    patch_everywhere(mp, model_lens, "final_norm", lambda model, resid: resid)


def _lens_final_layer_stats(mp: pytest.MonkeyPatch) -> None:
    """TransformerLens #1076: every layer normalised with the final layer's RMS (tiny_qwen2's RMSNorm)."""
    orig = model_lens.run

    def run(model, tensors, positions, top_k):
        last = tensors[capture.act_name("resid_post", len(capture.decoder_layers(model)) - 1)]
        norm = model.get_submodule(capture.family(model).final_norm)
        scale = torch.rsqrt(last.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)

        def normed(model, resid):
            with torch.inference_mode():
                return norm.weight * (resid.float() * scale).to(resid.dtype)
        mp.setattr(model_lens, "final_norm", normed)
        return orig(model, tensors, positions, top_k)
    patch_everywhere(mp, model_lens, "run", run)


@dataclass(frozen=True)
class Mutant:
    name: str
    stages: tuple[str, ...]                    # the stages re-run: the bug's stage and those downstream of it
    apply: Callable[[pytest.MonkeyPatch], None]
    expect: tuple[str, ...] = ()               # error checks that must be among those failing


PROBS, BOTH = ("probs",), ("probs", "trajectories")
MUTANTS = [
    Mutant("piece bytes = the byte-level stand-in characters' UTF-8", ("tokenize", "forward", "logits", *BOTH, "lens"),
           lambda mp: patch_everywhere(mp, tokenization, "piece_bytes", lambda piece, byte_level: piece.encode())),
    Mutant("logits = lm_head(last resid_post): no final norm", ("forward", "logits", "probs", "lens"),
           lambda mp: wrap(mp, capture, "run_capture", _captured(_no_final_norm))),
    Mutant("LM head weight viewed [H, V] instead of transposed", ("forward", "logits", "probs", "lens"),
           lambda mp: wrap(mp, capture, "run_capture", _captured(_lm_head_transposed))),
    Mutant("RoPE positions start at 1 in the prompt pass", ("forward", "logits", "probs", "lens"),
           lambda mp: wrap(mp, capture, "_forward", _rope_from_one)),
    Mutant("logits.parquet rows shifted by one position", ("logits", "probs"),
           lambda mp: mp.setattr(CapturedLogits, "rows", _shift_rows(CapturedLogits.rows))),
    Mutant("FP64 table computed by a bf16 softmax", PROBS,
           lambda mp: _method(mp, sampling.Distributions, "table",
                              _p64(lambda x, t: torch.softmax(x.bfloat16() / t, -1)))),
    Mutant("FP64 table computed in float32", PROBS,
           lambda mp: _method(mp, sampling.Distributions, "table",
                              _p64(lambda x, t: torch.softmax(x.float() / t, -1)))),
    Mutant("table at the first position, labelled the last", PROBS,
           lambda mp: wrap(mp, probs, "position_table", _first_position)),
    Mutant("ranks off by one (0-based)", BOTH,
           lambda mp: wrap(mp, sampling, "ranks", lambda orig: lambda x: orig(x) - 1)),
    Mutant("renormalisation skipped (prob_after = prob_before)", PROBS,
           lambda mp: _method(mp, sampling.Distributions, "kept", _no_renormalisation)),
    Mutant("top-p keeps one id too many", BOTH,
           lambda mp: mp.setattr(sampling, "warpers", _warpers_with(top_p_cls=OneMoreTopP))),
    Mutant("top-p keeps one id too few", BOTH,
           lambda mp: mp.setattr(sampling, "warpers", _warpers_with(top_p_cls=OneFewerTopP))),
    Mutant("top-p tie rule flipped (lowest ids of the tie at the cut)", BOTH,
           lambda mp: mp.setattr(sampling, "warpers", _warpers_with(top_p_cls=LowestIdsTopP))),
    Mutant("temperature applied after top-p", BOTH,
           lambda mp: mp.setattr(sampling, "warpers", _warpers_with(temperature_last=True))),
    Mutant("top-k keeps k - 1", BOTH, lambda mp: mp.setattr(sampling, "warpers", _warpers_with(k_shift=-1))),
    Mutant("every filter's rows record temperature 1", PROBS,
           lambda mp: wrap(mp, probs, "filtered_rows", _filter_rows_at_t1)),
    Mutant("prompt metrics: entropy in bits (log2), labelled nats", PROBS,
           lambda mp: _method(mp, sampling.Distributions, "entropy_nats",
                              lambda orig: lambda self, t: orig(self, t) / math.log(2))),
    Mutant("prompt metrics: temperature applied twice", PROBS,
           lambda mp: wrap(mp, probs, "prompt_metrics", _temperature_twice)),
    Mutant("prompt metrics: each filter at its own temperature, not the row's", PROBS,
           lambda mp: wrap(mp, probs, "at_temperature", lambda orig: lambda flt, t: flt.settings)),
    Mutant("seed not applied to the generator", ("trajectories",),
           lambda mp: wrap(mp, trajectories, "run_branch", _positional(4, torch.Generator().initial_seed()))),
    Mutant("RoPE position off by one in the KV-cache steps", ("trajectories",),
           lambda mp: wrap(mp, decode, "next_logits", _kv_rope_shifted)),
    Mutant("greedy branch samples at T = 1", ("trajectories",),
           lambda mp: wrap(mp, trajectories, "branch_settings", lambda orig: lambda b, s: (
               sampling.SamplingSettings(1.0) if b == "greedy" else orig(b, s)))),
    Mutant("step logits recorded one step late", ("trajectories",),
           lambda mp: wrap(mp, trajectories, "step_logit_rows", _previous_step_logits)),
    Mutant("logit lens without the final norm (Ecco)", ("lens",), _lens_without_norm,
           ("lens_final_layer_exact", "lens_final_layer_kl", "lens_numpy_recompute")),
    Mutant("logit lens: the final layer's norm statistics for every layer (TransformerLens #1076)", ("lens",),
           _lens_final_layer_stats, ("lens_numpy_recompute",)),
]


# ---------------------------------------------------------------- the clean run and the runs with a bug
def run_stages(ws: Path, stages: tuple[str, ...], mp: pytest.MonkeyPatch) -> None:
    for name in stages:
        out = run_stage_here(name, ws, mp)
        assert out.code == 0, f"stage {name} failed ({out.code}): {out.stderr}"


def error_failures(ws: Path) -> list[str]:
    params = schema.read_params(ws / paths.PARAMS)
    results, _, _ = checks_stage.compute(params, paths.lookup(ws), ws)
    return [c.name for c in results if c.severity == "error" and not c.passed]


def _loaded_once(orig: Callable, weights: str) -> Callable:
    """A loader that returns the object it loaded before from the same file (a hard-linked copy
    is the same file): the mutants change no weights, and loading is most of a tiny stage's cost."""
    @functools.wraps(orig)
    def load(path, *args, **kwargs):
        key = (os.stat(Path(path) / weights).st_ino, args, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = orig(path, *args, **kwargs)
        return cache[key]
    cache: dict = {}
    return load


@pytest.fixture(scope="module", autouse=True)
def load_once():
    """Models and tokenizers loaded once; one intra-op thread (on a busy shared CPU, threads
    oversubscribe: 2-3x slower). The clean run is made here too, so its bits are this setting's."""
    with one_thread(), pytest.MonkeyPatch.context() as mp:
        wrap(mp, loader, "load_model", lambda orig: _loaded_once(orig, "model.safetensors"))
        wrap(mp, loader, "load_tokenizer", lambda orig: _loaded_once(orig, "tokenizer.json"))
        yield


@pytest.fixture(scope="module")
def clean(chain_ws, tmp_path_factory, load_once) -> Path:
    """chain_ws with the sampling branch through every warper, re-run from forward in this process."""
    for name in paths.STAGES:       # imported before any bug: a name imported during one would stay
        importlib.import_module(f"stages.{name}")
    ws = link_copy(chain_ws, tmp_path_factory.mktemp("mutants") / "clean")
    params = yaml.safe_load((ws / paths.PARAMS).read_text())
    params["sampling"].update(SAMPLING)
    (ws / paths.PARAMS).unlink()
    (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    with pytest.MonkeyPatch.context() as mp:
        run_stages(ws, ("forward", "logits", "probs", "trajectories", "lens"), mp)
    return ws


KILLS: dict[str, list[str]] = {}


def test_the_clean_run_passes_every_error_check(clean):
    assert error_failures(clean) == []


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_killed(mutant, clean, tmp_path):
    ws = link_copy(clean, tmp_path / "ws")
    with pytest.MonkeyPatch.context() as mp:
        mutant.apply(mp)
        run_stages(ws, mutant.stages, mp)
        failed = error_failures(ws)
    KILLS[mutant.name] = failed
    assert failed, f"mutant survived (no error check failed): {mutant.name}"
    assert set(mutant.expect) <= set(failed), f"{mutant.name}: {sorted(set(mutant.expect) - set(failed))} passed"


def test_mutation_score(capsys):
    if set(KILLS) != {m.name for m in MUTANTS}:
        pytest.skip("run the whole module for the score")
    killed = [m for m in MUTANTS if KILLS[m.name]]
    lines = [f"mutation score: {len(killed)}/{len(MUTANTS)} killed"] + \
        [f"  {'killed' if KILLS[m.name] else 'SURVIVED'}  {m.name}: {', '.join(KILLS[m.name]) or '-'}" for m in MUTANTS]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(MUTANTS) >= 15 and len(killed) == len(MUTANTS)
