"""The explorer (issue 28 item 2) in a real browser: headless Chromium from Debian, opened from file://.

At each configured temperature the page's probabilities equal table.parquet (relative 1e-12); at each
configured filter its kept set equals filtered.parquet exactly; at a setting that is not configured they
equal numpy's FP64 computation. Zero network requests, no console errors, every panel shown, a
screenshot beside the page. Mutant pages (float32 arithmetic, a softmax renormalised over the top 50
only) fail the same comparisons. The Equivalence panel (issue 30): for the float32 and batch_2 rows, KL,
top-p Jaccard and top-1 equal equivalence.parquet's row at T = 1 and the test's own numpy FP64 from
variant_logits.parquet at other temperatures; a page that swaps record and variant, or leaves the
temperature out of the variant's softmax, fails them. Skipped, with one line saying why, where Chromium
is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from pipeline.numerics.probs import prob_column
from pipeline.store import paths
from pipeline.tools import screenshot
from tests.conftest import TEST_STEPS, copy_ws, run_module
from tests.helpers import explorer_ref
from tests.helpers.inprocess import run_chain
from tests.helpers.partitions import part

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(screenshot.available() is not None,
                                 reason=f"browser tests skipped: {screenshot.available()}")]
PANELS = ("panel-conditions", "panel-tokens", "panel-next", "panel-equivalence", "panel-lens", "panel-attention",
          "panel-trajectories", "panel-checks")
# in-process and quick (no kernels subprocess, no rederive); their logits reach the page in each encoding
EQ_VARIATIONS = ["sdpa", "batch_2", "float32", "float16", "kv_cache"]


@pytest.fixture(scope="module")
def run(tiny_chain, tmp_path_factory):
    """tiny_qwen2 through equivalence (three variations), checks and report (explorer.html), in its own copy
    of the session chain."""
    ws = copy_ws(tiny_chain, tmp_path_factory.mktemp("explorer") / "ws")
    params = yaml.safe_load((ws / paths.PARAMS).read_text())
    params["equivalence"].update(variations=EQ_VARIATIONS, exact=[], rederive=None)
    (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    run_module("stages.equivalence", ws, check=True)       # its own process: it pins the kernels before torch
    run_chain(ws, ("attribution", "checks", "report"))
    return ws


@pytest.fixture(scope="module")
def driver():
    with screenshot.browser() as d:
        yield d


def _open(driver, page):
    """Open the page; every request the browser sent for it (what it sent before, its own start page, not)."""
    driver.get("about:blank")
    screenshot.requests(driver)
    driver.get_log("browser")
    driver.get(page.as_uri())
    return screenshot.requests(driver)


def _set(driver, temperature, top_k, top_p) -> dict:
    """Set the three inputs as a user's script would (value + an input event); read the contract back."""
    return driver.execute_script("""
        const [t, k, p] = arguments;
        for (const [id, v] of [["temperature", t], ["top-k", k], ["top-p", p]]) {
          const e = document.getElementById(id); e.value = String(v); e.dispatchEvent(new Event("input"));
        }
        const rows = [...document.querySelectorAll("#candidates tr[data-token-id]")];
        return {count: document.getElementById("kept-count").textContent,
                mass: document.getElementById("kept-mass").textContent,
                ids: rows.map(r => Number(r.dataset.tokenId)), probs: rows.map(r => r.dataset.prob),
                kept: rows.filter(r => r.classList.contains("kept")).map(r => Number(r.dataset.tokenId))};
    """, temperature, top_k, top_p)


_fp64 = explorer_ref.softmax64        # numpy's FP64 softmax(logits / t)
_nucleus = explorer_ref.nucleus       # numpy FP64 kept set: top-k (ties kept), the smallest prefix reaching top_p


def _last(ws):
    table = pd.read_parquet(part(paths.TABLE, ws))
    pos = table.position.max()
    return table[table.position == pos].sort_values("token_id"), pos


def test_page_is_offline_and_shows_every_panel(run, driver):
    page = run / "artifacts/report/explorer.html"
    html = page.read_text()
    assert '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'' in html
    assert "http://" not in html and "https://" not in html and "<script src" not in html
    sent = _open(driver, page)
    # the page itself, nothing else (DevTools lists the embedded data: fonts as requests too: no network)
    assert [u for u in sent if not u.startswith("data:font/woff;base64,")] == [page.as_uri()], sent
    assert screenshot.console_errors(driver) == []
    for panel in PANELS:
        assert driver.find_element("id", panel).is_displayed(), panel
    assert driver.execute_script("return document.querySelectorAll('#tokens .tok').length") == 25
    assert driver.execute_script("return document.querySelectorAll('#attention canvas').length") == 2 * 4
    # the lens grid: a header row of 25 positions, then layers 2, 1, 0 (embeddings) x 25 positions
    assert driver.execute_script("return document.querySelectorAll('#lens-grid .cell').length") == 25 + 3 * 25
    shot = page.with_name(paths.EXPLORER_SHOT[1])
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    report = (run / "artifacts/report/report.md").read_text()
    assert f"]({paths.EXPLORER[1]})" in report and f"]({paths.EXPLORER_SHOT[1]})" in report


# The page's glyphs against the fallback's, drawn on a canvas: each character's ink as a 64 x 64 bitmap.
GLYPHS_JS = """
const [chars, font] = arguments, done = arguments[arguments.length - 1];
function draw(family, ch) {
  const c = document.createElement("canvas"); c.width = c.height = 64;
  const x = c.getContext("2d"); x.font = "48px " + family; x.textBaseline = "top"; x.fillText(ch, 4, 4);
  const d = x.getImageData(0, 0, 64, 64).data, key = [];
  for (let i = 3; i < d.length; i += 4) key.push(d[i] > 127 ? 1 : 0);
  return key.join("");
}
document.fonts.load('48px "nexttoken-cjk"', chars.join("")).then(() => done({
  page: chars.map((ch) => draw(font, ch)), fallback: chars.map((ch) => draw("sans-serif", ch)),
  tokens: getComputedStyle(document.querySelector("#tokens .tok")).fontFamily}));
"""


def test_the_prompt_s_chinese_is_drawn_with_real_glyphs_on_a_machine_without_a_cjk_font(run, tmp_path):
    """A fontconfig that lists DejaVu Sans alone (no CJK font; none at all crashes Chromium's renderer): the
    fallback draws every Chinese character of the prompt as the same box, the page's embedded font draws each
    one differently, and not as the fallback does."""
    from pipeline.report import explorer_font

    fonts = tmp_path / "fonts"
    fonts.mkdir()
    shutil.copy(explorer_font.font_path("matplotlib", "mpl-data/fonts/ttf/DejaVuSans.ttf"), fonts)
    conf = tmp_path / "fonts.conf"
    conf.write_text(f'<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">\n'
                    f"<fontconfig><dir>{fonts}</dir><cachedir>{tmp_path / 'cache'}</cachedir></fontconfig>\n")
    prompt = yaml.safe_load((run / paths.PARAMS).read_text())["prompt"]["text"]
    chars = sorted({c for c in prompt if "\u4e00" <= c <= "\u9fff"})
    assert len(chars) >= 10
    with screenshot.browser(env={"FONTCONFIG_FILE": str(conf)}) as driver:
        _open(driver, run / "artifacts/report/explorer.html")
        got = driver.execute_async_script(GLYPHS_JS, chars, explorer_font.FAMILIES + ", sans-serif")
        assert screenshot.console_errors(driver) == []
    assert len(set(got["fallback"])) == 1                  # no CJK font here: one box for every character
    assert len(set(got["page"])) == len(chars)             # the page: a glyph of its own for each
    assert all(p != f and "1" in p for p, f in zip(got["page"], got["fallback"]))
    assert got["tokens"].replace('"', "").startswith("nexttoken-cjk,")       # the tokens' font: the page's own


def test_probabilities_and_kept_sets_equal_the_stored_tables(run, driver):
    _open(driver, run / "artifacts/report/explorer.html")
    table, pos = _last(run)
    filtered = pd.read_parquet(part(paths.FILTERED, run))
    summary = json.loads(part(paths.PROBS_SUMMARY, run).read_text())
    for t in summary["temperatures"]:
        got = _set(driver, t["temperature"], 0, 1)
        assert len(got["ids"]) >= 20
        ref = table.set_index("token_id")[prob_column(t["temperature"])].loc[got["ids"]].to_numpy()
        np.testing.assert_allclose(np.array(got["probs"], dtype=np.float64), ref, rtol=1e-12, atol=0)
        assert got["ids"] == table.sort_values(["rank"]).token_id.tolist()[:len(got["ids"])]
    for f in summary["filters"]:
        got = _set(driver, f["temperature"], f["top_k"], f["top_p"])
        kept = filtered[(filtered["filter"] == f["filter"]) & (filtered.position == pos)]
        assert int(got["count"]) == len(kept) == f["kept_count"]
        shown = set(got["ids"])
        assert set(got["kept"]) == set(kept.token_id) & shown
        assert float(got["mass"]) == pytest.approx(f["kept_mass"], rel=1e-12)


def test_a_setting_that_is_not_configured_equals_numpy_fp64(run, driver):
    _open(driver, run / "artifacts/report/explorer.html")
    table, _ = _last(run)
    logits = table.logit.to_numpy()
    for t, k, top_p in ((0.7, 0, 0.8), (1.3, 40, 0.95), (0.25, 3, 1.0)):
        got = _set(driver, t, k, top_p)
        p = _fp64(logits, t)
        np.testing.assert_allclose(np.array(got["probs"], dtype=np.float64), p[got["ids"]], rtol=1e-12, atol=0)
        kept = _nucleus(p, logits, k, top_p)
        assert int(got["count"]) == kept.size
        assert set(got["kept"]) == set(kept.tolist()) & set(got["ids"])
        assert float(got["mass"]) == pytest.approx(float(p[kept].sum()), rel=1e-12)


def _read(driver) -> dict:
    return driver.execute_script("""
        const text = (id) => document.getElementById(id).textContent;
        const rows = [...document.querySelectorAll("#candidates tr[data-token-id]")];
        return {count: text("kept-count"), mass: text("kept-mass"), error: text("input-error"),
                sampled: text("sampled-id"), ids: rows.map(r => Number(r.dataset.tokenId)),
                probs: rows.map(r => r.dataset.prob),
                kept: rows.filter(r => r.classList.contains("kept")).map(r => Number(r.dataset.tokenId))};
    """)


def _sample(driver, seed: int) -> dict:
    return driver.execute_script("""
        document.getElementById("seed").value = String(arguments[0]);
        document.getElementById("sample").click();
        const out = document.getElementById("sampled-id");
        return {id: out.textContent, seed: out.dataset.seed, next: document.getElementById("seed").value};
    """, str(seed))          # as text: a JSON number would round 2^64 - 1


def test_t0_is_greedy_and_invalid_input_clears_what_it_would_change(run, driver):
    """T = 0: kept count 1, the argmax id, all the mass on it. top-p 1.5 or T = -1: one line naming the value and
    what is allowed, and no count, mass, bars or drawn id left from the setting before."""
    _open(driver, run / "artifacts/report/explorer.html")
    table, _ = _last(run)
    logits = table.logit.to_numpy()
    _set(driver, 0, 0, 1)
    got = _read(driver)
    assert (got["count"], got["mass"], got["error"]) == ("1", "1", "")
    assert got["ids"][0] == int(np.argmax(logits)) and got["kept"] == [int(np.argmax(logits))]
    assert got["probs"][0] == "1" and set(got["probs"][1:]) == {"0"}
    assert _sample(driver, 5)["id"] == str(int(np.argmax(logits)))
    for t, top_p, message in ((1, 1.5, "top-p = 1.5: not allowed; a number in (0, 1]"),
                              (-1, 0.9, "temperature = -1: not allowed; a number >= 0")):
        _set(driver, 0.8, 0, 0.9)
        assert _sample(driver, 1)["id"] and _read(driver)["count"]
        _set(driver, t, 0, top_p)
        got = _read(driver)
        assert got["error"].startswith(message), got["error"]
        assert (got["count"], got["mass"], got["sampled"], got["ids"]) == ("", "", "", [])
    _set(driver, 1, 0, 1)
    assert _read(driver)["error"] == "" and len(_read(driver)["ids"]) >= 20


def test_sample_once_equals_numpy_with_the_documented_generator_and_rule(run, driver):
    """#sampled-id for a shown seed = SplitMix64(seed)'s first u, inverse CDF over the FP64 kept set in rank order
    (tests/helpers/explorer_ref.py, as docs/explorer.md states it); the seed box then moves on by one."""
    _open(driver, run / "artifacts/report/explorer.html")
    table, _ = _last(run)
    logits = table.logit.to_numpy()
    drawn = []
    for t, k, top_p in ((1.5, 0, 0.95), (0.7, 40, 0.9)):
        _set(driver, t, k, top_p)
        for seed in (0, 1, 2, 3, 20261002, 2 ** 64 - 1):
            got = _sample(driver, seed)
            assert got["seed"] == str(seed) and got["next"] == str((seed + 1) % 2 ** 64)
            assert int(got["id"]) == explorer_ref.sample_once(logits, t, k, top_p, seed), (t, k, top_p, seed)
            drawn.append(int(got["id"]))
    assert len(set(drawn)) > 2          # the draws depend on the seed: a constant pick would fail above


def _walk(driver, language: str) -> dict:
    """step -> what its section shows, in page order (a list from the page: an object's keys come back sorted)."""
    return dict(driver.execute_script("""
        const s = document.getElementById("language"); s.value = arguments[0]; s.dispatchEvent(new Event("change"));
        return [...document.querySelectorAll("section[data-step]")].map((sec) => [sec.dataset.step, {
          title: sec.querySelector("h2").textContent, explain: sec.querySelector(".explain").textContent,
          labels: [...sec.querySelectorAll("tr th")].map((t) => t.textContent),
          numbers: [...sec.querySelectorAll("[data-source]")].map((n) => [n.textContent, n.dataset.source]),
          missing: sec.querySelector("p.note")?.textContent ?? ""}]);
    """, language))


def test_the_walk_shows_each_step_with_the_run_s_numbers_and_their_files_in_both_languages(run, driver):
    """section[data-step] for every step, in order, each with a title and an explanation in English and in Chinese
    (different texts, the same numbers); every number names an artifact file of the run that exists; a few numbers
    equal the artifacts' own."""
    from pipeline.report.explorer_walk import STEPS

    _open(driver, run / "artifacts/report/explorer.html")
    en, zh = _walk(driver, "en"), _walk(driver, "zh")
    assert list(en) == list(STEPS) and list(zh) == list(STEPS)
    for step in STEPS:
        a, b = en[step], zh[step]
        assert a["title"] and a["explain"] and b["title"] and b["explain"], step
        assert a["explain"] != b["explain"] and a["labels"] != b["labels"] or not a["labels"], step
        assert a["numbers"] == b["numbers"], step
        assert a["numbers"] or a["missing"], step
        for _, source in a["numbers"]:
            assert (run / source.split(" (")[0]).is_file(), source
    table, _ = _last(run)
    tokens = pd.read_parquet(part(paths.TOKENS, run))
    assert en["tokens"]["numbers"][0][0] == str(len(tokens))
    top = table.sort_values(["rank"]).iloc[0]
    assert en["lm-head"]["numbers"][-1][0] == f"{top.logit:g} ({int(top.token_id)})"
    summary = json.loads(part(paths.PROBS_SUMMARY, run).read_text())
    kept = [n[0].split(",")[0] for n in en["filter"]["numbers"]]
    assert kept == [str(f["kept_count"]) for f in summary["filters"] if f["position"] == table.position.max()]
    assert driver.execute_script("return document.documentElement.lang") == "zh-Hans"


def test_the_layers_and_lm_head_steps_show_the_residual_norms_and_the_dot_product_that_gives_the_logit(run, driver):
    """The layers step: each captured resid_post's L2 norm at the last position (capture.safetensors, read here with
    torch); the lm-head step: the top id's row of the LM head (the snapshot's weights, loaded here with torch), and
    its FP64 dot product with final_norm_out, which equals the recorded logit within bf16 rounding."""
    import torch
    from safetensors.torch import load_file

    from pipeline.model.names import act_name
    _open(driver, run / "artifacts/report/explorer.html")
    walk = _walk(driver, "en")
    cap = load_file(str(part(paths.CAPTURE, run)))
    norms = [n for n in walk["layers"]["numbers"] if "resid_post" in n[1]]
    layers = sorted(int(k.split(".")[1]) for k in cap if k.endswith(".resid_post"))
    assert [n[1].split("(")[-1].rstrip(")") for n in norms] == [act_name("resid_post", i) for i in layers]
    for (value, _), layer in zip(norms, layers):
        want = torch.linalg.vector_norm(cap[act_name("resid_post", layer)][0, -1].double()).item()
        assert float(value) == pytest.approx(want, rel=1e-3), layer
    table, _ = _last(run)
    top = table.sort_values(["rank"]).iloc[0]
    weights = {}
    for f in sorted((run / "artifacts/prepare_model").glob("*.safetensors")):
        weights |= load_file(str(f))
    row = weights["lm_head.weight"][int(top.token_id)].double()        # tiny_qwen2: an untied head
    x = cap[act_name("final_norm_out")][0, -1].double()
    head = [n for n in walk["lm-head"]["numbers"] if "lm_head.weight" in n[1]]
    assert [n[1].split("/")[-1].split(" ")[0] for n in head] == ["model.safetensors"] * 2 or len(head) == 2
    coords = [float(c) for c in head[0][0].strip("[, …]").split(", ")]
    assert coords == pytest.approx(row[:4].tolist(), rel=1e-3)
    dot = float(head[1][0])
    assert dot == pytest.approx(torch.dot(row, x).item(), rel=1e-5)
    assert abs(dot - float(top.logit)) <= 2 ** -8 * abs(float(top.logit)) + 1e-6      # bf16: 8 significant bits


# zh mode: what may stay Latin outside the [translate="no"] names, ids, numbers and token texts (terms the Chinese
# texts use as they are, and the run's own names)
TERMS = (r"token|id|ids|logits?|[Ll]ogit lens|lens|bf16|softmax|top-[kp1]|KL|MLP|LM head|RMSNorm|FP64|KV|Q|K|V|"
         r"Jaccard|float32|"
         r"transformers|warper|NaN|error|report|max|exp")


def test_in_chinese_no_panel_text_is_left_in_english(run, driver):
    """Switch #language to zh: every visible text node outside the names and numbers ([translate="no"]: ids, token
    texts, numbers, file and variation names) is Chinese, Latin only for TERMS and the run's own branch, filter and
    variation names; the same nodes in English are English (the switch changed them), and back in English no
    Chinese is left outside the names."""
    collect = """
        const s = document.getElementById("language"); s.value = arguments[0]; s.dispatchEvent(new Event("change"));
        const out = [], w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
        while (w.nextNode()) {
          const t = w.currentNode.textContent.trim(), e = w.currentNode.parentElement;
          if (t && !e.closest('[translate="no"], script, style') && e.checkVisibility()) out.push(t);
        }
        return out;"""
    _open(driver, run / "artifacts/report/explorer.html")
    driver.execute_script("document.querySelectorAll('#why-layers tr.why-layer')[0]?.click()")   # open a layer too
    names = set(pd.read_parquet(part(paths.STEPS, run)).branch)
    names |= {f["filter"] for f in json.loads(part(paths.PROBS_SUMMARY, run).read_text())["filters"]}
    names |= set(pd.read_parquet(part(paths.EQUIVALENCE, run)).variation)
    allowed = re.compile(rf"(?<![A-Za-z_])(?:{TERMS}|{'|'.join(map(re.escape, sorted(names, key=len)[::-1]))})"
                         r"(?![A-Za-z_])")
    zh, en = driver.execute_script(collect, "zh"), driver.execute_script(collect, "en")
    english = [t for t in zh if re.search(r"[A-Za-z]{2,}", allowed.sub(" ", t))]
    assert english == [], english
    # the hover titles too: their words follow the language, their values (token texts, numbers) are left out here;
    # a number's file path ([data-source]) is a name
    titles = """
        const s = document.getElementById("language"); s.value = arguments[0]; s.dispatchEvent(new Event("change"));
        return [...document.querySelectorAll("[title]:not([data-source])")].map((e) =>
          JSON.parse(e.dataset.tipArgs || "[]").reduce((t, a) => t.split(a).join(" "), e.title));"""
    zh_titles, en_titles = driver.execute_script(titles, "zh"), driver.execute_script(titles, "en")
    assert len(zh_titles) > 100 and [t for t in zh_titles if re.search(r"[A-Za-z]{2,}", allowed.sub(" ", t))] == []
    assert sum(re.search(r"[\u4e00-\u9fff]", t) is not None for t in zh_titles) > 100
    assert not [t for t in en_titles if re.search(r"[\u4e00-\u9fff]", t)]
    assert len(zh) > 100 and sum(re.search(r"[\u4e00-\u9fff]", t) is not None for t in zh) > 100
    assert not [t for t in en if re.search(r"[\u4e00-\u9fff]", t)]


def test_the_trajectory_headings_follow_the_language_around_the_recorded_names(run, driver):
    """Each branch's heading: its recorded name as it is, the KV-cache mark, a what-if branch's forced id, rank and
    step, and whether the cached and uncached picks agree, in the page's language (English before)."""
    _open(driver, run / "artifacts/report/explorer.html")
    heads = """
        const s = document.getElementById("language"); s.value = arguments[0]; s.dispatchEvent(new Event("change"));
        return [...document.querySelectorAll("#trajectories h3")].map((e) => e.textContent);"""
    zh, en = driver.execute_script(heads, "zh"), driver.execute_script(heads, "en")
    steps = pd.read_parquet(part(paths.STEPS, run))
    first = steps.groupby(["branch", "kv_cache"], sort=False).first().reset_index()
    assert len(zh) == len(en) == len(first) and first.kv_cache.any() and first.forced_step.notna().any()
    twins = set(first.branch[first.branch.duplicated()])       # a branch run with and without the cache
    for r, z, e in zip(first.itertuples(), zh, en, strict=True):
        assert z.startswith(r.branch + ("（KV 缓存）" if r.kv_cache else "")), z
        assert e.startswith(r.branch + (" (KV cache)" if r.kv_cache else "")), e
        if r.forced_step == r.forced_step:         # a what-if branch
            step, tid, rank = int(r.forced_step), int(r.forced_token_id), int(r.forced_rank)
            assert f"：第 {step} 步强制为 id {tid}（排名 {rank}），之后贪心" in z
            assert f": id {tid} (rank {rank}) forced at step {step}, then greedy" in e
        assert not re.search(r"[A-Za-z]{3,}", z.removeprefix(r.branch)), z
        if r.branch in twins:
            assert z.endswith(("：KV 缓存与完整前缀一致", "：KV 缓存与完整前缀不一致")), z
            assert e.endswith((": KV cache and full prefix agree", ": KV cache and full prefix DIFFER")), e


def test_prompt_tokens_and_picks_are_shaded_by_their_probability(run, driver):
    """Each prompt token after the first carries p (data-p, hover) = numpy's FP64 softmax at T = 1 of logits.parquet
    at the position before, for that token's id, and a green whose opacity grows with p; each trajectory pick the p
    steps.parquet recorded for it."""

    from pipeline.store import logits_io
    _open(driver, run / "artifacts/report/explorer.html")
    got = driver.execute_script("""return [...document.querySelectorAll("#tokens .tok")].map((e) =>
        [Number(e.dataset.position), e.dataset.p ?? null, getComputedStyle(e).backgroundColor]);""")
    tokens = pd.read_parquet(part(paths.TOKENS, run))
    have = set(logits_io.positions_in(part(paths.LOGITS, run)))
    shaded = [(pos, float(p), bg) for pos, p, bg in got if p is not None]
    assert [pos for pos, _, _ in shaded] == [pos for pos in tokens.position if pos - 1 in have] and shaded
    for pos, p, _ in shaded:
        row = logits_io.read_position(part(paths.LOGITS, run), pos - 1)
        want = _fp64(row, 1.0)[int(tokens.token_id[tokens.position == pos].iloc[0])]
        assert p == pytest.approx(want, rel=1e-12, abs=0), pos
    picks = driver.execute_script("""return [...document.querySelectorAll("#trajectories td.picked-tok")]
        .map((e) => [Number(e.dataset.p), getComputedStyle(e).backgroundColor]);""")
    steps = pd.read_parquet(part(paths.STEPS, run))
    assert sorted(p for p, _ in picks) == sorted(steps.prob.tolist())

    def alpha(bg: str) -> float:
        return float(re.findall(r"[\d.]+", bg)[3])
    # the darker the likelier (a random-init model gives every prompt token about 1/V: the picks spread wider)
    for pairs in ([(p, bg) for _, p, bg in shaded], picks):
        pairs = sorted(pairs)
        assert all(alpha(a) <= alpha(b) for (_, a), (_, b) in zip(pairs, pairs[1:]))
    assert alpha(sorted(picks)[0][1]) < alpha(sorted(picks)[-1][1])


def test_the_why_step_shows_the_stored_parts_by_layer_opening_per_head_and_the_prompt_shaded(run, driver):
    """Step "why": a bar per layer for attention and MLP whose values are the top-1's parts in
    logit_parts.parquet summed; a click opens the layer's heads (each head's own row); every prompt token
    shaded, red where its integrated-gradients share is positive, blue where negative."""
    _open(driver, run / "artifacts/report/explorer.html")
    parts = pd.read_parquet(part(paths.LOGIT_PARTS, run))
    logits = parts.groupby("token_id")["logit"].first()
    top1 = sorted(logits.index, key=lambda i: (-logits[i], i))[0]
    mine = parts[parts.token_id == top1]
    rows = driver.find_elements("css selector", "#why-layers tr.why-layer")
    assert [int(r.get_attribute("data-layer")) for r in rows] == sorted(mine.layer.dropna().astype(int).unique())
    for r in rows:
        layer = int(r.get_attribute("data-layer"))
        bars = r.find_elements("css selector", ".why-bar")
        attn, mlp = (float(b.get_attribute("title").split(": ")[1]) for b in bars)
        here = mine[mine.layer == layer]
        assert attn == pytest.approx(here[~here.component.str.endswith(".mlp")].contribution.sum(), rel=1e-12)
        assert mlp == pytest.approx(here[here.component.str.endswith(".mlp")].contribution.sum(), rel=1e-12)
    last = rows[-1]
    layer = int(last.get_attribute("data-layer"))
    heads = driver.find_elements("css selector", f"#why-layers tr.why-head[data-layer='{layer}']")
    assert heads and not any(h.is_displayed() for h in heads)
    last.click()
    assert all(h.is_displayed() for h in heads)
    shown = [float(h.find_element("css selector", ".why-bar").get_attribute("title").split(": ")[1]) for h in heads]
    assert shown == mine[(mine.layer == layer) & mine["head"].notna()].sort_values("head").contribution.tolist()
    ig = pd.read_parquet(part(paths.INPUTS, run))
    ig = ig[ig.method == "integrated_gradients"].sort_values("source_position")
    toks = driver.find_elements("css selector", "#why-inputs .why-tok")
    assert len(toks) == len(pd.read_parquet(part(paths.TOKENS, run))) == len(ig)
    for t, v in zip(toks, ig.attribution):
        red = t.value_of_css_property("background-color").startswith("rgba(214, 96, 77")
        assert red == (v >= 0), (t.get_attribute("title"), v)


def test_at_projector_size_the_first_screen_shows_the_tokens_and_the_bars(run, driver, tmp_path):
    """At 1280 x 720 every prompt token and the first 5 candidate bars are on the first screen; `nexttoken
    screenshot`'s screens are 1280 x 720 PNGs of the first screen and of every section and step, in en and zh."""
    from pipeline.report.explorer_walk import STEPS

    page = shutil.copy(run / "artifacts/report/explorer.html", tmp_path / "explorer.html")
    screenshot.set_screen(driver)
    try:
        _open(driver, page)
        bottoms = driver.execute_script("""
            const b = (e) => e.getBoundingClientRect().bottom;
            return [[...document.querySelectorAll("#tokens .tok")].map(b),
                    [...document.querySelectorAll("#candidates tbody tr")].slice(0, 5).map(b), innerWidth, innerHeight];
        """)
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert bottoms[2:] == [1280, 720]
    assert len(bottoms[0]) == 25 and max(bottoms[0]) <= 720 and len(bottoms[1]) == 5 and max(bottoms[1]) <= 720
    shots = screenshot.screens(page)
    names = {p.name for p in shots}
    for lang in ("en", "zh"):
        assert {f"explorer-screen-{lang}-first.png", f"explorer-screen-{lang}-panel-next.png"} <= names
        assert {f"explorer-screen-{lang}-step-{s}.png" for s in STEPS} <= names
    for shot in shots:
        head = shot.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and (int.from_bytes(head[16:20]), int.from_bytes(head[20:24])) == \
            (1280, 720), shot


def test_attention_has_a_layer_chooser_and_the_last_position_s_weights_under_token_labels(run, driver):
    """#attention-layer lists every captured layer; for the chosen one, #attention-last holds a label per key
    position (the tokens' text) and per head the last query row of capture.safetensors' attention weights."""
    from pipeline.model.names import act_name
    from pipeline.store import safetensors_io

    _open(driver, run / "artifacts/report/explorer.html")
    capture = part(paths.CAPTURE, run)
    tokens = pd.read_parquet(part(paths.TOKENS, run)).sort_values("position")
    layers = driver.execute_script("return [...document.querySelectorAll('#attention-layer option')].map(o => o.value)")
    assert layers == ["0", "1"]
    for layer in layers[::-1]:
        got = driver.execute_script("""
            const s = document.getElementById("attention-layer"); s.value = arguments[0];
            s.dispatchEvent(new Event("change"));
            const g = document.getElementById("attention-last");
            return {labels: [...g.querySelectorAll(".att-label")].map((e) => e.textContent),
                    cells: [...g.querySelectorAll(".att-cell")].map((e) => Number(e.title.split(": ").pop())),
                    hidden: [...document.querySelectorAll(".att-maps")].map((e) => [e.dataset.layer, e.hidden])};
        """, layer)
        w = safetensors_io.read(capture, act_name("attn_weights", int(layer)))[0]       # [heads, T, T]
        assert got["labels"] == [json.dumps(t, ensure_ascii=False)[1:-1] for t in tokens.text]
        np.testing.assert_array_equal(np.array(got["cells"], dtype=np.float32), w[:, -1, :].reshape(-1))
        assert got["hidden"] == [[x, x != layer] for x in layers]


@pytest.mark.parametrize("mutant", ["float32", "top50"])
def test_a_page_computing_otherwise_fails_the_comparison(run, driver, tmp_path, mutant):
    """The comparisons above catch the anchors' shortcuts: float32 arithmetic, a softmax over the top 50."""
    html = (run / "artifacts/report/explorer.html").read_text()
    if mutant == "float32":
        bad = html.replace("const n = L.length, p = new Float64Array(n);",
                           "const n = L.length, p = new Float32Array(n);")
    else:
        bad = html.replace("const p = distribution(LOGITS, T);\n",
                           "const p = distribution(LOGITS, T); { let s = 0; for (let i = 0; i < N; i++) {"
                           " if (RANK[i] > 50) p[i] = 0; s += p[i]; } for (let i = 0; i < N; i++) p[i] /= s; }\n")
    assert bad != html
    page = tmp_path / "explorer.html"
    page.write_text(bad)
    _open(driver, page)
    table, _ = _last(run)
    got = _set(driver, 1.0, 0, 1)
    ref = table.set_index("token_id")[prob_column(1.0)]
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(np.array(got["probs"], dtype=np.float64), ref.loc[got["ids"]].to_numpy(),
                                   rtol=1e-12, atol=0)


# ---------------------------------------------------------------- the what-if step (issue 47 item 4)
WHAT_IF_READ = """
    const alts = (r) => [...r.querySelectorAll(".wi-alt")].map((a) => [Number(a.dataset.tokenId), a.dataset.prob]);
    const read = (id) => { const t = document.getElementById(id); return t ? [...t.querySelectorAll("tr[data-step]")]
      .map((r) => [Number(r.dataset.step), Number(r.dataset.tokenId), r.dataset.prob, alts(r)]) : null; };
    const box = document.getElementById("what-if"), status = document.getElementById("what-if-status");
    return {token: box.dataset.tokenId, branch: box.dataset.branch, status: status.textContent,
            branch_rows: read("what-if-branch"), greedy_rows: read("what-if-greedy"),
            top: document.getElementById("step-what-if").getBoundingClientRect().top};"""


def _what_if(driver, token_id: int, how: str) -> dict:
    """Choose a candidate as a reader does: a click on its row of the next-token bars (Selenium's own click), Enter
    on that row, or a click on its button in the step; read the step back."""
    from selenium.webdriver.common.keys import Keys
    sel = f'#what-if-candidates button[data-token-id="{token_id}"]' if how == "button" else \
        f'#candidates tr[data-token-id="{token_id}"]'
    e = driver.find_element("css selector", sel)
    if how == "enter":
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'}); arguments[0].focus()", e)
        e.send_keys(Keys.ENTER)
    else:
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", e)
        e.click()
    return driver.execute_script(WHAT_IF_READ)


def _rows(steps: pd.DataFrame) -> list:
    """A branch's steps as the page must show them: step, id, p, each alternative's id and p (float64, exact)."""
    return [[int(r.step), int(r.token_id), float(r.prob), [[int(i), float(q)] for i, q in zip(r.top_ids, r.top_probs)]]
            for r in steps.sort_values("step").itertuples()]


def _page_rows(rows: list | None) -> list | None:
    """The page's rows with its String(x) values read back as float64 (exact: String round-trips a double)."""
    return None if rows is None else [[s, t, float(p), [[i, float(q)] for i, q in alts]] for s, t, p, alts in rows]


def _check_what_if(run, driver) -> None:
    """Every candidate that has a forced branch (steps.parquet, forced_step 1), chosen in turn by a click, Enter, or
    its button: the step shows that branch's ids and probabilities (and each step's alternatives) exactly as
    steps.parquet holds them, the greedy branch beside it, and the page scrolled to the step for the bars; the
    greedy candidate shows the greedy branch; the next candidate after the forced ones says in one line, in both
    languages, that it has none."""
    steps = pd.read_parquet(part(paths.STEPS, run))
    forced = steps[steps.forced_step == 1]
    greedy = _rows(steps[(steps.branch == "greedy") & ~steps.kv_cache])
    assert forced.branch.nunique() == 4           # sampling.what_if's default: ranks 2 .. 5
    for i, (branch, rows) in enumerate(sorted(forced.groupby("branch"), key=lambda x: -x[1].forced_rank.iloc[0])):
        token = int(rows.forced_token_id.iloc[0])
        got = _what_if(driver, token, ("click", "enter", "button")[i % 3])
        assert (got["token"], got["branch"]) == (str(token), branch)
        assert _page_rows(got["branch_rows"]) == _rows(rows), branch
        assert _page_rows(got["greedy_rows"]) == greedy
        if i % 3 != 2:                             # from the bars: the step is brought on screen
            assert abs(got["top"]) < 2, got["top"]
    table, _ = _last(run)
    order = table.sort_values("rank").token_id.astype(int).tolist()
    got = _what_if(driver, order[0], "click")
    assert got["branch"] == "greedy" and _page_rows(got["branch_rows"]) == greedy and got["greedy_rows"] is None
    beyond = order[int(forced.forced_rank.max())]          # rank what_if + 2: no branch recorded
    assert beyond not in set(forced.forced_token_id)
    for lang in ("en", "zh"):
        driver.execute_script("const s = document.getElementById('language'); s.value = arguments[0];"
                              "s.dispatchEvent(new Event('change'))", lang)
        got = _what_if(driver, beyond, "click")
        assert got["branch"] == "" and got["branch_rows"] is None and _page_rows(got["greedy_rows"]) == greedy
        assert str(beyond) in got["status"] and "\n" not in got["status"], got
        assert ("no branch" in got["status"]) == (lang == "en") and ("没有" in got["status"]) == (lang == "zh")
    driver.execute_script("const s = document.getElementById('language'); s.value = 'en';"
                          "s.dispatchEvent(new Event('change'))")


def test_the_what_if_step_shows_each_candidate_s_forced_branch_as_recorded(run, driver):
    _open(driver, run / "artifacts/report/explorer.html")
    _check_what_if(run, driver)
    assert screenshot.console_errors(driver) == []


@pytest.mark.parametrize("mutant", ["rank", "fallback"])
def test_a_what_if_step_looking_up_the_wrong_branch_fails_the_comparison(run, driver, tmp_path, mutant):
    """A branch looked up by the wrong rank (forced_rank read as 0-based: the next candidate's branch), or one that
    shows some other branch for a candidate without one instead of saying so, fails the comparison above."""
    html = (run / "artifacts/report/explorer.html").read_text()
    good = "return D.trajectories.find((b) => b.forced && b.forced.step === 1 && b.forced.id === id);"
    bad = {"rank": good.replace("b.forced.id === id", "b.forced.rank === RANK[id] + 1"),
           "fallback": "return D.trajectories.find((b) => b.forced && b.forced.step === 1 && b.forced.id === id) ?? "
                        "D.trajectories.find((b) => b.forced);"}[mutant]
    assert html.count(good) == 1
    page = tmp_path / "explorer.html"
    page.write_text(html.replace(good, bad))
    _open(driver, page)
    with pytest.raises(AssertionError):
        _check_what_if(run, driver)


def test_a_set_s_pages_link_to_each_other(tiny_workspace, tmp_path, driver):
    from tests.conftest import run_module
    ws = copy_ws(tiny_workspace, tmp_path / "ws")
    (ws / "prompts").mkdir(exist_ok=True)
    (ws / "prompts/three.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in
                                                    (("a", "One two"), ("b", "Three four five"), ("c", "Six"))))
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "model=tiny_qwen2", "capture.device=cpu",
               "--prompt-set", "prompts/three.jsonl", check=True)
    run_chain(ws, ("validate", "tokenize", "forward", "logits", "probs", "trajectories", "checks", "report"))
    report = ws / "artifacts/report"
    files = {"a": "explorer.html", "b": "explorer-b.html", "c": "explorer-c.html"}
    assert sorted(p.name for p in report.glob("explorer*.html")) == sorted(files.values())
    for pid, name in files.items():
        _open(driver, report / name)
        links = driver.execute_script("return [...document.querySelectorAll('#pages a')].map(a => a.href)")
        assert links == [(report / files[k]).as_uri() for k in ("a", "b", "c")], (pid, links)
        assert driver.execute_script("return document.querySelector('#pages a.current').textContent") == pid
    shutil.rmtree(ws)


# ---------------------------------------------------------------- the Equivalence panel (issue 30)
def _eq(driver, variation: str, temperature: float, top_p: float = 0.9) -> dict:
    """Choose a variation and the page's temperature as a user's script would; read the panel back."""
    return driver.execute_script("""
        const [v, t, p] = arguments;
        const e = document.getElementById("temperature"); e.value = String(t); e.dispatchEvent(new Event("input"));
        const q = document.getElementById("eq-top-p"); q.value = String(p); q.dispatchEvent(new Event("input"));
        const s = document.getElementById("eq-variation"); s.value = v; s.dispatchEvent(new Event("change"));
        const text = (id) => document.getElementById(id).textContent, top1 = document.getElementById("eq-top1");
        const rows = [...document.querySelectorAll("#eq-candidates tr[data-token-id]")];
        return {kl: text("eq-kl"), jaccard: text("eq-jaccard"), kept_recorded: text("eq-kept-recorded"),
                kept_variant: text("eq-kept-variant"), max_diff: text("eq-max-diff"), status: text("eq-status"),
                source: text("eq-kept-source"),
                changed: top1.dataset.changed, recorded: top1.dataset.recorded, variant: top1.dataset.variant,
                ids: rows.map(r => Number(r.dataset.tokenId)), p: rows.map(r => r.dataset.pRecorded),
                q: rows.map(r => r.dataset.pVariant), rank_variant: rows.map(r => Number(r.dataset.rankVariant))};
    """, variation, temperature, top_p)


def _eq_inputs(ws: Path):
    """(row by variation, the recorded and each variant's float32 logits at the last position)."""
    from pipeline.store import variant_logits
    rows = {r["variation"]: r for r in pd.read_parquet(part(paths.EQUIVALENCE, ws)).to_dict("records")}
    table, pos = _last(ws)
    stored = variant_logits.read(part(paths.VARIANT_LOGITS, ws), positions=[int(pos)])
    return rows, table.logit.to_numpy(), {k: r[2][0] for k, r in stored.items()}


# The page sums its normalisers and the KL left to right, numpy pairwise: over 152,064 FP64 terms the two
# orders part by ~sqrt(N) ulps of the log-normaliser (6e-14 measured here), an absolute error of the KL.
KL_ABS = 1e-12


def _kl(a: np.ndarray, b: np.ndarray, t: float) -> float:
    def logsoftmax(x):
        x = x.astype(np.float64) / t
        return x - x.max() - np.log(np.exp(x - x.max()).sum())
    lp, lq = logsoftmax(a), logsoftmax(b)
    return float((np.exp(lp) * (lp - lq)).sum())


def _jaccard(a: np.ndarray, b: np.ndarray, t: float, top_p: float) -> float:
    ka = set(_nucleus(_fp64(a, t), a, 0, top_p).tolist())
    kb = set(_nucleus(_fp64(b, t), b, 0, top_p).tolist())
    return len(ka & kb) / len(ka | kb)


def _check_panel(got: dict, rec: np.ndarray, var: np.ndarray, t: float, fp64_sets: bool = True):
    """The panel's figures at temperature t against numpy FP64 from the stored logits (the kept sets too, unless
    the page shows the row's own: T = 1, top-p 0.9)."""
    np.testing.assert_allclose(np.array(got["p"], dtype=np.float64), _fp64(rec, t)[got["ids"]], rtol=1e-12, atol=0)
    np.testing.assert_allclose(np.array(got["q"], dtype=np.float64), _fp64(var, t)[got["ids"]], rtol=1e-12, atol=0)
    assert float(got["kl"]) == pytest.approx(_kl(rec, var, t), rel=1e-9, abs=KL_ABS)
    if fp64_sets:
        assert float(got["jaccard"]) == _jaccard(rec, var, t, 0.9) and "FP64 nucleus" in got["source"]
    order = np.lexsort((np.arange(var.size), -var.astype(np.float64)))
    assert [int(np.flatnonzero(order == i)[0]) + 1 for i in got["ids"][:5]] == got["rank_variant"][:5]


@pytest.mark.parametrize("variation", ["float32", "batch_2"])
def test_the_equivalence_panel_agrees_with_the_row_and_with_numpy_at_every_temperature(run, driver, variation):
    """At T = 1 the panel's next-token KL is the row's kl_last, its top-1 the row's at the last position, its
    top-p 0.9 kept sets the row's (transformers' float32 warper), their counts and Jaccard the row's; at T = 0.6
    and 1.7 its probabilities, KL and FP64 kept sets' Jaccard are numpy FP64's from variant_logits.parquet."""
    rows, rec, variants = _eq_inputs(run)
    row, var = rows[variation], variants[variation]
    _open(driver, run / "artifacts/report/explorer.html")
    got = _eq(driver, variation, 1.0)
    assert variation in got["status"] and len(got["ids"]) >= 20
    assert float(got["kl"]) == pytest.approx(row["kl_last"], rel=1e-9, abs=KL_ABS)
    last = row["n_positions"] - 1
    assert (got["changed"] == "true") == (last in list(row["top1_changed"]))
    assert (int(got["recorded"]), int(got["variant"])) == (int(rec.argmax()), int(var.argmax()))
    assert (int(got["kept_recorded"]), int(got["kept_variant"]), float(got["jaccard"])) == \
        (row["kept_recorded"], row["kept_variant"], row["kept_jaccard"]) and "the row's sets" in got["source"]
    _check_panel(got, rec, var, 1.0, fp64_sets=False)
    if row["bit_identical"]:
        assert (got["kl"], got["jaccard"], got["max_diff"]) == ("0", "1", "0")
    else:
        assert float(got["max_diff"]) == float(np.abs(rec.astype(np.float64) - var).max()) > 0
    for t in (0.6, 1.7):
        moved = _eq(driver, variation, t)
        _check_panel(moved, rec, var, t)
        assert moved["p"] != got["p"]


def test_each_encoding_gives_back_the_variant_exactly(run, driver):
    """sdpa (bf16 values), float16 (half values), float32, batch_2 (here the record's own bits: nothing embedded),
    each in the encoding the page chose (its plain bytes or its Rice-coded difference from the record or an earlier
    variation): the panel's variant probabilities are numpy's FP64 softmax of variant_logits.parquet's values."""
    from pipeline.report.explorer import variant_encoding
    _, rec, variants = _eq_inputs(run)
    _open(driver, run / "artifacts/report/explorer.html")
    earlier, encodings = {}, {}
    for variation, row in variants.items():          # the page's order: a row refers only to an earlier one
        encodings[variation] = variant_encoding(rec, row, earlier)[0]
        earlier[variation] = row
    assert encodings["batch_2"] == "same" and {encodings[v] for v in ("sdpa", "float16", "float32")} <= {
        "rice", "bf16", "f16", "f4", "as"}
    for variation in ("sdpa", "float16", "float32", "batch_2"):
        got = _eq(driver, variation, 1.0)
        assert f"embedded as {encodings[variation]})" in got["status"], got["status"]
        _check_panel(got, rec, variants[variation], 1.0, fp64_sets=False)


def test_the_equivalence_panel_says_what_it_does_not_show(run, driver):
    _open(driver, run / "artifacts/report/explorer.html")
    got = _eq(driver, "kv_cache_greedy", 1.0)
    assert "not shown" in got["status"] and "step_logits.parquet" in got["status"] and got["ids"] == []


@pytest.mark.parametrize("mutant", ["swapped", "no_temperature"])
def test_a_panel_computing_otherwise_fails_the_comparison(run, driver, tmp_path, mutant):
    """Record and variant swapped, or the variant's softmax at T = 1 whatever the temperature: the panel's
    figures no longer equal numpy's."""
    html = (run / "artifacts/report/explorer.html").read_text()
    good = ("const p = softmax64(LOGITS, T), q = softmax64(V.L, T), lp = logSoftmax64(LOGITS, T), "
            "lq = logSoftmax64(V.L, T);")
    bad = {"swapped": "const q = softmax64(LOGITS, T), p = softmax64(V.L, T), lq = logSoftmax64(LOGITS, T), "
                      "lp = logSoftmax64(V.L, T);",
           "no_temperature": "const p = softmax64(LOGITS, T), q = softmax64(V.L, 1), lp = logSoftmax64(LOGITS, T), "
                             "lq = logSoftmax64(V.L, 1);"}[mutant]
    assert good in html
    page = tmp_path / "explorer.html"
    page.write_text(html.replace(good, bad))
    _open(driver, page)
    _, rec, variants = _eq_inputs(run)
    with pytest.raises(AssertionError):
        _check_panel(_eq(driver, "float32", 1.0 if mutant == "swapped" else 0.6), rec, variants["float32"],
                     1.0 if mutant == "swapped" else 0.6, fp64_sets=mutant != "swapped")
