"""What-if branches (issue 47 item 3): each forced branch of the session's tiny_qwen2 chain equals
`model.generate(do_sample=False)` on the prompt plus its forced token, and the checks on them fail on a
wrong branch, a wrong claim, a missing branch and a continuation decoded from the wrong prefix."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.checks import trajectory
from pipeline.config import schema
from pipeline.model import decode, loader, trajectories
from pipeline.numerics.sampling import SamplingSettings
from pipeline.store import logits_io, paths
from tests.helpers.partitions import part

GREEDY = SamplingSettings(0.0, 0, 1.0)


@pytest.fixture(scope="module")
def model(tiny_chain):
    return loader.load_model(tiny_chain / "artifacts/prepare_model", torch.bfloat16, "cpu", "eager", False)


@pytest.fixture(scope="module")
def sampling(tiny_chain) -> schema.SamplingConfig:
    return schema.load_section(schema.read_params(tiny_chain / paths.PARAMS), "sampling")


@pytest.fixture(scope="module")
def prompt_ids(tiny_chain) -> list[int]:
    return pq.read_table(part(paths.TOKENS, tiny_chain), columns=["token_id"])["token_id"].to_pylist()


@pytest.fixture(scope="module")
def steps(tiny_chain) -> list[dict]:
    return pq.read_table(part(paths.STEPS, tiny_chain)).to_pylist()


@pytest.fixture(scope="module")
def step_rows(tiny_chain) -> dict:
    return trajectory.step_logit_rows(part(paths.STEP_LOGITS, tiny_chain))


def _runs(steps: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in sorted(steps, key=lambda r: r["step"]):
        out.setdefault(r["branch"], []).append(r)
    return out


def test_each_forced_branch_equals_generate_on_the_prompt_plus_its_forced_token(model, sampling, prompt_ids, steps,
                                                                                 step_rows, tiny_chain):
    assert sampling.what_if == 4 and sampling.what_if_depth == 1        # conf/'s defaults
    assert pq.read_schema(part(paths.STEPS, tiny_chain)).names == trajectories.STEPS_SCHEMA.names
    runs = _runs([r for r in steps if r["forced_step"] is not None])
    assert sorted(runs) == [f"forced_r{r}" for r in range(2, 6)]
    assert all(r["forced_rank"] is None and r["forced_token_id"] is None for r in steps if r["forced_step"] is None)
    first = step_rows[("greedy", False, 1)]                             # the last prompt position's logits
    order = np.argsort(-first.astype(np.float64), kind="stable")
    eos = loader.eos_ids(model)
    for name, rows in runs.items():
        rank, token = rows[0]["forced_rank"], rows[0]["forced_token_id"]
        assert name == f"forced_r{rank}" and rows[0]["token_id"] == token == int(order[rank - 1])
        assert rows[0]["rank"] == rank and all(r["kv_cache"] and r["forced_step"] == 1 for r in rows)
        assert len(rows) == sampling.max_new_tokens
        ref = decode.generate_reference(model, [*prompt_ids, token], GREEDY, sampling.max_new_tokens - 1, 0,
                                        kv_cache=True, eos_ids=eos)
        assert [r["token_id"] for r in rows[1:]] == ref.ids, name        # id for id
        for r, want in zip(rows[1:], ref.logits):                        # and the logits generate computed
            assert np.array_equal(step_rows[(name, True, r["step"])], want.float().numpy()), (name, r["step"])


def _checks(model, prompt_ids, steps, step_rows, sampling) -> dict:
    eos = loader.eos_ids(model)
    out = trajectory.what_if_branches(steps, step_rows, sampling, eos) + \
        trajectory.what_if_generate(model, prompt_ids, steps, step_rows, sampling, eos, "error")
    return {c.name: c for c in out}


def test_the_what_if_checks_pass_on_the_record_and_fail_on_wrong_branches(model, sampling, prompt_ids, steps,
                                                                          step_rows):
    got = _checks(model, prompt_ids, steps, step_rows, sampling)
    assert all(c.passed for c in got.values()) and got["what_if_generate_logits"].detail == "12 steps compared"
    changed = [{**r, "token_id": r["token_id"] + 1} if (r["branch"], r["step"]) == ("forced_r3", 3) else r
               for r in steps]
    got = _checks(model, prompt_ids, changed, step_rows, sampling)
    assert got["what_if_branches"].detail == "forced_r3" and got["what_if_generate_parity"].measured == 1
    assert got["what_if_generate_parity"].detail.startswith("forced_r3: first difference at index 1")
    claim = [{**r, "forced_rank": 3} if r["branch"] == "forced_r2" else r for r in steps]   # r2's id is not rank 3
    got = _checks(model, prompt_ids, claim, step_rows, sampling)["what_if_branches"]
    assert not got.passed and got.detail.startswith("forced_r2")
    fewer = [r for r in steps if r["branch"] != "forced_r5"]
    got = _checks(model, prompt_ids, fewer, step_rows, sampling)["what_if_branches"]
    assert (got.measured, got.detail) == (1, "missing step 1 rank 5")
    bumped = {**step_rows, ("forced_r2", True, 2): step_rows[("forced_r2", True, 2)] + np.float32(0.5)}
    got = _checks(model, prompt_ids, steps, bumped, sampling)["what_if_generate_logits"]
    assert got.measured == 0.5 and not got.passed


def _recorded(runs, tokenizer, top_n) -> tuple[list[dict], dict]:
    rows, keys = trajectories.step_logit_rows(runs)
    return trajectories.steps_table(runs, tokenizer, top_n).to_pylist(), \
        {(k["branch"], k["kv_cache"], k["step"]): logits_io.widened(row) for (_, row), k in zip(rows, keys)}


def test_depth_2_forks_the_greedy_run_at_step_2_and_a_wrong_continuation_fails_generate(
        model, sampling, prompt_ids, tiny_chain, monkeypatch):
    tokenizer = loader.load_tokenizer(tiny_chain / "artifacts/prepare_model")
    deep = sampling.model_copy(update={"what_if": 2, "what_if_depth": 2})
    eos = loader.eos_ids(model)
    runs = trajectories.what_if_runs(model, prompt_ids, deep, eos)
    assert [r.branch for r in runs] == ["forced_r2", "forced_r3", "forced_s2_r2", "forced_s2_r3"]
    steps, rows = _recorded(runs, tokenizer, deep.top_n)
    greedy = decode.run_branch(model, prompt_ids, GREEDY, 2, 0, True, eos)
    for r in runs[2:]:
        assert r.steps[0].token_id == greedy[0].token_id != r.steps[1].token_id == r.forced.token_id
        assert r.forced.step == 2 and r.steps[1].prefix_len == len(prompt_ids) + 1
        ref = decode.generate_reference(model, [*prompt_ids, greedy[0].token_id, r.forced.token_id], GREEDY,
                                        deep.max_new_tokens - 2, 0, kv_cache=True, eos_ids=eos)
        assert [s.token_id for s in r.steps[2:]] == ref.ids
    got = _checks(model, prompt_ids, steps, rows, deep)
    assert all(c.passed for c in got.values()), got
    got = _checks(model, prompt_ids, steps, rows, sampling.model_copy(update={"what_if": 2}))["what_if_branches"]
    assert got.detail == "not asked for: step 2 rank 2, not asked for: step 2 rank 3"

    def forgets_the_forced_id(model, prompt_ids, before, forced, sampling, eos_ids):    # a mutant of forced_steps
        *kept, at = before
        steps = [*kept, decode.Step(at.step, at.prefix_len, forced.token_id, at.logits, at.prob, None)]
        after = decode.run_branch(model, [*prompt_ids, *(x.token_id for x in kept)], GREEDY,
                                  sampling.max_new_tokens - forced.step, sampling.seed, True, eos_ids)
        return steps + [decode.Step(x.step + forced.step, x.prefix_len + 1, x.token_id, x.logits, x.prob,
                                    x.stop_reason) for x in after]
    monkeypatch.setattr(trajectories, "forced_steps", forgets_the_forced_id)
    steps, rows = _recorded(trajectories.what_if_runs(model, prompt_ids, deep, eos), tokenizer, deep.top_n)
    got = _checks(model, prompt_ids, steps, rows, deep)
    assert got["what_if_branches"].passed          # each id is its row's argmax: only generate can tell
    assert got["what_if_generate_parity"].measured >= 1 and not got["what_if_generate_logits"].passed



def test_the_report_names_each_forced_branch_with_its_forced_id_and_rank(steps, tiny_chain):
    from types import SimpleNamespace

    from pipeline.report import render
    recorded = json.loads(part(paths.TRAJECTORIES, tiny_chain).read_text())
    inp = SimpleNamespace(manifests={}, trajectories=recorded, steps=steps, prompt_metrics=[], cite=str)
    text = "\n".join(render.trajectories(inp))
    for name, rows in _runs([r for r in steps if r["forced_step"] is not None]).items():
        f = rows[0]
        want = {"step": 1, "token_id": f["forced_token_id"], "rank": f["forced_rank"]}
        assert recorded[f"{name}_kv"]["forced"] == want
        assert f"Branch `{name}`, KV cache on: {len(rows)} new tokens" in text, name
        assert f"What if: id {f['forced_token_id']} (rank {f['forced_rank']}) forced at step 1, then greedy." in text
