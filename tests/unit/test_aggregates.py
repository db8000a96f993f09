"""Set-level DVC metrics over hand-built prompt_metrics tables (pipeline.numerics.aggregates)."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from pipeline.numerics import aggregates
from pipeline.numerics.probs import run_metrics

LN2 = math.log(2)


def _probs(rows: list[tuple[str, float, float, int]]) -> pa.Table:
    """(prompt_id, temperature, entropy in bits, sampling kept) -> prompt_metrics.parquet's columns used."""
    return pa.Table.from_pylist([{"prompt_id": p, "temperature": t, "entropy": bits * LN2, "sampling_kept": k,
                                  "top_p_0.9_kept": 10 * k} for p, t, bits, k in rows])


def test_probs_aggregates_take_t1_median_and_mean_in_bits():
    table = _probs([("a", 0.5, 0.25, 1), ("a", 1.0, 1.0, 2), ("a", 2.0, 9.0, 400),
                    ("b", 0.5, 0.5, 1), ("b", 1.0, 2.0, 7), ("b", 2.0, 9.5, 500),
                    ("c", 0.5, 1.0, 3), ("c", 1.0, 6.0, 30), ("c", 2.0, 9.9, 600)])
    m = aggregates.probs_set_metrics(table)
    # T=1 rows only: entropies 1, 2, 6 bits (median 2, mean 3), kept 2, 7, 30 (median 7): another
    # temperature, nats instead of bits, mean for median or another filter's column all give other numbers
    assert m == {"entropy_median": pytest.approx(2.0), "entropy_mean": pytest.approx(3.0), "kept_median": 7}
    assert isinstance(m["kept_median"], int)


def test_probs_aggregates_without_t1_use_the_lowest_temperature_and_even_medians_average():
    table = _probs([("a", 0.7, 1.0, 2), ("a", 2.0, 5.0, 90), ("b", 0.7, 4.0, 5), ("b", 2.0, 6.0, 99)])
    assert aggregates.aggregate_temperature([0.7, 2.0]) == 0.7
    m = aggregates.probs_set_metrics(table)
    assert m == {"entropy_median": pytest.approx(2.5), "entropy_mean": pytest.approx(2.5), "kept_median": 3.5}


def test_run_metrics_keep_the_last_prompts_figures_and_replace_its_set_keys():
    last = {"kept": 3, "mass": 0.9, "top_bits": 1.5, "entropy": 2.25, "entropy_median": 99.0,
            "entropy_mean": 99.0, "kept_median": 99}                    # a set of one's keys, from `build`
    table = _probs([("a", 1.0, 1.0, 2), ("b", 1.0, 3.0, 4)])
    m = run_metrics(last, table)
    assert list(m) == ["kept", "mass", "top_bits", "entropy", "entropy_median", "entropy_mean", "kept_median"]
    assert (m["kept"], m["entropy"]) == (3, 2.25)
    assert (m["entropy_median"], m["kept_median"]) == (pytest.approx(2.0), 3)


def _run(pid: str, branch: str, kv: bool, loop: bool, diverge: int | None) -> dict:
    return {"prompt_id": pid, "branch": branch, "kv_cache": kv, "loop": loop, "diverge": diverge}


def test_trajectory_aggregates_count_prompts_loops_and_divergence_without_the_cache():
    rows = [_run("a", "greedy", False, True, None), _run("a", "sample", False, False, 3),
            _run("b", "greedy", False, True, None), _run("b", "sample", False, True, 0),
            _run("c", "greedy", False, False, None), _run("c", "sample", False, False, 6),
            _run("d", "greedy", False, False, None), _run("d", "sample", False, False, 0),
            # the KV-cache runs are not counted (else: greedy 4/6, sample 3/6, diverge (3+6+1+1)/4)
            _run("a", "greedy", True, True, None), _run("b", "sample", True, True, 1),
            _run("c", "greedy", True, True, None), _run("d", "sample", True, True, 1)]
    m = aggregates.trajectory_set_metrics(pa.Table.from_pylist(rows))
    # greedy loops in a, b of 4; sample in b of 4; sample left greedy at 3 (a) and 6 (c), never in b, d
    assert m == {"prompts": 4, "greedy_loop_rate": 0.5, "sample_loop_rate": 0.25, "diverge_mean": 4.5}


def test_trajectory_aggregates_never_diverging_is_0_and_missing_branches_are_left_out():
    m = aggregates.trajectory_set_metrics(pa.Table.from_pylist(
        [_run("a", "greedy", False, False, None), _run("a", "sample", False, False, 0)]))
    assert m == {"prompts": 1, "greedy_loop_rate": 0.0, "sample_loop_rate": 0.0, "diverge_mean": 0}
    only_greedy = aggregates.trajectory_set_metrics(pa.Table.from_pylist([_run("a", "greedy", False, True, None)]))
    assert only_greedy == {"prompts": 1, "greedy_loop_rate": 1.0}
