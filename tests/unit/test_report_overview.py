"""The set report's overview rows and plot data (pipeline/report/overview.py) on hand-built tables.

Two prompts, three temperatures configured out of order, both branches with and without the KV
cache, each number distinct, so a wrong temperature, cache mode, filter, prompt or count shows.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.checks import verdicts
from pipeline.config import prompt_set
from pipeline.errors import UserError
from pipeline.report import overview, plots, set_plots

IDS = ["code_py", "zh_fact"]
TEMPS = [2.0, 1.0, 0.5]              # as configured (the overview shows T = 1, else the lowest of these)


def probs_rows() -> list[dict]:
    """probs/prompt_metrics.parquet's columns, sorted by (prompt_id, temperature) as the stage writes them."""
    rows = []
    for k, p in enumerate(IDS):
        for t in sorted(TEMPS):
            rows.append({"prompt_id": p, "position": 7 + k, "temperature": t, "entropy": 1.0 + k + t / 10,
                         "top1_id": 100 * (k + 1) + int(t * 10), "top1_text": f"tok{k}@{t:g}",
                         "top1_prob": 0.9 - k / 10 - t / 10, "sampling_kept": 151_000 + k, "sampling_mass": 1.0,
                         "top_k_2_kept": 2, "top_k_2_mass": 0.5,
                         "top_p_0.9_kept": int(10 * (k + 1) * t), "top_p_0.9_mass": 0.9})
    return pa.Table.from_pylist(rows).to_pylist()     # through Arrow, as load reads them


def run_rows() -> list[dict]:
    """trajectories/prompt_metrics.parquet rows: the KV-cache runs differ from the full-prefix ones."""
    def r(p, branch, kv, text, loop, period, diverge):
        return {"prompt_id": p, "branch": branch, "kv_cache": kv, "n_new": 8, "stop_reason": "max_new_tokens",
                "text": text, "diverge": diverge, "loop": loop, "loop_start": 3 if loop else None,
                "loop_period": period, "distinct_1": 0.5, "distinct_2": 0.5, "distinct_3": 0.5}
    return pa.Table.from_pylist([
        r("code_py", "greedy", True, "kv text", False, None, None),
        r("code_py", "greedy", False, "\n1. 1. 1. 1.", True, 2, None),
        r("code_py", "sample", False, "x", False, None, 3),
        r("code_py", "sample", True, "y", True, 1, 5),
        r("zh_fact", "greedy", False, "北京。", False, None, None),
        r("zh_fact", "greedy", True, "北京。", False, None, None),
        r("zh_fact", "sample", False, "上海", False, None, 0),
        r("zh_fact", "sample", True, "上海", False, None, 0),
    ]).to_pylist()


def manifests(temps=TEMPS, sampling_top_p=1.0) -> dict:
    return {"probs": {"config": {
        "probs": {"temperatures": list(temps), "extra_filters": [
            {"name": "top_k_2", "temperature": 1.0, "top_k": 2, "top_p": 1.0},
            {"name": "top_p_0.9", "temperature": 1.0, "top_k": 0, "top_p": 0.9}]},
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": sampling_top_p}}}}


def inputs(checks: list[dict] | None = None, **kw) -> overview.SetInputs:
    tokenize = {"code_py": {"prompt": "def fib(n):\n    return", "n_tokens": 9},
                "zh_fact": {"prompt": "中国的首都是", "n_tokens": 4}}
    return overview.SetInputs(ids=IDS, manifests=manifests(**kw), tokenize=tokenize, probs=probs_rows(),
                              runs=run_rows(), checks=checks)


def test_rows_show_t1_the_top_p_filter_and_the_full_prefix_runs():
    code, zh = overview.rows(inputs())
    assert code["temperature"] == 1.0 and zh["temperature"] == 1.0
    assert (code["top1_id"], code["top1_text"], code["top1_prob"], code["entropy"]) == (110, "tok0@1", 0.8, 1.1)
    assert (zh["top1_id"], zh["top1_prob"], zh["entropy"]) == (210, pytest.approx(0.7), 2.1)
    assert code["nucleus_filter"] == "top_p_0.9" and (code["nucleus"], zh["nucleus"]) == (10, 20)
    assert (code["greedy_text"], code["greedy_loop"], code["greedy_period"]) == ("\n1. 1. 1. 1.", True, 2)
    assert (zh["greedy_loop"], zh["greedy_period"]) == (False, None)
    assert (code["diverge"], zh["diverge"]) == (3, 0)
    assert (code["n_tokens"], zh["text"]) == (9, "中国的首都是")


def test_without_t1_the_lowest_temperature_is_shown_as_in_the_set_aggregates():
    code, _ = overview.rows(inputs(temps=[2.0, 0.5]))
    assert code["temperature"] == 0.5                    # the lowest, not the first configured
    assert (code["top1_id"], code["nucleus"]) == (105, 5)


def test_the_sampling_filter_is_the_nucleus_when_it_is_a_top_p_filter():
    code, _ = overview.rows(inputs(sampling_top_p=0.95))
    assert code["nucleus_filter"] == "sampling" and code["nucleus"] == 151_000


def test_checks_per_prompt():
    checks = [{"prompt_id": "code_py", "name": "a", "verdict": "pass"},
              {"prompt_id": "code_py", "name": "b", "verdict": "fail"},
              {"prompt_id": "zh_fact", "name": "a", "verdict": "pass"},
              {"prompt_id": None, "name": "environment", "verdict": "fail"},     # run-wide: no prompt's
              {"prompt_id": "", "name": "kernels", "verdict": "fail"}]
    assert [r["checks"] for r in overview.rows(inputs(checks))] == [(1, 1), (1, 0)]
    # as overview.load reads checks.parquet (verdicts.stored_rows)
    table = pa.Table.from_pylist([{**c, "prompt_id": c["prompt_id"] or ""} for c in checks])
    assert overview.check_counts(list(verdicts.stored_rows(table).values()), IDS) == {"code_py": (1, 1),
                                                                                     "zh_fact": (1, 0)}
    assert overview.check_counts(None, IDS) is None


def test_detailed_defaults_to_the_first_prompt_and_refuses_an_unknown_id():
    assert prompt_set.detailed(None, IDS[::-1]) == "code_py" and prompt_set.detailed("zh_fact", IDS) == "zh_fact"
    with pytest.raises(UserError) as err:
        prompt_set.detailed("nope", IDS[::-1])
    assert str(err.value) == "report.prompt_id='nope' is not allowed: null or one of the run's prompt ids: " \
                             "code_py, zh_fact"


def test_plot_data_per_temperature_ascending():
    kept = overview.by_temperature(inputs(), "top_p_0.9_kept")
    assert kept == [(0.5, [("code_py", 5), ("zh_fact", 10)]), (1.0, [("code_py", 10), ("zh_fact", 20)]),
                    (2.0, [("code_py", 20), ("zh_fact", 40)])]
    entropy = dict(overview.by_temperature(inputs(), "entropy"))
    assert entropy[0.5] == [("code_py", 1.05), ("zh_fact", 2.05)]


def test_loop_rate_per_branch_and_cache_mode():
    rates = {(r["branch"], r["kv_cache"]): (r["loops"], r["runs"], r["rate"]) for r in overview.loop_rates(run_rows())}
    assert rates == {("greedy", False): (1, 2, 0.5), ("greedy", True): (0, 2, 0.0),
                     ("sample", False): (0, 2, 0.0), ("sample", True): (1, 2, 0.5)}


def test_overview_table_has_a_line_per_prompt_and_marks_the_detail():
    md = "\n".join(overview.section(inputs(), "zh_fact", []))
    lines = [ln for ln in md.splitlines() if ln.startswith("| `")]
    assert len(lines) == 2
    assert lines[0].startswith("| `code_py` | ") and "`zh_fact` (detail below)" in lines[1]
    assert "yes, period 2" in lines[0] and "step 3" in lines[0] and "never" in lines[1]
    assert "| top-1 at T = 1 |" in md and "| top_p_0.9 kept |" in md


def test_prompt_labels_keep_chinese_and_japanese_as_text():
    font = plots.fonts()
    assert font.cjk, "the pinned CJK font package is missing"
    for text in ("中国的首都是", "日本の首都は"):
        label = set_plots.prompt_label("p", text, font)
        assert label == f"p: {text}" and "\\u" not in label


def test_set_figures_write_the_numbers_they_draw(tmp_path):
    import csv

    def out(name: str):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        return tmp_path / name
    figs = set_plots.draw(inputs(), out, plots.fonts())
    assert [f.name for f in figs] == ["set_nucleus", "set_next_token", "set_loops"]
    for f in figs:
        assert (tmp_path / f.png).read_bytes().startswith(b"\x89PNG")

    def read(name: str) -> list[dict]:
        with open(tmp_path / "plots" / name, encoding="utf-8") as fh:
            return list(csv.DictReader(fh))
    assert [(r["temperature"], r["prompt_id"], r["kept"]) for r in read("set_nucleus.csv")][:2] == \
        [("0.5", "code_py", "5"), ("0.5", "zh_fact", "10")]
    top1 = {(r["temperature"], r["prompt_id"]): float(r["top1_prob"]) for r in read("set_next_token.csv")}
    assert top1["1.0", "zh_fact"] == pytest.approx(0.7) and len(top1) == 6
    assert [(r["branch"], r["kv_cache"], r["rate"]) for r in read("set_loops.csv")] == \
        [("greedy", "False", "0.5"), ("greedy", "True", "0.0"), ("sample", "False", "0.0"), ("sample", "True", "0.5")]
    assert set_plots.draw(overview.SetInputs(["a"], {}, {}, None, None, None), out, plots.fonts()) == []


def large_inputs(n: int = 10_000, checks: bool = True) -> overview.SetInputs:
    """n prompts (hand-built, no stage run): prompt k has top-1 probability k / n at T = 1, entropy k / 1000
    nats, a nucleus of k % 97 + 1 ids, a greedy run ending in a loop when k % 4 == 0 and a sample run
    leaving greedy at step k % 5 (0: never); prompts k % 1000 == 0 fail one check."""
    ids = [f"p{k:05d}" for k in range(n)]
    probs_rows, runs, checks_rows = [], [], []
    for k, p in enumerate(ids):
        for t in sorted(TEMPS):
            probs_rows.append({"prompt_id": p, "position": 3, "temperature": t, "entropy": k / 1000 + (t != 1.0),
                               "top1_id": k, "top1_text": f"t{k}", "top1_prob": k / n, "sampling_kept": 10,
                               "sampling_mass": 1.0, "top_k_2_kept": 2, "top_k_2_mass": 0.5,
                               "top_p_0.9_kept": k % 97 + 1, "top_p_0.9_mass": 0.9})
        for branch in ("greedy", "sample"):
            runs.append({"prompt_id": p, "branch": branch, "kv_cache": False, "n_new": 8, "text": "x",
                         "diverge": None if branch == "greedy" else k % 5, "loop": k % 4 == 0,
                         "loop_start": 1, "loop_period": 1})
        checks_rows.append({"prompt_id": p, "name": "a", "verdict": "fail" if k % 1000 == 0 else "pass"})
    tokenize = {p: {"prompt": "text " + p, "n_tokens": 5 + k % 7} for k, p in enumerate(ids)}
    return overview.SetInputs(ids=ids, manifests=manifests(), tokenize=tokenize, probs=probs_rows, runs=runs,
                              checks=checks_rows if checks else None)


def test_a_set_of_10000_prompts_gets_its_distribution_in_a_short_overview():
    md = overview.section(large_inputs(), "p00042", [])
    assert len(md) < 40, len(md)                       # not 10,000 lines
    assert not [ln for ln in md if ln.startswith("| `p0")]
    text = "\n".join(md)
    assert "## Prompts of this run (10000)" in text and "more than 50" in text
    rows = {ln.split(" | ")[0].lstrip("| "): ln.split(" | ")[1:] for ln in md if ln.startswith("| ")}
    # quantiles by linear interpolation of k / n, k = 0 .. n - 1 (the q-quantile is q (n - 1) / n): min, 10%, 25%,
    # median, 75%, 90%, max
    assert rows["p(top-1) at T = 1"][:8] == ["10000", "0.000e+00", "0.1000", "0.2500", "0.5000", "0.7499", "0.8999",
                                              "0.9999 |"]
    assert rows["entropy (nats) at T = 1"][4] == "4.9995"              # median of k / 1000
    assert rows["top_p_0.9 kept"][0] == "10000" and rows["top_p_0.9 kept"][1] == "1"
    assert rows["greedy run ends in a loop"] == ["2500 of 10000 (25.0%) |"]
    assert rows["sample run leaves the greedy run"] == ["8000 of 10000 (80.0%) |"]
    assert rows["prompts with a failing check"] == ["10 of 10000 (0.1%) |"]
    failing = rows["first failing prompts"][0]
    assert failing.startswith("`p00000`, `p01000`") and "`p09000`" in failing
    assert "`p00042`" in rows["detail below"][0]


def test_a_set_of_50_keeps_one_line_per_prompt_and_51_gets_the_distribution():
    small = overview.section(large_inputs(overview.PER_PROMPT_MAX, checks=False), "p00000", [])
    assert len([ln for ln in small if ln.startswith("| `p0")]) == overview.PER_PROMPT_MAX
    large = overview.section(large_inputs(overview.PER_PROMPT_MAX + 1, checks=False), "p00000", [])
    assert not [ln for ln in large if ln.startswith("| `p0")] and "| prompts with a failing check | - |" in large


def test_a_prompt_outside_the_checks_sample_is_said_to_be_unchecked_not_clean():
    from types import SimpleNamespace

    from pipeline.report import render
    assert any("No check ran on this prompt" in line for line in render.checks(SimpleNamespace(checks=[])))
    assert any("has not run" in line for line in render.checks(SimpleNamespace(checks=None)))
    one = [{"name": "a", "what": "w", "measured": 0.0, "tolerance": 0.0, "verdict": "pass", "severity": "error"}]
    assert any(line.startswith("1 checks: 1 pass, 0 fail") for line in render.checks(SimpleNamespace(checks=one)))
