"""Set-level DVC metrics over hand-built prompt_metrics tables (pipeline.numerics.aggregates)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.numerics import aggregates
from pipeline.numerics.probs import run_metrics


def _fig(nats: float, kept: int) -> dict:
    """One prompt's sweep figures (`probs.sweep_metrics`: the sampling filter at its own temperature)."""
    return {"kept": kept, "mass": 0.5, "top_bits": 1.0, "entropy": nats}


def test_probs_aggregates_are_median_and_mean_of_the_prompts_sweep_figures():
    m = aggregates.probs_set_metrics([_fig(1.0, 2), _fig(2.0, 7), _fig(6.0, 30)])
    # entropies 1, 2, 6 bits (median 2, mean 3), kept 2, 7, 30 (median 7): mean for median or the
    # other way round, or another key, give other numbers
    assert m == {"entropy_median": pytest.approx(2.0), "entropy_mean": pytest.approx(3.0), "kept_median": 7}
    assert isinstance(m["kept_median"], int)
    even = aggregates.probs_set_metrics([_fig(1.0, 2), _fig(4.0, 5)])
    assert even == {"entropy_median": pytest.approx(2.5), "entropy_mean": pytest.approx(2.5), "kept_median": 3.5}


def test_the_shown_temperature_is_1_else_the_lowest():
    assert aggregates.aggregate_temperature([2.0, 1.0, 0.5]) == 1.0
    assert aggregates.aggregate_temperature([2.0, 0.7]) == 0.7


def test_run_metrics_keep_the_last_prompts_figures_and_add_the_set_keys():
    first, last = _fig(1.0, 2), {**_fig(3.0, 4), "kept": 3, "mass": 0.9, "top_bits": 1.5, "entropy": 2.25,
                                 "entropy_median": 99.0, "entropy_mean": 99.0, "kept_median": 99}  # from `build`
    m = run_metrics([first, last])
    assert list(m) == ["kept", "mass", "top_bits", "entropy", "entropy_median", "entropy_mean", "kept_median"]
    assert (m["kept"], m["mass"], m["entropy"]) == (3, 0.9, 2.25)          # the last prompt's
    assert (m["entropy_median"], m["kept_median"]) == (pytest.approx(1.625), 2.5)


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
    assert m == {"n_prompts": 4, "greedy_loop_rate": 0.5, "sample_loop_rate": 0.25, "diverge_mean": 4.5}


def test_trajectory_aggregates_never_diverging_is_0_and_missing_branches_are_left_out():
    m = aggregates.trajectory_set_metrics(pa.Table.from_pylist(
        [_run("a", "greedy", False, False, None), _run("a", "sample", False, False, 0)]))
    assert m == {"n_prompts": 1, "greedy_loop_rate": 0.0, "sample_loop_rate": 0.0, "diverge_mean": 0}
    only_greedy = aggregates.trajectory_set_metrics(pa.Table.from_pylist([_run("a", "greedy", False, True, None)]))
    assert only_greedy == {"n_prompts": 1, "greedy_loop_rate": 1.0}
