"""The report's figures: PNGs drawn from the stored last-position logits, plus their data.

Three figures: the top candidates' probabilities per temperature (grouped bars), the
cumulative probability of the sorted distribution with the top-p cut, and the entropy
against temperature. Each also writes the numbers it draws as a small CSV beside it, so
`dvc plots show` can render the curves without the PNGs.

Reproducible bytes: no pyplot (no global state), a fixed size and dpi, the Agg canvas, and
no `Software` metadata in the PNG (it would carry the matplotlib version). The same inputs
give byte-identical files: the fonts come with the pinned packages (DejaVu Sans with
matplotlib, Noto Sans CJK JP with noto-cjk-sans-jp-regular), registered at run time, so
Chinese and Japanese text draws as glyphs on any machine; the report names them.
"""

from __future__ import annotations

import csv
import json
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib import import_module
from pathlib import Path

import numpy as np

SIZE_IN = (9.0, 5.0)
DPI = 110
PNG_METADATA = {"Software": None}   # matplotlib would otherwise stamp its version
BASE_FONT = "DejaVu Sans"           # ships with matplotlib: always there
# Chinese and Japanese (the reference prompt is Chinese) from the pinned PyPI package
# noto-cjk-sans-jp-regular (Noto Sans CJK JP, SIL OFL 1.1): the same glyphs on every machine.
CJK_PACKAGE = "noto_cjk_sans_jp_regular"


# ---------------------------------------------------------------- fonts and labels
@dataclass(frozen=True)
class Fonts:
    families: tuple[str, ...]      # matplotlib falls back glyph by glyph along this list
    codepoints: frozenset[int]     # what those fonts can draw together

    @property
    def cjk(self) -> str | None:
        return self.families[1] if len(self.families) > 1 else None

    def covers(self, text: str) -> bool:
        return all(ord(c) in self.codepoints and c.isprintable() for c in text)

    def drawable(self, text: str) -> str:
        """text with each character the fonts cannot draw escaped (`escape`), so no glyph goes missing; a
        surrogate pair is first read as the one character it encodes (`real_characters`)."""
        return "".join(c if c in "\n" or self.covers(c) else escape(c) for c in real_characters(text))


def real_characters(text: str) -> str:
    """text with each UTF-16 surrogate pair (two code points, as a JSON `\\ud83c\\udf55` reads back in some
    readers) joined into the character it encodes (U+1F355); a lone surrogate stays as it is."""
    if not any("\ud800" <= c <= "\udfff" for c in text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def escape(c: str) -> str:
    """One character as a Python escape: `\\u00e9` in the Basic Multilingual Plane; beyond it (emoji) by its
    Unicode name, `\\N{SLICE OF PIZZA}`, or `\\U0001f355` where it has none. One escape per character: never
    the two halves of a UTF-16 surrogate pair, as JSON writes them."""
    if c == "\n":
        return "\\n"
    if ord(c) <= 0xFFFF:
        return f"\\u{ord(c):04x}"
    named = unicodedata.name(c, "")
    return f"\\N{{{named}}}" if named else f"\\U{ord(c):08x}"


@lru_cache(maxsize=1)
def fonts() -> Fonts:
    """DejaVu Sans plus the packaged CJK font, registered with matplotlib's font manager (no download,
    no system font search); DejaVu alone if the package is missing."""
    from matplotlib import font_manager as fm
    from matplotlib.ft2font import FT2Font

    paths = [fm.findfont(fm.FontProperties(family=BASE_FONT), fallback_to_default=False)]
    try:
        cjk = import_module(CJK_PACKAGE)
    except ImportError:
        cjk = None
    if cjk is not None:
        fm.fontManager.addfont(str(cjk.FONT_PATH))
        paths.append(str(cjk.FONT_PATH))
    families = tuple(fm.FontProperties(fname=path).get_name() for path in paths)
    points = frozenset().union(*(FT2Font(path).get_charmap() for path in paths))
    return Fonts(families, points)


def token_label(token_id: int, info: dict | None, font: Fonts) -> str:
    """Two lines: the token's text (quoted, so spaces show) and its id.

    Text the fonts cannot draw is shown escaped (`escape`) rather than as empty boxes; a
    piece that is only part of a UTF-8 character shows its bytes; ids past the tokenizer
    (the model's output can be larger) say so.
    """
    if info is None or not info.get("has_token", True) or info.get("text") is None:
        shown = "(no token)"
    elif info.get("decodes_alone") is False:
        shown = "bytes " + (info.get("piece_bytes_hex") or "?")
    else:
        shown = font.drawable(json.dumps(real_characters(info["text"]), ensure_ascii=False))
    return f"{shown}\nid {token_id}"


# ---------------------------------------------------------------- numbers drawn
def softmax64(logits: np.ndarray, t: float) -> np.ndarray:
    """FP64 softmax of logits / t over the full output (the probs stage's definition)."""
    z = logits.astype(np.float64) / t
    z -= z.max()
    e = np.exp(z)
    return e / e.sum()


def entropy_curve(logits: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """Entropy (nats) of softmax(logits / T) for each T, one row at a time (V can be 152k)."""
    x = logits.astype(np.float64)
    out = np.empty(len(temperatures))
    for i, t in enumerate(temperatures):
        z = x / t
        z -= z.max()
        e = np.exp(z)
        s = e.sum()
        out[i] = np.log(s) - float((e * z).sum()) / s     # H = log sum e^z - E_p[z]
    return out


def temperature_grid(configured: list[float]) -> np.ndarray:
    hi = max(2.0, 1.25 * max(configured))
    return np.round(np.linspace(0.02, hi, 200), 6)


def log_ranks(n: int, points: int = 600, extra: tuple[int, ...] = ()) -> np.ndarray:
    """Ranks 1..n sampled evenly on a log axis (every small rank, sparser further out)."""
    r = np.unique(np.concatenate([np.round(np.geomspace(1, n, points)).astype(np.int64), extra, [n]]))
    return r[(r >= 1) & (r <= n)]


# ---------------------------------------------------------------- output
@dataclass(frozen=True)
class Figure:
    name: str           # file stem under plots/
    png: str            # path relative to the report folder
    data: str           # the CSV holding what it draws, relative to the report folder
    caption: str


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    """The data a figure draws, as CSV beside it."""
    # repr of a float is its shortest round-trip form: exact and stable across runs.
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows([[repr(v) if isinstance(v, float) else v for v in row] for row in rows])


def new_figure(size: tuple[float, float] = SIZE_IN):
    """A matplotlib figure drawn off screen (Agg), at the report's DPI (the report's, the set's and the
    sweep's figures)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure
    fig = MplFigure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


MINOR_ORDER = (5, 2, 3, 4, 6, 7, 8, 9)     # which minor labels of a log decade are kept first, where not all fit


def plain_log_axis(axis) -> None:
    """A log-scale axis (ax.yaxis / ax.xaxis) labelled in plain numbers (40, not 4 x 10^1) whose labels never
    overlap: every major (decade) label, and of the minor ticks' labels those that fit beside the ones kept
    before them (5, then 2, then 3 ... of each decade), measured on the laid-out figure."""
    from matplotlib.ticker import FuncFormatter
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain)
    fig = axis.axes.figure
    fig.canvas.draw()                                  # the layout: where each label lands, how large it is
    renderer = fig.canvas.get_renderer()
    lo, hi = sorted(axis.get_view_interval())

    def shown(ticks, locs) -> list:
        return [(t.label1.get_window_extent(renderer), float(v)) for t, v in zip(ticks, locs)
                if lo <= v <= hi and t.label1.get_visible() and t.label1.get_text()]
    kept = [box for box, _ in shown(axis.get_major_ticks(len(axis.get_majorticklocs())), axis.get_majorticklocs())]
    minor_locs = axis.get_minorticklocs()
    minor = shown(axis.get_minor_ticks(len(minor_locs)), minor_locs)
    labelled = set()
    for box, v in sorted(minor, key=lambda bv: (_minor_rank(bv[1]), bv[1])):
        if not any(box.expanded(1.0, 1.15).overlaps(k) for k in kept):
            kept.append(box)
            labelled.add(f"{v:g}")
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}" in labelled else ""))


def _minor_rank(v: float) -> int:
    mantissa = round(v / 10 ** np.floor(np.log10(v)))
    return MINOR_ORDER.index(mantissa) if mantissa in MINOR_ORDER else len(MINOR_ORDER)


def save(fig, path: Path) -> None:
    """The figure as a PNG with fixed metadata (no date: two runs give the same bytes)."""
    fig.savefig(path, dpi=DPI, format="png", metadata=PNG_METADATA)


def rc(font: Fonts) -> dict:
    """matplotlib settings of every figure (the report's and the sweep's): the fonts, sizes, stable ids."""
    return {"font.family": list(font.families), "font.size": 10, "axes.titlesize": 12,
            "svg.hashsalt": "nexttoken", "path.simplify": True}


# ---------------------------------------------------------------- the three figures
def temperature_bars(out: Callable[[str], Path], position: int, temps: list[dict], labels: dict[int, str],
                     font: Fonts) -> Figure:
    """Grouped bars: each top candidate (and `rest`) with one bar per temperature."""
    import matplotlib
    ids = [c["token_id"] for c in temps[0]["top"]]
    groups = [labels[i] for i in ids] + ["rest\n(all other ids)"]
    values = np.array([[c["prob"] for c in t["top"]] + [t["rest"]] for t in temps])   # [T, group]
    # One row per temperature with fixed column names (rank1.., rest), so a dvc.yaml plot spec
    # holds for any model and prompt; which id each rank is goes in a file of its own.
    write_csv(out("plots/temperature_top.csv"), ["temperature", *(f"rank{k + 1}" for k in range(len(ids))), "rest"],
               [[float(t["temperature"]), *(float(v) for v in values[k])] for k, t in enumerate(temps)])
    write_csv(out("plots/temperature_top_ids.csv"), ["rank", "token_id", "label"],
               [[k + 1, i, labels[i].replace("\n", " ")] for k, i in enumerate(ids)])
    with matplotlib.rc_context(rc(font)):
        fig = new_figure()
        ax = fig.add_subplot()
        width = 0.8 / len(temps)
        colors = matplotlib.colormaps["plasma"](np.linspace(0.1, 0.8, len(temps)))   # cool -> hot
        x = np.arange(len(groups))
        for k, t in enumerate(temps):
            bars = ax.bar(x + (k - (len(temps) - 1) / 2) * width, values[k], width, color=colors[k],
                          label=f"T = {t['temperature']:g}", edgecolor="black", linewidth=0.4)
            ax.bar_label(bars, labels=[f"{v:.4f}" for v in values[k]], fontsize=8, padding=2)
        ax.set_xticks(x, groups)
        ax.set_ylim(0, min(1.08, values.max() * 1.15 + 0.02))
        ax.set_ylabel("probability (FP64 softmax over every output id)")
        ax.set_title(f"Top candidates at position {position} by temperature")
        ax.legend(loc="upper center", ncols=len(temps), frameon=False)
        ax.grid(axis="y", alpha=0.3)
        png = out("plots/temperature_top.png")
        save(fig, png)
    return Figure("temperature_top", "plots/temperature_top.png", "plots/temperature_top.csv",
                  f"Probabilities of the top candidates and of all other ids together, per temperature "
                  f"(position {position}).")


def cumulative_curve(out: Callable[[str], Path], position: int, logits: np.ndarray, t: float,
                     cuts: list[dict], font: Fonts) -> Figure:
    """Cumulative probability of the sorted distribution at temperature t, top-p cuts marked."""
    import matplotlib
    p = np.sort(softmax64(logits, t))[::-1]
    cum = np.cumsum(p)
    ranks = log_ranks(p.size, extra=tuple(c["kept_count"] for c in cuts))
    write_csv(out("plots/cumulative.csv"), ["rank", "log10_rank", "prob", "cumulative"],
               [[int(r), float(np.log10(r)), float(p[r - 1]), float(cum[r - 1])] for r in ranks])
    with matplotlib.rc_context(rc(font)):
        fig = new_figure()
        ax = fig.add_subplot()
        ax.plot(ranks, cum[ranks - 1], color="tab:blue", lw=1.8, label=f"cumulative probability, T = {t:g}")
        ax.set_xscale("log")
        ax.set_xlim(1, p.size * 1.5)
        ax.set_ylim(0, 1.02)
        for k, c in enumerate(cuts):
            n = c["kept_count"]
            ax.axhline(c["top_p"], color="tab:red", ls="--", lw=1)
            ax.axvline(n, color="tab:red", ls=":", lw=1)
            ax.plot([n], [cum[n - 1]], "o", color="tab:red")
            # the box sits below-right of the cut, where the rising curve leaves room
            ax.annotate(f"{c['filter']}: top_p = {c['top_p']:g} keeps {n} of {p.size} ids\n"
                        f"(kept mass {c['kept_mass']:.6f})", (n, cum[n - 1]), xytext=(0.97, 0.25 + 0.15 * k),
                        textcoords="axes fraction", ha="right", color="tab:red",
                        arrowprops={"arrowstyle": "->", "color": "tab:red"},
                        bbox={"boxstyle": "round", "fc": "white", "ec": "tab:red"})
        ax.set_xlabel("candidates kept, sorted by probability (rank, log scale)")
        ax.set_ylabel("cumulative probability")
        ax.set_title(f"How much mass the top-ranked ids hold (position {position}, T = {t:g})")
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="upper left", frameon=False)
        save(fig, out("plots/cumulative.png"))
    return Figure("cumulative", "plots/cumulative.png", "plots/cumulative.csv",
                  f"Cumulative probability of the ids sorted by probability at T = {t:g}; the dashed line is "
                  f"top_p, the dotted line the number of ids the filter keeps.")


def entropy_plot(out: Callable[[str], Path], position: int, logits: np.ndarray, temps: list[dict],
                 font: Fonts) -> Figure:
    """Entropy against temperature on a fine grid, the configured temperatures marked."""
    import matplotlib
    configured = [t["temperature"] for t in temps]
    grid = temperature_grid(configured)
    h = entropy_curve(logits, grid)
    write_csv(out("plots/entropy.csv"), ["temperature", "entropy_nats", "entropy_bits"],
               [[float(t), float(v), float(v / np.log(2))] for t, v in zip(grid, h)])
    write_csv(out("plots/entropy_configured.csv"), ["temperature", "entropy_nats", "entropy_bits"],
               [[float(t["temperature"]), float(t["entropy_nats"]), float(t["entropy_bits"])] for t in temps])
    with matplotlib.rc_context(rc(font)):
        fig = new_figure()
        ax = fig.add_subplot()
        ax.plot(grid, h, color="tab:purple", lw=1.8, label="entropy of softmax(logits / T)")
        ceiling = float(np.log(logits.size))
        ax.axhline(ceiling, color="gray", ls="--", lw=1,
                   label=f"uniform over all {logits.size} ids: ln V = {ceiling:.3f} nats")
        for t in temps:
            ax.plot([t["temperature"]], [t["entropy_nats"]], "o", color="black", zorder=3)
            # above-left of the dot: the rising curve lies below-left of it
            ax.annotate(f"T = {t['temperature']:g}: {t['entropy_nats']:.3f} nats",
                        (t["temperature"], t["entropy_nats"]), xytext=(-8, 8), textcoords="offset points",
                        ha="right", fontsize=9)
        ax.set_xlim(0, grid[-1])
        ax.set_ylim(0, ceiling * 1.08)
        ax.set_xlabel("temperature T")
        ax.set_ylabel("entropy (nats)")
        bits = ax.secondary_yaxis("right", functions=(lambda v: v / np.log(2), lambda v: v * np.log(2)))
        bits.set_ylabel("entropy (bits)")
        ax.set_title(f"Entropy of the next-token distribution against temperature (position {position})")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", frameon=False)
        save(fig, out("plots/entropy.png"))
    return Figure("entropy", "plots/entropy.png", "plots/entropy.csv",
                  "Entropy on a grid of temperatures, computed from the stored logits; the dots are the configured "
                  "temperatures' entropies from the probs stage (they must sit on the curve).")
