"""The report's figure text (issue 50): labels name each character once (a surrogate pair is the character it
encodes, never `\\ud83c\\udf55`), and a log axis keeps its tick labels apart."""

from __future__ import annotations

import ast
import itertools

import pytest

from pipeline.report import plots, set_plots
from tests.unit.test_report_overview import inputs

PIZZA = "\U0001f355"
PAIR = "\ud83c\udf55"          # the same character as two UTF-16 halves (what a JSON escape spells)


def _unescaped(label: str) -> str:
    """The label read back as a Python string literal: the text it stands for."""
    return ast.literal_eval('"' + label.replace('"', '\\"') + '"')


@pytest.mark.parametrize("text", [f"I love pizza {PIZZA} and", f"I love pizza {PAIR} and"])
def test_a_prompt_label_names_the_real_character_not_its_surrogate_halves(text):
    font = plots.fonts()
    assert 0x1F355 not in font.codepoints            # the packaged fonts draw no emoji: it is escaped
    label = set_plots.prompt_label("p", text, font)
    assert "\\ud83c" not in label and "\\udf55" not in label, label
    assert label == "p: I love pizza \\N{SLICE OF PIZZA} and"
    assert _unescaped(label) == f"p: I love pizza {PIZZA} and"


def test_a_font_that_has_the_glyph_draws_the_joined_character():
    emoji = plots.Fonts(("X",), frozenset(range(32, 127)) | {0x1F355})
    assert emoji.drawable(f"a{PAIR}b") == f"a{PIZZA}b" == emoji.drawable(f"a{PIZZA}b")
    latin = plots.Fonts(("X",), frozenset(range(32, 127)))
    assert latin.drawable("a\ud800b\u00e9") == "a\\ud800b\\u00e9"      # a lone half stays what it is
    assert latin.drawable("\U000f0000") == "\\U000f0000"               # no name: its code point
    label = plots.token_label(7, {"text": f" {PAIR}", "decodes_alone": True}, latin)
    assert label == '" \\N{SLICE OF PIZZA}"\nid 7'


def _overlaps(fig) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Pairs of visible tick labels (each axis, major and minor) whose drawn extents overlap, and how many
    labels each axis shows."""
    renderer = fig.canvas.get_renderer()
    bad, count = [], {}
    for ax in fig.axes:
        inside = ax.get_window_extent(renderer)
        for which, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            boxes = []
            for t in axis.get_ticklabels(which="both"):
                if not t.get_visible() or not t.get_text():
                    continue
                box = t.get_window_extent(renderer)
                centre = (box.x0 + box.x1) / 2 if which == "x" else (box.y0 + box.y1) / 2
                lo, hi = (inside.x0, inside.x1) if which == "x" else (inside.y0, inside.y1)
                if lo - 1 <= centre <= hi + 1:                    # drawn (a tick outside the view is not)
                    boxes.append((t.get_text(), box))
            count[which] = count.get(which, 0) + len(boxes)
            bad += [(a, b) for (a, p), (b, q) in itertools.combinations(boxes, 2) if p.overlaps(q)]
    return bad, count


@pytest.mark.parametrize("kept", [{0.5: 3, 1.0: 60, 2.0: 40_000}, {0.5: 12, 1.0: 30, 2.0: 90},
                                  {0.5: 1, 1.0: 150_000, 2.0: 152_000}])
def test_the_nucleus_plots_log_axis_labels_never_overlap(kept, tmp_path, monkeypatch):
    s = inputs()
    for r in s.probs:
        r["top_p_0.9_kept"] = kept[r["temperature"]] * (1 + (r["prompt_id"] == "zh_fact"))
    drawn = []

    def keep(fig, path):
        plots.save(fig, path)
        drawn.append(fig)
    monkeypatch.setattr(set_plots, "save", keep)

    def out(name: str):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        return tmp_path / name
    set_plots.nucleus(out, s, "top_p_0.9", plots.fonts())
    bad, count = _overlaps(drawn[0])
    assert not bad, bad
    assert count["y"] >= 3, count        # labelled, not left blank: the decades (or, within one, minor ticks)
