"""`nexttoken sweep` on mixed experiments (issue 13, item 7): prompt names per run, plots that draw
CJK text with the packaged font, legends beside the axes, whole titles, no warnings.

The input is a hand-built `dvc exp show --json` (DVC 3.67's layout) of eight experiments that mix
two prompts (the Chinese reference one and a custom one), temperatures, top_p, seeds and dtypes.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from pathlib import Path

import pytest
import yaml
from matplotlib.ft2font import FT2Font

from pipeline.report import plots
from pipeline.tools import sweep

REPO = Path(__file__).resolve().parents[2]
REFERENCE = yaml.safe_load((REPO / "conf/prompt/temperature_question.yaml").read_text(encoding="utf-8"))
CUSTOM = {**REFERENCE, "text": "Hello! it's (me) = 🍕, ok"}
NAMED = {**REFERENCE, "text": "问题：模型为什么会重复？", "name": "重复问题_a_prompt_name_longer_than_the_legend"}


def _exp(name: str, prompt: dict, t: float, top_p: float, seed: int = 0, dtype: str = "bfloat16") -> dict:
    entropy = 3.0 + t
    metrics = {"artifacts/probs/metrics.json": {"data": {"kept": int(100 * t * top_p) + 1, "mass": top_p,
                                                         "top_bits": 1.0 / (t or 1.0), "entropy": entropy}},
               "artifacts/trajectories/metrics.json": {"data": {"sample": "好的", "sample_loop": 0, "greedy": "好",
                                                                "greedy_loop": 1, "diverge": 2, "kv_diff": 0}},
               "artifacts/checks/metrics.json": {"data": {"checks": 40, "passed": 39, "failed_error": 0,
                                                          "failed_report": 1, "failing": "probs_fp32_sum_T2"}}}
    params = {"model": {"name": "tiny_qwen2"}, "prompt": prompt, "capture": {"dtype": dtype},
              "sampling": {"temperature": t, "top_k": 0, "top_p": top_p, "seed": seed}}
    return {"name": name, "revs": [{"rev": hashlib.sha1(name.encode()).hexdigest(),
                                    "data": {"params": {"params.yaml": {"data": params}}, "metrics": metrics}}]}


SHOWN = [{"rev": "baseline", "experiments": [
    _exp("ref-cold", REFERENCE, 0.5, 0.9), _exp("ref-warm", REFERENCE, 1.0, 0.9), _exp("ref-hot", REFERENCE, 2.0, 1.0),
    _exp("custom-cold", CUSTOM, 0.5, 0.9, seed=1), _exp("custom-hot", CUSTOM, 2.0, 1.0, seed=1),
    _exp("named", NAMED, 1.0, 0.9, dtype="float32"), _exp("named-hot", NAMED, 2.0, 1.0, dtype="float32"),
    _exp("ref-fp32", REFERENCE, 1.0, 1.0, dtype="float32")]}]


@pytest.fixture(scope="module")
def df():
    return sweep.table(sweep.experiment_rows(SHOWN))


def test_prompt_name_is_the_runs_own(df):
    names = dict(zip(df["exp"], df["prompt.name"]))
    sha = hashlib.sha256(CUSTOM["text"].encode()).hexdigest()[:8]
    assert names["ref-cold"] == "temperature_question" and names["custom-cold"] == f"hello_it_s-{sha}"
    assert names["named"] == NAMED["name"]
    # the table gives the probability the metrics give in bits
    row = df[df["exp"] == "ref-warm"].iloc[0]
    assert row[sweep.TOP] == pytest.approx(0.5) and row[sweep.TOP_AFTER] == pytest.approx(0.5 / 0.9)


@pytest.mark.parametrize("draw", [sweep.kept_plot, sweep.temperature_plot])
def test_mixed_plots_draw_without_warnings_and_keep_the_axes_clear(df, draw, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # "Glyph ... missing", "constrained_layout not applied"
        fig = draw(df, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), "the legend covers an axes"
        title = ax.title.get_window_extent(renderer)
        assert fig.bbox.x0 <= title.x0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1, "title cut"
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0, "legend cut"
    labels = [t.get_text() for t in legend.get_texts()]
    assert any("prompt=temperature_question" in t for t in labels)
    assert any("重复问题" in t for t in labels)                   # CJK as glyphs, not \\u escapes
    assert not any("\\u" in t for t in labels if "重复" in t)
    assert any("seed=1" in t for t in labels) and any("dtype=float32" in t for t in labels)


def test_packaged_cjk_font_covers_the_reference_prompt_and_is_used():
    font = plots.fonts()
    assert font.cjk == "Noto Sans CJK JP"
    text = REFERENCE["text"] + "こんにちは、カタカナ"
    assert font.covers(text.replace("\n", ""))
    assert font.drawable(text) == text                   # nothing escaped
    assert font.drawable("🍕") == "\\N{SLICE OF PIZZA}"    # what no font here draws is escaped (one escape), not boxed
    from matplotlib import font_manager as fm
    with __import__("matplotlib").rc_context(plots.rc(font)):
        path = fm.findfont(fm.FontProperties(family=font.cjk), fallback_to_default=False)
    charmap = FT2Font(path).get_charmap()
    assert all(ord(c) in charmap for c in "问题实践设置幻觉回答")


# ---------------------------------------------------------------- the metrics the sweep reads
def test_probs_metrics_give_small_probabilities_in_bits():
    import numpy as np
    import torch

    from pipeline.numerics import probs
    from pipeline.numerics.sampling import Distributions

    def sweep_metrics(row, sampling_filter):
        return probs.sweep_metrics(Distributions(torch.from_numpy(row)), sampling_filter)
    row = np.log(np.array([1.3876e-05, 1 - 1.3876e-05 - 0.5, 0.5])).astype(np.float32)   # top p = 0.5: 1 bit
    m = sweep_metrics(row, {"temperature": 1.0, "kept_count": 2, "kept_mass": 0.99998})
    assert set(m) == {"kept", "mass", "top_bits", "entropy"} and m["kept"] == 2 and m["mass"] == 0.99998
    assert m["top_bits"] == pytest.approx(1.0, abs=1e-6)
    p = np.exp(row.astype(np.float64)) / np.exp(row.astype(np.float64)).sum()
    assert m["entropy"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-6)     # nats (bits would be 1.0003)
    tiny = sweep_metrics(np.log(np.full(72064, 1 / 72064)).astype(np.float32),
                         {"temperature": 2.0, "kept_count": 1, "kept_mass": 1 / 72064})
    assert f"{tiny['top_bits']:.5g}" == "16.137"           # p = 1.3877e-05, faithful at DVC's 5 digits
    assert tiny["entropy"] == pytest.approx(math.log(72064), rel=1e-9)   # uniform: ln V nats at any T
    assert sweep_metrics(np.array([0.0, -1e9], np.float32), {"temperature": 1.0, "kept_count": 1,
                                                             "kept_mass": 1.0})["top_bits"] == 0.0   # not -0.0


def test_trajectory_metrics_text_loops_and_divergence():
    from pipeline.model import trajectories as tr
    run = lambda branch, kv, ids, text: {"branch": branch, "kv_cache": kv, "token_ids": ids, "text": text}
    summary = {"sample": run("sample", False, [5, 6, 7, 6, 7], "问题：实践中 LLM 的 temperature"),
               "sample_kv": run("sample", True, [5, 6, 7, 6, 9], "x"),
               "greedy": run("greedy", False, [5, 8, 8, 8, 8], "a\nb"),
               "greedy_kv": run("greedy", True, [5, 8, 8, 8, 8], "a\nb")}
    m = tr.sweep_metrics(summary)
    assert m == {"sample": "问题：实践…", "sample_loop": 2, "greedy": "a\\nb", "greedy_loop": 1, "diverge": 2,
                 "kv_diff": 5}
    assert tr.clip("abcdefghijklmnop", 12) == "abcdefghijk…" and tr.clip("abc", 12) == "abc"
    assert tr.sweep_metrics({"greedy": run("greedy", False, [1, 2, 3], "")})["greedy_loop"] == 0
    assert tr.first_difference([1, 2], [1, 2]) == 0
    assert tr.first_difference([1, 2], [1, 2, 3]) == 3                     # one run stopped early


def test_prompt_metrics_rows_loop_divergence_and_nulls():
    from pipeline.model import trajectories as tr

    def run(branch, kv, ids, stop="max_new_tokens"):
        return {"branch": branch, "kv_cache": kv, "token_ids": ids, "text": f"t{len(ids)}", "stop_reason": stop}
    summary = {"sample": run("sample", False, [1, 2, 3, 9, 7, 9, 7, 9, 7]),        # the "\n1. 1. 1." shape
               "sample_kv": run("sample", True, [5], "eos"),
               "greedy": run("greedy", False, [1, 2, 3, 4]),
               "greedy_kv": run("greedy", True, [5, 6, 6])}
    rows = tr.prompt_metrics("p-1", summary).to_pylist()
    assert [(r["prompt_id"], r["branch"], r["kv_cache"]) for r in rows] == \
        [("p-1", "sample", False), ("p-1", "sample", True), ("p-1", "greedy", False), ("p-1", "greedy", True)]
    sample, sample_kv, greedy, greedy_kv = rows
    assert (sample["loop"], sample["loop_start"], sample["loop_period"], sample["diverge"]) == (True, 4, 2, 4)
    assert (sample["n_new"], sample["distinct_1"], sample["distinct_2"]) == (9, 5 / 9, 5 / 8)
    assert (sample_kv["diverge"], sample_kv["stop_reason"], sample_kv["distinct_2"]) == (2, "eos", None)
    assert (greedy["loop"], greedy["loop_start"], greedy["loop_period"], greedy["diverge"]) == (False, None, None, None)
    assert (greedy_kv["loop_start"], greedy_kv["loop_period"], greedy_kv["distinct_3"]) == (2, 1, 1.0)
    alone = tr.prompt_metrics("p-1", {"sample": summary["sample"]}).to_pylist()[0]
    assert alone["diverge"] is None                                       # no greedy run to leave


def test_a_tokenize_json_without_prompt_id_is_one_line_naming_the_stage_to_rerun(tmp_path):
    """trajectories takes the prompt id the way probs does (`probs.prompt_id`): an old or empty one is refused."""
    from pipeline.errors import UserError
    from pipeline.numerics import probs
    path = tmp_path / "tokenize.json"
    path.write_text('{"prompt_id": "capital_france"}')
    assert probs.prompt_id(path) == "capital_france"
    for old in ('{"prompt_name": "old"}', '{"prompt_id": ""}'):
        path.write_text(old)
        with pytest.raises(UserError, match=r"tokenize.json records no prompt_id .*re-run `dvc repro tokenize`"):
            probs.prompt_id(path)


# ---------------------------------------------------------------- issue 27 item 4: table, baseline, points
def _baseline(name: str, t: float, top_p: float) -> dict:
    """A baseline entry of `dvc exp show --json`: the commit's own run beside its experiments."""
    own = _exp(name, REFERENCE, t, top_p)["revs"][0]
    return {"rev": own["rev"], "name": name, "data": own["data"]}


GREEDY_SWEEP = [{"rev": "workspace", "data": _baseline("x", 1.0, 0.9)["data"]},      # the workspace: left out
                {**_baseline("main", 1.0, 0.9), "experiments": [
                    _exp("greedy", REFERENCE, 0.0, 1.0), _exp("cold", REFERENCE, 0.5, 0.9),
                    _exp("warm", REFERENCE, 1.5, 0.9), _exp("hot", REFERENCE, 2.0, 0.9),
                    _exp("hot-off", REFERENCE, 2.0, 1.0)]}]


def test_the_baseline_run_is_the_tables_first_row():
    df = sweep.table(sweep.experiment_rows(GREEDY_SWEEP))
    assert list(df["exp"]) == ["main", "greedy", "cold", "warm", "hot", "hot-off"]
    assert list(df["kind"]) == ["baseline"] + ["experiment"] * 5
    assert df.loc[0, "rev"] == GREEDY_SWEEP[1]["rev"] and df.loc[0, sweep.KEPT] == 91


def test_sweep_prints_the_table(tmp_path, monkeypatch, capsys):
    from pipeline.tools import cli
    monkeypatch.setattr(sweep, "exp_show", lambda repo: GREEDY_SWEEP)
    monkeypatch.setattr(sweep, "experiment_figures", lambda repo, row, skipped: {})   # no DVC cache here
    monkeypatch.chdir(tmp_path)
    assert cli.main(["sweep", "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[0].split()
    assert head[:4] == ["exp", "kind", "temperature", "top_p"] and "kept" in head and "top_prob" in head
    rows = {line.split()[0]: line.split() for line in lines[1:7]}
    assert list(rows) == ["main", "greedy", "cold", "warm", "hot", "hot-off"]
    assert rows["main"][1] == "baseline" and rows["cold"][1:4] == ["experiment", "0.5", "0.9"]
    assert rows["cold"][head.index("kept")] == "46" and rows["warm"][head.index("top_prob")] == "0.63"
    assert lines[7].startswith("wrote 5 experiments and their baseline")


def test_categorical_runs_are_points_and_only_a_swept_axis_draws_a_line(tmp_path):
    df = sweep.table(sweep.experiment_rows(GREEDY_SWEEP))
    for draw in (sweep.kept_plot, sweep.temperature_plot):
        fig = draw(df, tmp_path / "plot.png")
        lines = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_linestyle() != "None"]
        points = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_linestyle() == "None"]
        star = [ln for ln in points if ln.get_label() == "baseline (main)"]
        assert star and all(ln.get_marker() == "*" for ln in star)      # the baseline: a point in every axes
        assert len(star) == len(fig.axes)
        for ln in lines:        # a line: distinct values along the swept axis, never greedy's T = 0
            xs = list(ln.get_xdata())
            assert len(xs) >= 2 and len(set(xs)) == len(xs), (ln.get_label(), xs)
            assert "greedy" not in ln.get_label() and "baseline" not in ln.get_label()
        assert any("greedy" in ln.get_label() for ln in points)
    temperature_lines = [ln for ln in fig.axes[0].get_lines() if ln.get_linestyle() != "None"]
    assert [list(ln.get_xdata()) for ln in temperature_lines] == [[0.5, 1.5, 2.0], [0.5, 1.5, 2.0]]
