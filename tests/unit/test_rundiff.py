"""`nexttoken diff` of runs on different prompts (issue 13, item 8): the last prompt positions are
aligned, so the next-token distributions are compared, and the diff says the prompts differ.

Hand-built artifacts: A's prompt has 5 tokens, B's 3; each run stores logits at every position and
probabilities and a filter at the last one (probs.positions = [-1], the default).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store import paths
from pipeline.tools import rundiff

V = 4


def test_prompts_pair_by_id_and_the_rest_are_named(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, pids in ((a, ("x", "y")), (b, ("y", "z"))):
        for pid in pids:
            _run(root, [1, 2], [0.0, 1.0, 2.0, 3.0], kept=1, pid=pid)
    assert rundiff.prompt_pairs(a, b) == ([("y", "y")], ["prompt x: only in A", "prompt z: only in B"])


def _run(root: Path, ids: list[int], last_logits: list[float], kept: int, pid: str = "q") -> Path:
    n = len(ids)
    for item in (paths.TOKENS, paths.LOGITS, paths.TABLE, paths.PROBS_SUMMARY):
        paths.partition(item, pid, root).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"position": list(range(n)), "token_id": ids}), paths.partition(paths.TOKENS, pid, root))
    logits = np.tile(np.arange(V, dtype=np.float32), (n, 1))
    logits[-1] = last_logits
    pq.write_table(pa.table({"position": np.repeat(np.arange(n), V).astype(np.int32),
                             "token_id": np.tile(np.arange(V), n).astype(np.int32),
                             "logit": logits.ravel()}), paths.partition(paths.LOGITS, pid, root))
    p = np.exp(logits[-1] - logits[-1].max())
    pq.write_table(pa.table({"position": np.full(V, n - 1, np.int32), "token_id": np.arange(V, dtype=np.int32),
                             "p_T1": p / p.sum()}), paths.partition(paths.TABLE, pid, root))
    summary = {"filters": [{"position": n - 1, "filter": "sampling", "kept_count": kept, "temperature": 1.0,
                            "top_k": 0, "top_p": 0.9, "kept_mass": 0.95}]}
    paths.partition(paths.PROBS_SUMMARY, pid, root).write_text(json.dumps(summary))
    return root


def test_different_prompts_compare_the_last_positions(tmp_path):
    a = _run(tmp_path / "a", [11, 12, 13, 14, 15], [0.0, 1.0, 2.0, 5.0], kept=2)
    b = _run(tmp_path / "b", [21, 22, 23], [0.0, 1.0, 2.5, 5.0], kept=3, pid="other")
    assert rundiff.prompt_pairs(a, b) == ([("q", "other")], [])    # one prompt each: compared whatever their ids
    out = rundiff.number_lines(a, b, "q", "other")
    text = "\n".join(out)
    assert "prompts differ (A 5 tokens, B 3)" in text and "A 4 | B 2" in text
    assert "    position 4 | 2: 0.5 (token 2: 2 | 2.5)" in out
    assert "not comparable" not in text and "no common position" not in text
    (p_line,) = [line for line in out if line.startswith("    p_T1:")]
    assert "position 4 | 2, token 2" in p_line
    assert any(line.startswith("    4 | 2, sampling: 2 (") and "| 3 (" in line and "differs" in line for line in out)


def test_the_same_prompt_compares_position_by_position(tmp_path):
    a = _run(tmp_path / "a", [11, 12, 13], [0.0, 1.0, 2.0, 5.0], kept=2)
    b = _run(tmp_path / "b", [11, 12, 13], [0.0, 1.0, 2.5, 5.0], kept=2)
    out = rundiff.number_lines(a, b, "q", "q")
    assert not any("prompts differ" in line for line in out)
    assert "    position 2: 0.5 (token 2: 2 | 2.5)" in out and "    0 at the other 2 positions" in out
    assert any(line.startswith("    2, sampling: 2 (") and "differs" not in line for line in out)


def test_shared_keys_cuts_both_to_the_keys_both_have_and_names_the_rest():
    """The audit compares an old run's metrics.json (another code's layout) on the keys both
    layouts have: a value that differs on such a key is still a difference."""
    old = {"entropy": {"T1": 1.5}, "top_p": {"kept": 3, "mass": 0.9}, "n": 2}
    new = {"top_p": {"kept": 3, "mass": 0.9, "ids": [1]}, "n": 2, "failing": "none"}
    a, b, only = rundiff.shared_keys(old, new)
    assert a == b == {"n": 2, "top_p": {"kept": 3, "mass": 0.9}}
    assert only == ["entropy", "failing", "top_p.ids"]
    changed = {**new, "top_p": {"kept": 4, "mass": 0.9}}
    a, b, _ = rundiff.shared_keys(old, changed)
    assert rundiff.json_difference(a, b) == "top_p.kept: stored 3, re-derived 4"
    assert rundiff.shared_keys([1], [1, 2]) == ([1], [1, 2], [])     # not mappings: left whole


# ---------------------------------------------------------------- sets: prompt_metrics and checks per prompt
def _checks(root: Path, rows: list[tuple]) -> None:
    """checks.parquet rows (prompt_id, name, verdict)."""
    path = paths.artifact(paths.CHECKS, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt_id": [r[0] for r in rows], "name": [r[1] for r in rows],
                             "verdict": [r[2] for r in rows]}), path)


def test_checks_key_by_prompt_and_name(tmp_path):
    from pipeline.tools import prompt_tables
    a, b = _run(tmp_path / "a", [1, 2], [0.0, 1.0, 2.0, 3.0], kept=1, pid="x"), tmp_path / "b"
    for pid in ("x", "y"):
        _run(b, [1, 2], [0.0, 1.0, 2.0, 3.0], kept=1, pid=pid)
    _checks(a, [("x", "sum", "pass"), ("x", "top1", "pass")])
    _checks(b, [("x", "sum", "pass"), ("x", "top1", "fail"), ("y", "sum", "fail"), ("y", "top1", "pass")])
    ca, cb = prompt_tables.checks(a), prompt_tables.checks(b)
    assert set(ca) == {"x"} and set(cb) == {"x", "y"}
    assert prompt_tables.check_lines(ca["x"], cb["x"]) == ["checks: 1 of 2 verdict(s) differ (A | B)",
                                                           "  top1: pass | fail"]
    assert prompt_tables.check_lines(cb["y"], cb["y"]) == ["checks: same verdicts (2 checks)"]
    assert prompt_tables.check_lines(ca["x"], None) == ["checks: no verdicts for this prompt in B"]


def _metrics(root: Path, rows: list[dict]) -> None:
    path = paths.artifact(paths.PROBS_PROMPT_METRICS, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_prompt_metrics_rows_are_matched_by_prompt_and_temperature(tmp_path):
    from pipeline.tools import prompt_tables
    item = paths.PROBS_PROMPT_METRICS
    row = lambda pid, t, e, k: {"prompt_id": pid, "temperature": t, "entropy": e, "sampling_kept": k}
    # B lists its rows in another order: rows are matched on (prompt_id, temperature), not on row number
    _metrics(tmp_path / "a", [row("x", 0.5, 1.0, 1), row("x", 1.0, 2.0, 3), row("y", 1.0, 4.0, 9)])
    _metrics(tmp_path / "b", [row("y", 1.0, 4.0, 9), row("x", 1.0, 2.5, 3), row("x", 2.0, 7.0, 40),
                              row("x", 0.5, 1.0, 1)])
    ta, tb = (prompt_tables.prompt_metrics(tmp_path / r, item) for r in ("a", "b"))
    assert prompt_tables.metric_lines(item, ta["x"], tb["x"]) == [
        "  prompt metrics (probs/prompt_metrics.parquet): 2 of 3 row(s) differ",
        "    T=1: entropy 2 | 2.5", "    T=2: only in B"]
    assert prompt_tables.metric_lines(item, ta["y"], tb["y"]) == \
        ["  prompt metrics (probs/prompt_metrics.parquet): identical (1 row(s))"]
    assert prompt_tables.prompt_metrics(tmp_path / "c", item) is None
