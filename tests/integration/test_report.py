"""The report stage on tiny_qwen2: its tables carry the artifacts' numbers, its figures exist.

One module workspace (a copy of the session's tiny workspace, the chain run to
trajectories, plus a hand-written checks.parquet in the checks stage's schema) runs the
report once; tests re-read the artifacts and find the same numbers in report.md.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from pipeline.numerics.repetition import has_no_loop, is_loop
from pipeline.report import markdown, plots, render
from pipeline.store import logits_io, paths
from tests.conftest import CHAIN, REPO, copy_ws, run_module
from tests.helpers.partitions import part

CHECKS_SCHEMA = pa.schema([("prompt_id", pa.string()), ("name", pa.string()), ("what", pa.string()),
                           ("measured", pa.float64()),
                           ("tolerance", pa.float64()), ("verdict", pa.string()), ("severity", pa.string()),
                           ("detail", pa.string())])
CHECKS = [
    {"name": "lm_head_recompute", "what": "lm_head(final_norm_out) vs logits", "measured": 0.0, "tolerance": 0.0,
     "verdict": "pass", "severity": "error", "detail": "max |diff| over every position"},
    {"name": "fp32_sum_T1", "what": "|sum(p_fp32) - 1| at T=1", "measured": 2.85e-05, "tolerance": 2e-06,
     "verdict": "fail", "severity": "report", "detail": "FP32 accumulation, as in the article"},
    {"name": "kv_cache_parity", "what": "max |logit diff| per step", "measured": float("nan"), "tolerance": 0.01,
     "verdict": "pass", "severity": "report", "detail": None},
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_checks(ws: Path) -> None:
    folder = paths.stage_dir("checks", ws)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt_id": paths.run_prompt_ids(ws)[0], **c} for c in CHECKS]     # checks.parquet's layout
    pq.write_table(pa.Table.from_pylist(rows, schema=CHECKS_SCHEMA), paths.artifact(paths.CHECKS, ws))


@pytest.fixture(scope="module")
def ws(tiny_chain, tmp_path_factory) -> Path:
    ws = copy_ws(tiny_chain, tmp_path_factory.mktemp("report_ws") / "ws")
    # more steps than the article's 4 (conf/ decodes 24, the session chain TEST_STEPS): the report shows 4 of them
    run_module("pipeline.tools.cli", ws, "compose", "capture.device=cpu", "model=tiny_qwen2",
               "sampling.max_new_tokens=6", check=True)
    run_module("stages.trajectories", ws, check=True)
    run_module("stages.attribution", ws, check=True)
    _write_checks(ws)
    run_module("stages.report", ws, check=True)
    return ws


@pytest.fixture(scope="module")
def md(ws) -> str:
    return paths.artifact(paths.REPORT, ws).read_text(encoding="utf-8")


def section(md: str, number: int) -> str:
    m = re.search(rf"^## {number}\. .*?(?=^## |\Z)", md, flags=re.M | re.S)
    assert m, f"report.md has no section {number}"
    return m.group(0)


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in `text` as rows of {header: cell}."""
    out, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif block:
            head, rows = block[0], block[2:]
            out.append([dict(zip(head, r)) for r in rows])
            block = []
    return out


def unquote(cell: str) -> str:
    """The string a code() cell shows."""
    return json.loads(cell.strip("`").replace("\\|", "|"))


# ---------------------------------------------------------------- numbers
def test_top_logits_are_the_stored_ones(ws, md):
    facts = json.loads(part(paths.FORWARD_FACTS, ws).read_text())
    last = facts["logit_positions"][-1]
    logits = logits_io.read_position(part(paths.LOGITS, ws), last)
    top = np.argsort(-logits.astype(np.float64), kind="stable")[:3]
    rows = tables(section(md, 5))[0]
    assert [int(r["id"]) for r in rows] == top.tolist()
    assert [float(r["logit"]) for r in rows] == [float(logits[i]) for i in top]   # printed exactly
    assert section(md, 5).splitlines()[0].endswith(f"at position {last} (the last prompt position)")


def test_temperature_table_and_rest_match_summary(ws, md):
    summary = json.loads(part(paths.PROBS_SUMMARY, ws).read_text())
    t1 = next(t for t in summary["temperatures"] if t["temperature"] == 1.0)
    rows = tables(section(md, 6))[0]
    by_id = {r["id"]: r for r in rows}
    for cand in t1["top"]:
        assert float(by_id[str(cand["token_id"])]["T = 1"]) == pytest.approx(cand["prob"], abs=5e-5)
    assert float(by_id["rest"]["T = 1"]) == pytest.approx(t1["rest"], abs=5e-5)
    # a row's probabilities plus rest make 1 (to the printed precision)
    assert sum(float(r["T = 1"]) for r in rows) == pytest.approx(1.0, abs=4 * 5e-5)
    sums = {r["T"]: r for r in tables(section(md, 6))[1]}
    assert float(sums["1"]["FP32 error"]) == pytest.approx(t1["sum_error_fp32"], rel=1e-3)
    assert sums["1"]["FP32 within"] == ("yes" if t1["fp32_within_tolerance"] else "**no**")


def test_next_token_table_per_temperature_is_prompt_metrics(ws, md):
    stored = pq.read_table(paths.artifact(paths.PROBS_PROMPT_METRICS, ws)).to_pylist()
    text = section(md, 6)
    assert f"Next token of prompt `{stored[0]['prompt_id']}` (position {stored[0]['position']})" in text
    shown = tables(text)[2]          # after the probabilities and the sums
    assert [r["T"] for r in shown] == [f"{r['temperature']:g}" for r in stored] == ["0.5", "1", "2"]
    for r, want in zip(shown, stored):
        assert float(r["entropy (nats)"]) == pytest.approx(want["entropy"], abs=5e-5)
        top_id, top_text = r["top-1"].split(" ", 1)
        assert (int(top_id), unquote(top_text)) == (want["top1_id"], want["top1_text"])
        assert float(r["p(top-1)"]) == pytest.approx(want["top1_prob"], abs=5e-5)      # 4 decimals
        for f in ("sampling", "top_k_2", "top_p_0.9"):
            kept, mass = re.fullmatch(r"(\d+) \(([0-9.]+)\)", r[f"`{f}`"]).groups()
            assert int(kept) == want[f"{f}_kept"] and float(mass) == pytest.approx(want[f"{f}_mass"], abs=5e-5)
    assert "source: `artifacts/probs/prompt_metrics.parquet`" in text


def test_top_p_kept_count_and_renormalised_probs(ws, md):
    filtered = pq.read_table(part(paths.FILTERED, ws)).to_pandas()
    kept = filtered[filtered["filter"] == "top_p_0.9"]
    summary_rows, kept_rows = tables(section(md, 7))[:2]
    row = next(r for r in summary_rows if r["filter"] == "`top_p_0.9`")
    assert int(row["kept ids"]) == len(kept) > 0
    top_k2 = [r for r in kept_rows if r["filter"] == "`top_k_2`"]
    stored = filtered[filtered["filter"] == "top_k_2"].sort_values("kept_rank")
    assert [int(r["id"]) for r in top_k2] == stored["token_id"].tolist()
    assert [float(r["p after (renormalised)"]) for r in top_k2] == pytest.approx(stored["prob_after"].tolist(),
                                                                                  abs=5e-5)


def test_trajectory_tables_show_the_stored_ids(ws, md):
    steps = pq.read_table(part(paths.STEPS, ws)).to_pandas()
    text = section(md, 8)
    blocks = tables(text)
    heads = re.findall(r"^Branch `(\w+)`, KV cache (on|off)", text, flags=re.M)
    assert len(heads) == len(blocks) - 1 == 4 + 4         # one table per run (+ conf/'s 4 what-if), then repetition
    for (branch, kv), rows in zip(heads, blocks):
        want = steps[(steps.branch == branch) & (steps.kv_cache == (kv == "on"))].sort_values("step")
        assert len(want) > render.ARTICLE_STEPS       # conf/'s max_new_tokens: the table is the article's first 4
        want = want.head(render.ARTICLE_STEPS)
        assert [int(r["id"]) for r in rows] == want["token_id"].tolist()
        assert [unquote(r["text so far"]) for r in rows] == want["text_so_far"].tolist()
    assert f"steps {render.ARTICLE_STEPS + 1}-" in text and "steps.parquet" in text
    greedy = steps[(steps.branch == "greedy") & ~steps.kv_cache].sort_values("step")
    logits = logits_io.read_position(part(paths.LOGITS, ws), 24)
    assert greedy["token_id"].iloc[0] == int(np.argmax(logits))   # greedy step 1 = argmax


def test_repetition_table_shows_each_runs_loop_and_distinct_2_from_its_ids(ws, md):
    steps = pq.read_table(part(paths.STEPS, ws)).to_pandas()
    stored = pq.read_table(paths.artifact(paths.TRAJECTORY_PROMPT_METRICS, ws)).to_pandas()
    rows = tables(section(md, 8))[-1]
    assert len(rows) == len(stored) == 4 + 4 and "prompt_metrics.parquet" in section(md, 8).split("Repetition")[1]
    for row in rows:
        kv = row["KV cache"] == "on"
        ids = steps[(steps.branch == unquote_name(row["branch"])) & (steps.kv_cache == kv)].sort_values("step")
        ids = ids["token_id"].tolist()
        want = stored[(stored.branch == unquote_name(row["branch"])) & (stored.kv_cache == kv)].iloc[0]
        assert int(row["new tokens"]) == len(ids) == want["n_new"]
        pairs = list(zip(ids, ids[1:]))                    # distinct-2 by hand, from the steps' ids
        assert row["distinct-2"] == f"{len(set(pairs)) / len(pairs):.4f}"
        if want["loop"]:
            assert (int(row["loop start"]), int(row["loop period"])) == (want["loop_start"], want["loop_period"])
            assert is_loop(ids, int(row["loop start"]), int(row["loop period"]))
        else:
            assert (row["loop start"], row["loop period"]) == ("no loop", "-") and has_no_loop(ids)


def test_repetition_cells_for_a_loop_no_loop_and_short_runs():
    base = {"stop_reason": "max_new_tokens", "diverge": None, "distinct_1": 0.5, "distinct_2": 0.25,
            "distinct_3": None}
    rows = [{**base, "branch": "greedy", "kv_cache": False, "n_new": 9, "loop": True, "loop_start": 4,
             "loop_period": 2},
            {**base, "branch": "sample", "kv_cache": True, "n_new": 2, "diverge": 1, "loop": False,
             "loop_start": None, "loop_period": None}]
    got = tables("\n".join(render.repetition(rows)))[0]
    assert [(r["loop start"], r["loop period"], r["leaves greedy at step"]) for r in got] == \
        [("4", "2", "-"), ("no loop", "-", "1")]
    assert [(r["distinct-2"], r["distinct-3"]) for r in got] == [("0.2500", "-")] * 2


def unquote_name(cell: str) -> str:
    return cell.strip("`")


def test_coordinates_are_the_captured_bf16_values(ws, md):
    capture = load_file(str(part(paths.CAPTURE, ws)))
    rows = {r["position"]: r for r in tables(section(md, 4))[0]}
    for name, column in (("embed", "embed[:4]"), ("final_norm_out", "final_norm_out[:4]")):
        values = capture[name][0, :, :4].float()
        for pos in (6, 24):
            shown = [float(v) for v in rows[str(pos)][column].split(",")]
            assert shown == values[pos].tolist()


def test_checks_table_shows_every_verdict(md):
    rows = {r["check"].strip("`"): r for r in tables(section(md, 11))[0]}     # names plainly, no JSON quotes
    assert set(rows) == {c["name"] for c in CHECKS}
    assert rows["fp32_sum_T1"]["verdict"] == "**FAIL**" and rows["fp32_sum_T1"]["severity"] == "report"
    assert rows["lm_head_recompute"]["verdict"] == "pass"
    assert rows["kv_cache_parity"]["measured"] == "-"          # NaN is shown as missing, not "nan"
    assert "3 checks: 2 pass, 1 fail (0 of severity `error`)" in section(md, 11)


def test_title_names_the_runs_prompt_and_names_are_plain(ws, md):
    tok = json.loads(part(paths.TOKENIZE_SUMMARY, ws).read_text(encoding="utf-8"))
    assert tok["prompt_name"] == "temperature_question"       # the known name of the reference text
    assert tok["prompt_id"] == "temperature_question"         # its id in a set of one (prompt_set.for_config)
    title = md.splitlines()[0]
    assert title.startswith("# Next-token report: tiny_qwen2 on prompt temperature_question (\"问题：实践中")
    rows = {r[""]: r["value"] for r in tables(section(md, 1))[0]}
    assert rows["model"] == "`tiny_qwen2`"                     # not `"tiny_qwen2"`
    assert all(r["filter"].startswith("`") and not r["filter"].startswith('`"') for r in tables(section(md, 7))[0])


def test_ties_rank_the_lower_id_first_as_duckdb_orders_them(tmp_path):
    import duckdb
    import torch

    from pipeline.numerics.sampling import rank_order
    logits = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 3.0], dtype=np.float32)
    pq.write_table(pa.table({"token_id": np.arange(6, dtype=np.int32), "logit": logits}), tmp_path / "l.parquet")
    sql = f"select token_id from '{tmp_path / 'l.parquet'}' order by logit desc, token_id limit 4"   # the README's
    assert render.top_ids(logits, 4) == [r[0] for r in duckdb.sql(sql).fetchall()] == [1, 3, 5, 2]
    assert rank_order(torch.from_numpy(logits))[:4].tolist() == [1, 3, 5, 2]


def test_shapes_follow_the_capture(ws, md):
    facts = json.loads(part(paths.FORWARD_FACTS, ws).read_text())
    rows = tables(section(md, 3))[0]
    assert rows[0]["shape"] == f"[1, {facts['n_positions']}]"
    layer_rows = [r for r in rows if r["step"].startswith("layer ")]
    assert len(layer_rows) == facts["num_layers"]
    assert rows[-2]["shape"] == str(facts["names"]["logits"]["shape"])


def test_without_the_lens_stage_the_report_says_so(ws, tmp_path):
    """A run recorded before the lens stage: section 9 says so, no heatmap, the rest as before."""
    for stage in ("prepare_model", "tokenize", *[s for s in CHAIN if s != "lens"], "checks"):
        (tmp_path / paths.ARTIFACTS).mkdir(exist_ok=True)
        (tmp_path / paths.ARTIFACTS / stage).symlink_to(paths.stage_dir(stage, ws).resolve())
    (tmp_path / paths.PARAMS).write_bytes((ws / paths.PARAMS).read_bytes())
    run_module("stages.report", tmp_path, check=True)
    md = paths.artifact(paths.REPORT, tmp_path).read_text(encoding="utf-8")
    assert "`artifacts/lens/lens` is missing: the lens stage has not run" in section(md, 9)
    assert "plots/lens.png" not in md and "3 checks: 2 pass" in section(md, 11)


def test_lens_table_at_the_last_position_and_its_heatmap_data(ws, md):
    """Section 9: one row per layer at the last position, from lens.parquet / lens_summary.parquet."""
    import pandas as pd
    text = section(md, 9)
    rows = tables(text)[0]
    lens, summary = pd.read_parquet(part(paths.LENS, ws)), pd.read_parquet(part(paths.LENS_SUMMARY, ws))
    last = int(summary.position.max())
    assert [r["layer"] for r in rows] == [str(n) for n in range(3)] and rows[0]["residual"] == "`blocks.0.resid_pre`"
    for r in rows:
        top = lens[(lens.layer == int(r["layer"])) & (lens.position == last) & (lens["rank"] == 1)].iloc[0]
        one = summary[(summary.layer == int(r["layer"])) & (summary.position == last)].iloc[0]
        assert r["lens top-1"].startswith(f"{int(top.token_id)} ") and r["its probability"] == markdown.prob(top.prob)
        assert r["rank of the final token"] == str(int(one.final_top1_rank))
    assert rows[-1]["rank of the final token"] == "1" and rows[-1]["KL(final ‖ layer) (nats)"] == "0"
    data = (paths.stage_dir("report", ws) / "plots/lens.csv").read_text().splitlines()
    assert data[0].startswith("layer,position,final_top1_id") and len(data) == 1 + len(summary)


def test_why_this_token_shows_the_stored_parts_and_input_attribution(ws, md):
    """Section 10, from logit_parts.parquet and inputs.parquet: the top-1's largest parts, its lead over the
    runner-up part by part (summing to the two logits' difference), the per-layer figure's data and the IG
    shares, each figure's CSV adding up to what the tables hold."""
    import pandas as pd
    text = section(md, 10)
    parts = pd.read_parquet(part(paths.LOGIT_PARTS, ws))
    inputs = pd.read_parquet(part(paths.INPUTS, ws))
    logits = parts.groupby("token_id")["logit"].first()
    top1, second = sorted(logits.index, key=lambda i: (-logits[i], i))[:2]
    mine, other = (parts[parts.token_id == t].set_index("component")["contribution"] for t in (top1, second))
    largest, lead, shares = tables(text)
    assert text.startswith(f"## 10. Why this token (attribution)\n\nThe logit of the top-1, {top1} ")

    def order(values) -> list:
        return values.abs().sort_values(ascending=False, kind="stable").index[:10].tolist()
    assert len(largest) == 10 and [r["component"].strip("`") for r in largest] == order(mine)
    for r in largest:
        assert float(r["contribution"]) == pytest.approx(mine[r["component"].strip("`")], rel=1e-5)
    diff = mine - other
    assert [r["component"].strip("`") for r in lead] == order(diff)
    assert f"runner-up {second} " in text and f"{diff.sum():.6g} logits" in text
    assert diff.sum() == pytest.approx(logits[top1] - logits[second], abs=2 * parts.bound.max())
    ig = inputs[inputs.method == "integrated_gradients"].set_index("source_position")["attribution"]
    assert [int(r["position"]) for r in shares] == order(ig)
    layers = pd.read_csv(paths.stage_dir("report", ws) / "plots/attribution_layers.csv")
    assert layers.contribution.sum() == pytest.approx(mine.sum(), rel=1e-12)
    assert set(layers.kind) == {"embed", "attn", "mlp"} and (layers.token_id == top1).all()
    shaded = pd.read_csv(paths.stage_dir("report", ws) / "plots/attribution_inputs.csv")
    assert shaded.source_position.tolist() == sorted(ig.index) and shaded.integrated_gradients.tolist() == \
        ig.sort_index().tolist()


def test_without_the_attribution_stage_the_report_says_so(ws):
    from pipeline.report import attribution
    absent = attribution.load(lambda *a: None, "temperature_question", ws / "nowhere")
    assert absent.startswith("`artifacts/attribution/logit_parts` is missing: the attribution stage has not run")
    assert attribution.section(absent, str, [], {}) == ["## 10. Why this token (attribution)", "", absent, ""]
    other = attribution.load(lambda *a: None, "another_prompt", ws)
    assert other.startswith("The attribution stage did not attribute prompt `another_prompt` (it attributed "
                            "`temperature_question`")


# ---------------------------------------------------------------- form
def test_every_table_cites_an_existing_artifact(ws, md):
    cited = re.findall(r"^source: (.+)$", md, flags=re.M)
    assert len(cited) == len(tables(md)) >= 12
    for line in cited:
        for path in re.findall(r"`([^`]+)`", line):
            if "*" in path:
                assert list(ws.glob(path)), path
            else:
                assert (ws / path).is_file(), path


def test_every_png_named_exists_and_is_a_real_image(ws, md):
    names = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    assert sorted(names) == ["plots/attribution_inputs.png", "plots/attribution_layers.png", "plots/cumulative.png",
                             "plots/entropy.png", "plots/lens.png", "plots/temperature_top.png"]
    folder = paths.stage_dir("report", ws)
    for name in names:
        data = (folder / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        width, height = struct.unpack(">II", data[16:24])                 # IHDR
        assert width >= 600 and height >= 200 and len(data) > 10_000, (name, width, height, len(data))
        assert b"Software" not in data and b"tIME" not in data           # nothing run-specific
    for data_file in re.findall(r"Data: `([^`]+)`", md):
        assert (folder / data_file).stat().st_size > 0


def test_plot_data_matches_the_summary(ws):
    summary = json.loads(part(paths.PROBS_SUMMARY, ws).read_text())
    folder = paths.stage_dir("report", ws) / "plots"
    configured = {t["temperature"]: t["entropy_nats"] for t in summary["temperatures"]}
    lines = (folder / "entropy_configured.csv").read_text().splitlines()
    assert lines[0] == "temperature,entropy_nats,entropy_bits"
    assert {float(a): float(b) for a, b, _ in (line.split(",") for line in lines[1:])} == configured
    # the fine-grid curve, recomputed here, passes through the configured points
    logits = logits_io.read_position(part(paths.LOGITS, ws), 24)
    for t, h in configured.items():
        assert plots.entropy_curve(logits, np.array([t]))[0] == pytest.approx(h, rel=1e-9)
    cum = (folder / "cumulative.csv").read_text().splitlines()
    assert cum[0] == "rank,log10_rank,prob,cumulative" and float(cum[-1].split(",")[3]) == pytest.approx(1.0)


def test_second_run_writes_identical_bytes(ws):
    folder = paths.stage_dir("report", ws)
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()
              and p.name != paths.MANIFEST}
    run_module("stages.report", ws, check=True)
    after = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()
             and p.name != paths.MANIFEST}
    assert set(after) == set(before) and Path("report.md") in after
    assert [n for n in before if before[n] != after[n]] == []


def test_without_checks_the_report_says_so(ws, tmp_path):
    # The other stages' folders linked in, the checks folder left out.
    for stage in ("prepare_model", "tokenize", *CHAIN):
        (tmp_path / paths.ARTIFACTS).mkdir(exist_ok=True)
        (tmp_path / paths.ARTIFACTS / stage).symlink_to(paths.stage_dir(stage, ws).resolve())
    (tmp_path / paths.PARAMS).write_bytes((ws / paths.PARAMS).read_bytes())     # report.prompt_id
    run_module("stages.report", tmp_path, check=True)
    text = section(paths.artifact(paths.REPORT, tmp_path).read_text(encoding="utf-8"), 11)
    assert "`artifacts/checks/checks.parquet` is missing" in text and not tables(text)


def test_missing_input_is_a_clear_error(tmp_path):
    (tmp_path / paths.PARAMS).write_bytes((REPO / paths.PARAMS).read_bytes())
    proc = run_module("stages.report", tmp_path)
    assert proc.returncode == 2 and "input artifacts/tokenize/tokens holds no prompt partition" in proc.stderr
    assert not paths.stage_dir("report", tmp_path).exists()


# ---------------------------------------------------------------- cells and labels
def test_code_cells_survive_markdown():
    assert render.code("a|b") == '`"a\\|b"`'
    assert render.code(" x\n") == '`" x\\n"`'
    assert render.code("x`y") == '``"x`y"``'
    assert markdown.cell("1 | 2\n3") == "1 \\| 2 3" and markdown.cell(render.code("|")) == '`"\\|"`'
    assert render.prob(0.61794) == "0.6179" and render.prob(2.5e-6) == "2.500e-06"
    assert render.shown_positions(3) == [0, 1, 2]
    assert render.shown_positions(100)[render.MAX_ROWS // 2] is None and len(render.shown_positions(100)) == 41


def test_token_labels_without_and_with_a_cjk_font():
    latin = plots.Fonts(("DejaVu Sans",), frozenset(range(32, 0x250)))
    cjk = plots.Fonts(("DejaVu Sans", "Noto Sans CJK SC"), frozenset(range(32, 0x250)) | {0x6E29, 0x5EA6})
    warm = {"text": "温度", "decodes_alone": True, "piece_bytes_hex": "e6b8a9e5baa6", "has_token": True}
    assert plots.token_label(104273, warm, latin) == '"\\u6e29\\u5ea6"\nid 104273'
    assert plots.token_label(104273, warm, cjk) == '"温度"\nid 104273'
    half = {"text": " \ufffd", "decodes_alone": False, "piece_bytes_hex": "20e5b0", "has_token": True}
    assert plots.token_label(58230, half, cjk) == "bytes 20e5b0\nid 58230"
    assert plots.token_label(151700, None, cjk) == "(no token)\nid 151700"
    assert plots.token_label(220, {"text": " ", "decodes_alone": True}, latin) == '" "\nid 220'
