"""The explorer page is built from real files (pipeline/report/explorer_page/) by one templating pass.

Content cannot confuse it: a prompt id that spells a placeholder stays text, data that spells `</script>` or
`<!--` stays inside its JSON element, and the JSON read back is the data. The page's files are package data
and report-stage deps in dvc.yaml, so editing one re-runs the report.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from pipeline.report import explorer

REPO = Path(__file__).resolve().parents[2]


def _data(prompt_id: str, text: str) -> dict:
    return {"prompt_id": prompt_id, "tokens": [{"text": text}]}


def _json_of(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="nt-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def test_one_pass_keeps_content_out_of_the_template():
    tricky = "{{script}} __SCRIPT__ {{data}} </script><!--<script> & \u4f60\u597d"
    page = explorer.render_page(_data(tricky, tricky))
    title = re.search(r"<title>(.*?)</title>", page, re.S).group(1)
    assert "{{script}} __SCRIPT__ {{data}} &lt;/script&gt;" in title and len(title) < 200
    assert page.count("<script") == 2 and page.count("</script>") == 2     # the data element and the module
    assert _json_of(page) == _data(tricky, tricky)
    assert not explorer.PLACEHOLDER.search(page.replace(tricky, "").replace("{{script}} __SCRIPT__ {{data}}", ""))


def test_fill_refuses_a_placeholder_without_a_value():
    with pytest.raises(ValueError, match=r"no value for \['b'\]"):
        explorer.fill("{{a}} {{b}}", {"a": "x"})
    assert explorer.fill("{{a}}{{a}}", {"a": "{{a}}"}) == "{{a}}{{a}}"


def test_the_page_files_are_package_data_and_report_deps():
    files = sorted(p.relative_to(REPO).as_posix() for p in explorer.PAGE_DIR.iterdir() if p.is_file())
    assert {Path(f).name for f in files} >= {"page.html", "style.css", "numerics.mjs", "explorer.js"}
    deps = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["report"]["deps"]
    assert set(files) <= set(deps), set(files) - set(deps)
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pipeline"]
    assert "report/explorer_page/*" in data


def test_the_embedded_fonts_draw_each_character_of_the_text_once():
    """Chinese, kana, Cyrillic from Noto Sans CJK JP; Arabic and Hebrew (not in Noto CJK) from DejaVu Sans; a
    character neither has (Devanagari) from neither. The same text gives the same bytes (no timestamp)."""
    from fontTools.ttLib import TTFont

    from pipeline.report import explorer_font

    text = "问题：温度 かな Привет مرحبا שלום नमस्ते"
    css, counts = explorer_font.font_faces(text)
    assert css == explorer_font.font_faces(text)[0]
    fonts = {}
    for family, b64 in re.findall(r'font-family:"([^"]+)".*?base64,([A-Za-z0-9+/=]+)', css):
        import base64
        import io
        fonts[family] = TTFont(io.BytesIO(base64.b64decode(b64))).getBestCmap()
    cjk, dejavu = fonts["nexttoken-cjk"], fonts["nexttoken-dejavu"]
    for ch in "问题温度かなПривет":
        assert ord(ch) in cjk and ord(ch) not in dejavu, ch
    for ch in "مرحباשלום":
        assert ord(ch) in dejavu and ord(ch) not in cjk, ch
    assert ord("न") not in cjk and ord("न") not in dejavu
    assert counts == {"nexttoken-cjk": len({c for c in text if ord(c) in cjk}),
                      "nexttoken-dejavu": len({c for c in text if ord(c) in dejavu})}
    assert len(cjk) < 100       # a subset, not the 65,535-glyph font


def test_the_page_carries_its_fonts_as_data_fonts_its_csp_allows():
    page = explorer.render_page(_data("p", "实践中"))
    assert "font-src data:;" in explorer.CSP and "url(data:font/woff;base64," in page
    css = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    assert css.index("@font-face") < css.index("body{") and '"nexttoken-cjk","nexttoken-dejavu"' in css


def test_report_language_is_en_or_zh_and_the_page_opens_in_it():
    from pipeline.config import schema
    from pipeline.errors import UserError

    assert schema.load_section({"report": {"prompt_id": None}}, "report").language == "en"
    with pytest.raises(UserError, match=r"^report.language='fr' is not allowed: .*en or zh$"):
        schema.load_section({"report": {"prompt_id": None, "language": "fr"}}, "report")
    page = explorer.render_page({**_data("p", "x"), "language": "zh"})
    assert _json_of(page)["language"] == "zh"



def test_a_kept_set_travels_as_a_count_when_a_prefix_else_as_ids_when_short_and_as_a_bitmap_when_large():
    """A flat distribution's top-p set is most of the vocabulary: as JSON ids, ~1 MB per variation (issue 46); a set
    that is the first n ids of its side's logit order travels as n."""
    import base64

    import numpy as np

    size = 152064
    order = np.random.default_rng(1).permutation(size)
    assert explorer.kept_set(order[:90000][::-1], size, order) == {"top": 90000}
    small = explorer.kept_set([5, 17, 151000], size, order)
    assert small == {"ids": [5, 17, 151000]}
    many = np.arange(0, size, 2)
    big = explorer.kept_set(many, size, order)
    back = np.unpackbits(np.frombuffer(base64.b64decode(big["bits"]), dtype=np.uint8), bitorder="little")[:size]
    assert np.array_equal(np.flatnonzero(back), many)
    assert len(json.dumps(big)) < size // 8 * 4 // 3 + 20 < len(json.dumps({"ids": many.tolist()})) // 10
    prefix_but_one = np.concatenate([order[:99], order[100:101]])        # a warper's own tie-break at the boundary
    assert explorer.kept_set(prefix_but_one, size, order) == {"ids": prefix_but_one.tolist()}
    assert explorer.kept_set(None, size, order) == {"top": 0}
