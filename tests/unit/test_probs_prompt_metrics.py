"""prompt_metrics.parquet on hand-built logits: the probs stage's table (pipeline.numerics.probs)
against hand-computed values, and its check (pipeline.checks.prompt_metrics) passing on it and
failing on each wrong computation a real implementation could make."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.checks import next_token as pm_check
from pipeline.config.schema import FilterConfig, ProbsConfig, SamplingConfig
from pipeline.errors import UserError
from pipeline.numerics import probs
from pipeline.numerics.sampling import Distributions

INF = np.inf
TEMPS = (0.5, 1.0, 2.0)


def cfg(sampling_t: float = 1.0, extra=({"name": "top_k_2", "temperature": 1.0, "top_k": 2, "top_p": 1.0},
                                        {"name": "top_p_0.6", "temperature": 1.0, "top_k": 0, "top_p": 0.6})):
    p = ProbsConfig(positions=(-1,), temperatures=TEMPS, fp32_sum_tolerance=2e-6, fp64_sum_tolerance=1e-12, top_n=3,
                    extra_filters=tuple(FilterConfig(**f) for f in extra))
    s = SamplingConfig(temperature=sampling_t, top_k=0, top_p=1.0, seed=1, max_new_tokens=1, branches=("greedy",),
                       kv_cache=(False,), top_n=1)
    return probs.filters(p, s)


def table(row: np.ndarray, named, temps=TEMPS) -> pa.Table:
    return probs.prompt_metrics("q1", 7, row, temps, named, {i: f"t{i}" for i in range(row.size)})


def test_a_hand_computed_distribution():
    # p at T = 1 is [1/8, 3/8, 0, 4/8]: id 2 is masked (-inf)
    row = np.array([0.0, math.log(3.0), -INF, math.log(4.0)], np.float32)
    t = table(row, cfg())
    assert t.column_names == ["prompt_id", "position", "temperature", "entropy", "top1_id", "top1_text", "top1_prob",
                              "sampling_kept", "sampling_mass", "top_k_2_kept", "top_k_2_mass", "top_p_0.6_kept",
                              "top_p_0.6_mass"]
    r = {x["temperature"]: x for x in t.to_pylist()}
    assert t["temperature"].to_pylist() == [0.5, 1.0, 2.0] and set(t["prompt_id"].to_pylist()) == {"q1"}
    one = r[1.0]
    assert (one["top1_id"], one["top1_text"], one["position"]) == (3, "t3", 7)
    assert one["top1_prob"] == pytest.approx(0.5, rel=1e-6)
    assert one["entropy"] == pytest.approx(-(1 / 8 * math.log(1 / 8) + 3 / 8 * math.log(3 / 8) + 0.5 * math.log(0.5)),
                                           rel=1e-6)                                        # nats
    assert (one["sampling_kept"], one["top_k_2_kept"], one["top_p_0.6_kept"]) == (3, 2, 2)   # -inf never kept
    assert one["sampling_mass"] == pytest.approx(1.0) and one["top_k_2_mass"] == pytest.approx(7 / 8, rel=1e-6)
    # T = 0.5 squares the odds: [1, 9, 0, 16] / 26; top-p 0.6 now needs only id 3 (16/26 = 0.615)
    half = r[0.5]
    assert half["top1_prob"] == pytest.approx(16 / 26, rel=1e-6)
    assert (half["top_p_0.6_kept"], half["top_p_0.6_mass"]) == (1, pytest.approx(16 / 26, rel=1e-6))
    # T = 2 flattens them: sqrt -> [1, 1.732, 0, 2] / 4.732; top-p 0.6 keeps ids 3 and 1
    assert r[2.0]["top_p_0.6_kept"] == 2 and r[2.0]["entropy"] > one["entropy"] > half["entropy"]


def test_the_same_numbers_as_summary_json_and_filtered_parquet():
    rng = np.random.default_rng(3)
    row = torch.tensor(rng.normal(0, 3, 500)).to(torch.bfloat16).float().numpy()
    named = cfg()
    t = {r["temperature"]: r for r in table(row, named).to_pylist()}
    summary = probs.temperature_summary(7, row, Distributions(torch.from_numpy(row)), TEMPS, 1, 2e-6, 1e-12, {})
    for s in summary:
        r = t[s["temperature"]]
        assert (r["entropy"], r["top1_id"], r["top1_prob"]) == (s["entropy_nats"], s["top"][0]["token_id"],
                                                                s["top"][0]["prob"])
    for f in named:                            # at its own temperature (1.0), filtered.parquet's summary entry
        _, entry = probs.filtered_rows(7, row, f, Distributions(torch.from_numpy(row)))
        assert (t[1.0][f"{f.name}_kept"], t[1.0][f"{f.name}_mass"]) == (entry["kept_count"], entry["kept_mass"])


def test_a_greedy_sampling_filter_keeps_the_argmax_its_mass_at_t1_as_summary_json():
    row = np.array([2.0, 5.0, 5.0, 1.0], np.float32)          # a tie at the top: the lower id
    named = cfg(sampling_t=0.0)
    rows = table(row, named).to_pylist()
    _, entry = probs.filtered_rows(7, row, named[0], Distributions(torch.from_numpy(row)))
    assert {(r["top1_id"], r["sampling_kept"], r["sampling_mass"]) for r in rows} == \
        {(1, 1, entry["kept_mass"])} and entry["temperature"] == 0


def test_a_tokenize_json_without_prompt_id_is_one_clear_line(tmp_path):
    path = tmp_path / "tokenize.json"
    path.write_text('{"prompt_name": "x"}')
    with pytest.raises(UserError, match=r"records no prompt_id \(edited or corrupt\?\): re-run `dvc repro tokenize`"):
        probs.prompt_id(path)
    path.write_text('{"prompt_id": "capital_france"}')
    assert probs.prompt_id(path) == "capital_france"


# ---------------------------------------------------------------- the check
@pytest.fixture
def row() -> np.ndarray:
    rng = np.random.default_rng(11)
    r = torch.tensor(rng.normal(0, 2.5, 2000)).to(torch.bfloat16).float().numpy()
    r[[5, 9]] = r.max()            # a tie at the top
    r[17] = -INF                   # a masked id
    return r


@pytest.fixture
def vocab(tmp_path, row) -> Path:
    path = tmp_path / "vocab.parquet"
    pq.write_table(pa.table({"token_id": pa.array(range(row.size), pa.int32()),
                             "text": [f"t{i}" for i in range(row.size)]}), path)
    return path


def run_check(tmp_path: Path, t: pa.Table, row, named, vocab) -> dict:
    path = tmp_path / "prompt_metrics.parquet"
    pq.write_table(t, path)
    return {c.name: c for c in pm_check.check(path, "q1", 7, row, TEMPS, named, vocab)}


def test_the_check_passes_on_the_stage_table(tmp_path, row, vocab):
    for named in (cfg(), cfg(sampling_t=0.0)):
        got = run_check(tmp_path, table(row, named), row, named, vocab)
        assert all(c.passed for c in got.values()), got
        assert got["probs_prompt_metrics_rows"].measured == 0 and got["probs_prompt_metrics_rows"].severity == "error"


def _with(t: pa.Table, column: str, values) -> pa.Table:
    return t.set_column(t.schema.get_field_index(column), column, pa.array(values, t.schema.field(column).type))


@pytest.mark.parametrize("column, edit, failing", [
    ("top_p_0.6_kept", lambda v: [v[0], v[1] + 1, v[2]], "rows"),          # top-p keeps one id too many
    ("top_k_2_kept", lambda v: [x - 1 for x in v], "rows"),
    ("top1_id", lambda v: [10] * len(v), "rows"),
    ("temperature", lambda v: v[::-1], "rows"),                            # not sorted
    ("prompt_id", lambda v: ["other"] * len(v), "rows"),
    ("top_k_2_mass", lambda v: [x * (1 + 1e-9) for x in v], "values"),
    ("entropy", lambda v: [x / math.log(2) for x in v], "values"),          # bits instead of nats
])
def test_a_corrupted_cell_fails_its_check(tmp_path, row, vocab, column, edit, failing):
    named = cfg()
    t = table(row, named)
    got = run_check(tmp_path, _with(t, column, edit(t[column].to_pylist())), row, named, vocab)
    assert not got[f"probs_prompt_metrics_{failing}"].passed, got
    assert column in got[f"probs_prompt_metrics_{failing}"].detail


def test_a_missing_row_or_column_fails(tmp_path, row, vocab):
    named = cfg()
    t = table(row, named)
    assert not run_check(tmp_path, t.slice(0, 2), row, named, vocab)["probs_prompt_metrics_rows"].passed
    got = run_check(tmp_path, t.drop_columns(["top_p_0.6_mass"]), row, named, vocab)
    assert not got["probs_prompt_metrics_rows"].passed and not got["probs_prompt_metrics_values"].passed


# Wrong computations inside the stage's own code (a row's `Distributions`): the table they make fails the check.
def _temperature_twice(self, t):
    return ORIGINAL["p64"](self, t * t)


def _top_p_inclusive(self, settings):
    count, mass = ORIGINAL["kept_count_and_mass"](self, settings)
    if settings.top_p < 1.0:                      # the id that reaches p kept, and the next one too
        return ORIGINAL["kept_count_and_mass"](self, probs.SamplingSettings(settings.temperature, count + 1))
    return count, mass


ORIGINAL = {name: getattr(Distributions, name) for name in ("p64", "entropy_nats", "kept_count_and_mass")}


@pytest.mark.parametrize("name, wrong, failing", [
    ("p64", _temperature_twice, "values"),
    ("entropy_nats", lambda self, t: ORIGINAL["entropy_nats"](self, t) / math.log(2), "values"),
    ("kept_count_and_mass", _top_p_inclusive, "rows"),
])
def test_a_wrong_computation_in_the_stage_fails_the_check(tmp_path, row, vocab, monkeypatch, name, wrong, failing):
    named = cfg()
    assert all(c.passed for c in run_check(tmp_path, table(row, named), row, named, vocab).values())
    monkeypatch.setattr(Distributions, name, wrong)
    got = run_check(tmp_path, table(row, named), row, named, vocab)
    assert not got[f"probs_prompt_metrics_{failing}"].passed, got
