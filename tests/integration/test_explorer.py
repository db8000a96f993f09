"""The explorer (issue 28 item 2) in a real browser: headless Chromium from Debian, opened from file://.

At each configured temperature the page's probabilities equal table.parquet (relative 1e-12); at each
configured filter its kept set equals filtered.parquet exactly; at a setting that is not configured they
equal numpy's FP64 computation. Zero network requests, no console errors, every panel shown, a
screenshot beside the page. Mutant pages (float32 arithmetic, a softmax renormalised over the top 50
only) fail the same comparisons. Skipped, with one line saying why, where Chromium is not installed.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from pipeline.numerics.probs import prob_column
from pipeline.store import paths
from pipeline.tools import screenshot
from tests.conftest import TEST_STEPS, copy_ws
from tests.helpers.inprocess import run_chain
from tests.helpers.partitions import part

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(screenshot.available() is not None,
                                 reason=f"browser tests skipped: {screenshot.available()}")]
PANELS = ("panel-conditions", "panel-tokens", "panel-next", "panel-lens", "panel-attention", "panel-trajectories",
          "panel-checks")


@pytest.fixture(scope="module")
def run(tiny_chain, tmp_path_factory):
    """tiny_qwen2 through checks and report (explorer.html), in its own copy of the session chain."""
    ws = copy_ws(tiny_chain, tmp_path_factory.mktemp("explorer") / "ws")
    run_chain(ws, ("checks", "report"))
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


def _fp64(logits: np.ndarray, t: float) -> np.ndarray:
    x = logits.astype(np.float64) / t
    e = np.exp(x - x.max())
    return e / e.sum()


def _nucleus(p: np.ndarray, logits: np.ndarray, k: int, top_p: float) -> np.ndarray:
    """numpy's FP64 kept set: top-k (ties kept), then the smallest prefix by p (ties lower id) reaching top_p."""
    order = np.lexsort((np.arange(p.size), -p))
    if k:
        order = order[logits[order] >= logits[order[k - 1]]]
    q = p[order] / p[order].sum()
    n = int(np.searchsorted(np.cumsum(q), top_p) + 1) if top_p < 1 else order.size
    return order[:min(n, order.size)]


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
    assert sent == [page.as_uri()], sent           # the page itself, nothing else
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


@pytest.mark.parametrize("mutant", ["float32", "top50"])
def test_a_page_computing_otherwise_fails_the_comparison(run, driver, tmp_path, mutant):
    """The comparisons above catch the anchors' shortcuts: float32 arithmetic, a softmax over the top 50."""
    html = (run / "artifacts/report/explorer.html").read_text()
    if mutant == "float32":
        bad = html.replace("const p = new Float64Array(N);", "const p = new Float32Array(N);")
    else:
        bad = html.replace("for (let i = 0; i < N; i++) { const e = Math.exp(p[i] - m); p[i] = e; s += e; }",
                           "for (let i = 0; i < N; i++) { const e = RANK[i] <= 50 ? Math.exp(p[i] - m) : 0;"
                           " p[i] = e; s += e; }")
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
