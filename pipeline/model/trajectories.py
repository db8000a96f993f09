"""The trajectories stage's work: run every branch with and without the KV cache, tabulate.

Branches: `sample` (the configured temperature / top-k / top-p, a CPU generator seeded from
`sampling.seed`), `greedy` (argmax of the raw logits) and the what-if branches `forced_r{rank}` /
`forced_s2_r{rank}` (`what_if_runs`: a lower-ranked candidate forced, then greedy). The full-prefix run (no cache) is
the reference path, as in the article; the cached run is recorded so the checks stage can
compare its logits. The stage's recording (inputs through the run's ledger, the files written) is
`pipeline.record.trajectories`.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from pipeline.config.schema import SamplingConfig
from pipeline.errors import UserError, bad_value
from pipeline.model import loader
from pipeline.model.decode import Prefill, Step, prefill, run_branch
from pipeline.numerics.aggregates import trajectory_set_metrics
from pipeline.numerics.repetition import distinct_ratio, find_loop
from pipeline.numerics.sampling import SamplingSettings, next_token_probs, rank_of, top_order
from pipeline.store import logits_io, paths, provenance
from pipeline.store.artifacts import parquet_facts, read_json, read_parquet

STEPS_SCHEMA = pa.schema([
    ("branch", pa.string()), ("kv_cache", pa.bool_()), ("step", pa.int32()), ("prefix_len", pa.int32()),
    ("token_id", pa.int32()), ("piece", pa.string()), ("text_so_far", pa.string()), ("logit", pa.float32()),
    ("prob", pa.float32()), ("rank", pa.int32()), ("top_ids", pa.list_(pa.int32())),
    ("top_logits", pa.list_(pa.float32())), ("top_probs", pa.list_(pa.float32())), ("stop_reason", pa.string()),
    # what-if branches: the step whose token was forced, that token and its rank there; null on the other branches
    ("forced_step", pa.int32()), ("forced_token_id", pa.int32()), ("forced_rank", pa.int32()),
])
# One row per (prompt_id, branch, kv_cache): what a continuation did, for tables across prompts.
PROMPT_METRICS_SCHEMA = pa.schema([
    ("prompt_id", pa.string()), ("branch", pa.string()), ("kv_cache", pa.bool_()), ("n_new", pa.int32()),
    ("stop_reason", pa.string()), ("text", pa.string()), ("diverge", pa.int32()), ("loop", pa.bool_()),
    ("loop_start", pa.int32()), ("loop_period", pa.int32()), ("distinct_1", pa.float64()),
    ("distinct_2", pa.float64()), ("distinct_3", pa.float64()),
])
NGRAMS = (1, 2, 3)
TEXT_COLUMNS = 12   # terminal columns of a continuation's text in the DVC metrics (`dvc exp show`)


def branch_settings(branch: str, sampling: SamplingConfig) -> SamplingSettings:
    if branch == "greedy" or branch.startswith("forced_"):
        return GREEDY
    return SamplingSettings(sampling.temperature, sampling.top_k, sampling.top_p)


GREEDY = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0)


@dataclass(frozen=True)
class Forced:
    """Where a what-if branch leaves the greedy run: the step, the id forced there and its rank (2 = the
    runner-up of that step's raw logits, ties by lower id as `top_order`)."""
    step: int
    token_id: int
    rank: int


@dataclass(frozen=True)
class Run:
    branch: str
    kv_cache: bool
    settings: SamplingSettings
    steps: list[Step]
    forced: Forced | None = None


def check_room(prompt_len: int, max_new_tokens: int, max_positions: int | None, prompt_id: str | None = None) -> None:
    """The last step feeds prompt + max_new_tokens - 1 tokens: it must fit the model's context (prompt_id:
    the set's longest prompt, named in the error)."""
    if max_positions is not None and prompt_len + max_new_tokens - 1 > max_positions:
        which = f"this {prompt_len}-token prompt" if prompt_id is None else \
            f"the set's longest prompt, id={prompt_id!r} ({prompt_len} tokens)"
        raise bad_value("sampling.max_new_tokens", max_new_tokens, f"at most {max_positions - prompt_len + 1} for "
                        f"{which} (the model's max_position_embeddings is {max_positions})")


def run_all(model, prompt_ids: list[int], sampling: SamplingConfig, eos_ids: set[int]) -> list[Run]:
    """Every (branch, kv_cache) run. The prompt pass (step 1) is done once per cache mode and
    shared by the branches; the cached and the full-prefix runs keep their own prompt passes,
    so the checks still compare two computations at step 1."""
    modes = [*sampling.kv_cache, *([True] if sampling.what_if else [])]
    shared = {kv: prefill(model, prompt_ids, kv) for kv in dict.fromkeys(modes)} \
        if sampling.max_new_tokens > 0 and (len(sampling.branches) > 1 or sampling.what_if) else {}
    runs = []
    for branch in sampling.branches:
        settings = branch_settings(branch, sampling)
        for kv in sampling.kv_cache:
            steps = run_branch(model, prompt_ids, settings, sampling.max_new_tokens, sampling.seed, kv, eos_ids,
                               shared=shared.get(kv))
            runs.append(Run(branch, kv, settings, steps))
    return runs + what_if_runs(model, prompt_ids, sampling, eos_ids, shared.get(True))


def forced_name(step: int, rank: int) -> str:
    """A what-if branch's name: `forced_r{rank}` at step 1, `forced_s{step}_r{rank}` later."""
    return f"forced_r{rank}" if step == 1 else f"forced_s{step}_r{rank}"


def what_if_runs(model, prompt_ids: list[int], sampling: SamplingConfig, eos_ids: set[int],
                 shared: Prefill | None = None) -> list[Run]:
    """The what-if branches (`sampling.what_if`, `what_if_depth`), all with the KV cache: at each step s up to
    the depth that the greedy run reaches, each of the `what_if` best ids after the greedy one (`top_order`)
    forced as token s, then greedy for the remaining `max_new_tokens - s` steps. Steps before s are the greedy
    run's (its logits rows, bit for bit); step s keeps the row the forced id was picked from. The continuation
    decodes prompt + prefix + forced id as `generate` would (one pass over them, then the cache), so the
    checks' `generate` on that prefix is the same computation, not a near one."""
    n = min(sampling.what_if_depth, sampling.max_new_tokens) if sampling.what_if else 0
    if n == 0:
        return []
    base = run_branch(model, prompt_ids, GREEDY, n, sampling.seed, True, eos_ids, shared=shared)
    runs = []
    for s, at in enumerate(base, start=1):
        for i, token in enumerate(top_order(at.logits, sampling.what_if + 1)[1:]):
            forced = Forced(s, int(token), i + 2)
            runs.append(Run(forced_name(s, forced.rank), True, GREEDY,
                            forced_steps(model, prompt_ids, base[:s], forced, sampling, eos_ids), forced))
        if at.stop_reason is not None:      # the greedy run stopped here (eos): no step after it to fork
            break
    return runs


def forced_steps(model, prompt_ids: list[int], before: list[Step], forced: Forced, sampling: SamplingConfig,
                 eos_ids: set[int]) -> list[Step]:
    """One what-if branch: the greedy steps `before` (the last one's row is where `forced` replaces the greedy
    pick), the forced step, then greedy with the KV cache from prompt + the prefix, renumbered to follow."""
    *kept, at = before
    token, max_new = forced.token_id, sampling.max_new_tokens
    stop = "eos" if token in eos_ids else "max_new_tokens" if forced.step == max_new else None
    prob = float(next_token_probs(at.logits, GREEDY)[token])
    steps = [*kept, replace(at, token_id=token, prob=prob, stop_reason=stop)]
    if stop is None:
        prefix = [*prompt_ids, *(x.token_id for x in steps)]
        after = run_branch(model, prefix, GREEDY, max_new - forced.step, sampling.seed, True, eos_ids)
        steps += [replace(x, step=x.step + forced.step) for x in after]
    return steps


def steps_table(runs: list[Run], tokenizer, top_n: int) -> pa.Table:
    rows: dict[str, list] = {name: [] for name in STEPS_SCHEMA.names}
    for r in runs:
        forced = {f"forced_{k}": getattr(r.forced, k) if r.forced else None for k in ("step", "token_id", "rank")}
        new_ids: list[int] = []
        for s in r.steps:
            new_ids.append(s.token_id)
            logits = s.logits.float()
            probs = next_token_probs(s.logits, r.settings)     # not kept in Step: 0.6 MB a step for 152k ids
            order = torch.from_numpy(top_order(s.logits, top_n))
            values = {
                "branch": r.branch, "kv_cache": r.kv_cache, "step": s.step, "prefix_len": s.prefix_len,
                "token_id": s.token_id, "piece": tokenizer.convert_ids_to_tokens(s.token_id),
                # decoded from all new ids: joining pieces would split multi-byte characters
                "text_so_far": tokenizer.decode(new_ids, skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False),
                "logit": float(logits[s.token_id]), "prob": s.prob,
                "rank": rank_of(s.logits, s.token_id),
                "top_ids": order.tolist(), "top_logits": logits[order].tolist(), "top_probs": probs[order].tolist(),
                "stop_reason": s.stop_reason, **forced,
            }
            for k, v in values.items():
                rows[k].append(v)
    return pa.table(rows, schema=STEPS_SCHEMA)


def step_logit_rows(runs: list[Run]) -> tuple[list[tuple[int, torch.Tensor]], list[dict]]:
    """(position, logits row) per step and the branch/kv_cache/step keys of each."""
    rows, keys = [], []
    for r in runs:
        for s in r.steps:
            rows.append((s.prefix_len - 1, s.logits))
            keys.append({"branch": r.branch, "kv_cache": r.kv_cache, "step": s.step})
    return rows, keys


def summary(runs: list[Run], tokenizer) -> dict:
    """trajectories.json: per run its settings, ids, text, stop reason and `step_logits_sha256`, each step's
    logits row hashed (`logits_io.row_sha256`), whether step_logits.parquet stores the rows or not."""
    out = {}
    for r in runs:
        ids = [s.token_id for s in r.steps]
        out[f"{r.branch}{'_kv' if r.kv_cache else ''}"] = {
            "branch": r.branch, "kv_cache": r.kv_cache, "settings": asdict(r.settings), "token_ids": ids,
            "text": tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
            "stop_reason": r.steps[-1].stop_reason if r.steps else None,
            "step_logits_sha256": [logits_io.row_sha256(logits_io.widened(s.logits)) for s in r.steps],
            **({"forced": asdict(r.forced)} if r.forced else {}),
        }
    return out


def stored_step_logits(sampling: SamplingConfig, prompt_ids: list[str]) -> set[str]:
    """The prompts whose step_logits.parquet the stage writes (`sampling.step_logits`, `prompt_set.fixed_sample`)."""
    from pipeline.config.prompt_set import fixed_sample
    return set(fixed_sample(sampling.step_logits, prompt_ids))


def step_logits_stored(steps_path: Path) -> bool:
    """Whether the trajectories stage wrote the step_logits.parquet of the prompt whose steps.parquet this is (the
    `step_logits` fact in its metadata, `stored` or `derived`: the stage writes one or the other)."""
    said = parquet_facts(steps_path).get("step_logits")
    if said not in ("stored", "derived"):
        raise bad_value(f"{steps_path}: fact step_logits", said,
                        "stored or derived (what the trajectories stage writes)")
    return said == "stored"


def rederive_step_logits(model, prompt_ids: list[int], sampling: SamplingConfig, recorded: dict) \
        -> tuple[list[tuple[dict, int, np.ndarray]], list[str]]:
    """A prompt's step logits rows re-derived by the stage's own decoding (`run_all`, the recorded `sampling`),
    in step_logits.parquet's order and form (`logits_io.read_step_logits`), and the rows whose sha256 is not
    the one trajectories.json (`recorded`) holds, named `<run> step <n>` (empty: every row bit for bit as the
    stage computed it). Same numbers need the same kernel path: the prompt's recorded `cpu_kernels`."""
    rows, keys = step_logit_rows(run_all(model, prompt_ids, sampling, loader.eos_ids(model)))
    out, differ = [], []
    for (position, row), key in zip(rows, keys):
        values = logits_io.widened(row)
        name = f"{key['branch']}{'_kv' if key['kv_cache'] else ''}"
        hashes = (recorded.get(name) or {}).get("step_logits_sha256") or []
        if key["step"] > len(hashes) or hashes[key["step"] - 1] != logits_io.row_sha256(values):
            differ.append(f"{name} step {key['step']}")
        out.append((key, position, values))
    expected = sum(len(v.get("step_logits_sha256") or []) for v in recorded.values())
    if expected != len(out):
        differ.append(f"{len(out)} rows re-derived, {expected} recorded")
    return out, differ


def sweep_metrics(summary_by_run: dict) -> dict:
    """What a sweep compares, as DVC metrics with short flat keys (`dvc exp show` columns), from the
    reference path (no cache): per branch its text (`sample`, `greedy`: escaped, clipped to
    TEXT_COLUMNS terminal columns; the ids are in steps.parquet) and `<branch>_loop` (the period of
    the loop its ids end in, `pipeline.numerics.repetition.find_loop`, 0 for none; its start and the
    other per-run numbers are in prompt_metrics.parquet); `diverge`, the first step where `sample` left the
    greedy path; `kv_diff`, the first step where a KV-cache run chose another id than the full
    prefix (steps count from 1; 0 for never)."""
    ref = {v["branch"]: v for v in summary_by_run.values() if not v["kv_cache"]}
    cached = {v["branch"]: v["token_ids"] for v in summary_by_run.values() if v["kv_cache"]}
    out: dict = {}
    for branch, v in ref.items():
        out[branch] = clip(json.dumps(v["text"], ensure_ascii=False)[1:-1], TEXT_COLUMNS)
        loop = find_loop(v["token_ids"])
        out[f"{branch}_loop"] = loop.period if loop else 0
    if "sample" in ref and "greedy" in ref:
        out["diverge"] = first_difference(ref["sample"]["token_ids"], ref["greedy"]["token_ids"])
    steps = [first_difference(ref[b]["token_ids"], ids) for b, ids in cached.items() if b in ref]
    out["kv_diff"] = min((s for s in steps if s), default=0)
    return out


def clip(text: str, columns: int) -> str:
    """text cut to fit `columns` terminal columns (East Asian wide characters take two), `…` marking a cut."""
    width = [2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text]
    if sum(width) <= columns:
        return text
    n, used = 0, 1                                 # the ellipsis takes one column
    while used + width[n] <= columns:
        used, n = used + width[n], n + 1
    return text[:n] + "…"


def first_difference(a: list[int], b: list[int]) -> int:
    """The 1-based step where two id sequences first differ (one ending early counts), 0 if equal."""
    return next((i + 1 for i in range(max(len(a), len(b))) if i >= min(len(a), len(b)) or a[i] != b[i]), 0)


def prompt_metrics(prompt_id: str, summary_by_run: dict) -> pa.Table:
    """One row per run of the prompt: its text, `diverge` (the first step where it left the greedy
    run with the same kv_cache setting, 0 for never; null for greedy itself or without a greedy
    run), its loop (`pipeline.numerics.repetition`: start step and period, null for none) and its
    distinct n-gram ratios (null when shorter than n)."""
    greedy = {v["kv_cache"]: v["token_ids"] for v in summary_by_run.values() if v["branch"] == "greedy"}
    rows = []
    for v in summary_by_run.values():
        ids, loop = v["token_ids"], find_loop(v["token_ids"])
        diverge = first_difference(ids, greedy[v["kv_cache"]]) \
            if v["branch"] != "greedy" and v["kv_cache"] in greedy else None
        rows.append({"prompt_id": prompt_id, "branch": v["branch"], "kv_cache": v["kv_cache"], "n_new": len(ids),
                     "stop_reason": v["stop_reason"], "text": v["text"], "diverge": diverge,
                     "loop": loop is not None, "loop_start": loop.start if loop else None,
                     "loop_period": loop.period if loop else None,
                     **{f"distinct_{n}": distinct_ratio(ids, n) for n in NGRAMS}})
    return pa.Table.from_pylist(rows, schema=PROMPT_METRICS_SCHEMA)


def step_rows(find, root: Path | str, prompt_id: str, model=None) -> list[tuple[dict, int, np.ndarray]]:
    """One prompt's step logits rows as `logits_io.read_step_logits` gives them, whether the stage stored them or
    not (`sampling.step_logits`): read from step_logits.parquet, else re-derived (`rederive_step_logits`) with the
    sampling the trajectories stage recorded, and refused in one line unless every row's sha256 is the one
    trajectories.json records. `find(item, prompt_id)`: a run's file (`paths.lookup`, StageRun.use); `model`: a
    zero-argument callable giving the model to re-derive on (None: `recorded_model`, loaded here)."""
    if step_logits_stored(find(paths.STEPS, prompt_id)):
        return logits_io.read_step_logits(find(paths.STEP_LOGITS, prompt_id))
    from pipeline.config.schema import parse
    sampling = parse(SamplingConfig, _recorded_config(find, root)["sampling"], "sampling")
    ids = read_parquet(find(paths.TOKENS, prompt_id), columns=["token_id"])["token_id"].to_pylist()
    recorded = read_json(find(paths.TRAJECTORIES, prompt_id))
    rows, differ = rederive_step_logits((model or (lambda: recorded_model(find, root)))(), ids, sampling, recorded)
    if differ:
        from pipeline import kernels
        from pipeline.store.artifacts import device_where, recorded_cpu_kernels
        then = device_where(parquet_facts(find(paths.STEPS, prompt_id)))
        if then == "cpu":
            then = f"CPU kernels {recorded_cpu_kernels(root, paths.STEPS[0], prompt_id) or 'not recorded'}"
        raise UserError(f"prompt {prompt_id!r}: its step logits are not stored (sampling.step_logits) and the rows "
                        f"re-derived here differ from the sha256 trajectories.json records ({', '.join(differ[:4])}): "
                        f"they were computed on {then}, these on CPU kernels "
                        f"{kernels.cpu_key(provenance.kernel_path())}; re-derive on "
                        "the recorded kernel path (a run made with capture.kernels=portable: in a process that calls "
                        "pipeline.kernels.pin('portable') before importing torch, as audit and verify do)")
    return rows


def recorded_model(find, root: Path | str):
    """The run's model as its trajectories stage loaded it: the recorded capture keys (dtype, device, attention)
    and trust_remote_code, from the prepared snapshot."""
    from types import SimpleNamespace
    config = _recorded_config(find, root)
    snapshot = loader.snapshot_dir(find(paths.stage_dir("prepare_model")), read_json(find(paths.SOURCE)))
    return loader.load_captured(snapshot, SimpleNamespace(**config["capture"]), config["model"]["trust_remote_code"])


def _recorded_config(find, root: Path | str) -> dict:
    """The config the run's trajectories stage recorded (its manifest, found through `find`: a stage records it)."""
    from pipeline.store.artifacts import read_manifest_once
    find(paths.manifest_path(paths.STEPS[0]))
    return read_manifest_once(paths.STEPS[0], root)["config"]


def set_files(summaries: list[tuple[str, dict]]) -> dict[tuple[str, str], Any]:
    """The stage's set-level files from each prompt's (id, trajectories.json), in the run's order: every
    prompt's rows (prompt_metrics.parquet) and metrics.json, the last prompt's sweep figures (a set of one's,
    unchanged) then the set's aggregates. The audit re-derives them with this function."""
    table = pa.concat_tables([prompt_metrics(pid, summary) for pid, summary in summaries])
    return {paths.TRAJECTORY_PROMPT_METRICS: table,
            paths.TRAJECTORIES_METRICS: {**sweep_metrics(summaries[-1][1]), **trajectory_set_metrics(table)}}

