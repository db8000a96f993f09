"""The report's figures across the prompts of a set: nucleus size against temperature, the entropy and
top-1 probability distributions, the loop rate per branch. Each writes the numbers it draws as a CSV
beside its PNG; drawn as plots.py draws (no pyplot, fixed dpi, the packaged fonts: Chinese and Japanese
prompt text in the labels draws as glyphs, what no font has is escaped). The numbers come from
overview.py (`by_temperature`, `loop_rates`), which the unit tests check on hand-built tables.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from pipeline.report import overview
from pipeline.report.plots import Figure, Fonts, new_figure, plain_log_axis, rc, save, write_csv

LABEL_CHARS = 24     # characters of a prompt's text in its axis label


def prompt_label(prompt_id: str, text: str, font: Fonts) -> str:
    """`id: first words of the text` on one line, each character the fonts cannot draw escaped."""
    return font.drawable(f"{prompt_id}: {overview.excerpt(' '.join(text.split()), LABEL_CHARS)}")


def _strip(ax, groups: list[tuple[float, list[tuple[str, float]]]], log: bool) -> None:
    """A box per temperature, each prompt's value as a dot (spread sideways by its index), and a faint line
    per prompt across the temperatures."""
    x = np.arange(len(groups))
    ids = list(dict.fromkeys(p for _, vals in groups for p, _ in vals))
    spread = dict(zip(ids, np.linspace(-0.18, 0.18, len(ids)) if len(ids) > 1 else [0.0]))
    ax.boxplot([[v for _, v in vals] for _, vals in groups], positions=x, widths=0.5, showfliers=False,
               medianprops={"color": "tab:red"})
    for p in ids if len(ids) <= overview.PER_PROMPT_MAX else []:      # a large set: the boxes alone
        pts = [(k + spread[p], dict(vals)[p]) for k, (_, vals) in enumerate(groups) if p in dict(vals)]
        ax.plot([a for a, _ in pts], [b for _, b in pts], "-", color="gray", alpha=0.35, lw=0.8)
        ax.plot([a for a, _ in pts], [b for _, b in pts], "o", color="tab:blue", ms=3.5, alpha=0.8)
    ax.set_xticks(x, [f"T = {t:g}" for t, _ in groups])
    ax.grid(axis="y", alpha=0.3, which="both")
    if log:
        ax.set_yscale("log")             # labelled once the figure is complete (`plain_log_axis`)


def nucleus(out: Callable[[str], Path], s: overview.SetInputs, filter_name: str, font: Fonts) -> Figure:
    import matplotlib
    groups = overview.by_temperature(s, f"{filter_name}_kept")
    write_csv(out("plots/set_nucleus.csv"), ["temperature", "prompt_id", "kept"],
               [[float(t), p, int(v)] for t, vals in groups for p, v in vals])
    with matplotlib.rc_context(rc(font)):
        fig = new_figure()
        ax = fig.add_subplot()
        _strip(ax, groups, log=True)
        ax.set_ylabel(f"ids kept by {filter_name} (log scale)")
        ax.set_title(f"Nucleus size against temperature across {len(s.ids)} prompts")
        plain_log_axis(ax.yaxis)         # 40, not 4 x 10^1; the minor labels that fit, none overlapping
        save(fig, out("plots/set_nucleus.png"))
    return Figure("set_nucleus", "plots/set_nucleus.png", "plots/set_nucleus.csv",
                  f"How many ids `{filter_name}` keeps at each temperature, one dot per prompt (a gray line joins "
                  f"a prompt's dots), with the quartiles across prompts." if len(s.ids) <= overview.PER_PROMPT_MAX else
                  f"How many ids `{filter_name}` keeps at each temperature: the quartiles across the "
                  f"{len(s.ids)} prompts (whiskers 1.5 IQR).")


def next_token(out: Callable[[str], Path], s: overview.SetInputs, t: float, font: Fonts) -> Figure:
    """Entropy per temperature across prompts (left); each prompt's top-1 probability at T = t (right)."""
    import matplotlib
    entropy = overview.by_temperature(s, "entropy")
    top1_at = {temp: dict(vals) for temp, vals in overview.by_temperature(s, "top1_prob")}
    top1 = top1_at[t]
    write_csv(out("plots/set_next_token.csv"), ["temperature", "prompt_id", "entropy_nats", "top1_prob"],
               [[float(temp), p, float(h), float(top1_at[temp][p])] for temp, vals in entropy for p, h in vals])
    large = len(s.ids) > overview.PER_PROMPT_MAX      # a histogram, not a bar per prompt
    labels = [] if large else [prompt_label(p, s.tokenize[p]["prompt"], font) for p in s.ids if p in top1]
    with matplotlib.rc_context(rc(font)):
        fig = new_figure()
        fig.set_size_inches(11.0, max(5.0, 1.5 + 0.28 * len(labels)))
        left, right = fig.subplots(1, 2, width_ratios=[1, 1.3])
        _strip(left, entropy, log=False)
        left.set_ylabel("entropy (nats)")
        left.set_title("Entropy of the next token")
        if large:
            right.hist(list(top1.values()), bins=np.linspace(0, 1, 41), color="tab:purple")
            right.set_ylabel("prompts")
            right.set_title(f"Top-1 probability across {len(top1)} prompts")
        else:
            y = np.arange(len(labels))[::-1]
            right.barh(y, [top1[p] for p in s.ids if p in top1], color="tab:purple", height=0.7)
            right.set_yticks(y, labels, fontsize=8)
            right.set_title("Top-1 probability per prompt")
        right.set_xlim(0, 1)
        right.set_xlabel(f"probability of the top-1 id at T = {t:g}")
        right.grid(axis="x", alpha=0.3)
        save(fig, out("plots/set_next_token.png"))
    right_panel = f"the top-1 probability at T = {t:g} across the prompts, a histogram in 40 bins" if large else \
        f"each prompt's top-1 probability at T = {t:g}, labelled with its id and first words"
    return Figure("set_next_token", "plots/set_next_token.png", "plots/set_next_token.csv",
                  f"Left: the entropy of each prompt's next-token distribution per temperature. Right: "
                  f"{right_panel}.")


def loops(out: Callable[[str], Path], s: overview.SetInputs, font: Fonts) -> Figure:
    import matplotlib
    rates = overview.loop_rates(s.runs or [])
    write_csv(out("plots/set_loops.csv"), ["branch", "kv_cache", "runs", "loops", "rate"],
               [[r["branch"], r["kv_cache"], r["runs"], r["loops"], float(r["rate"])] for r in rates])
    with matplotlib.rc_context(rc(font)):
        fig = new_figure()
        ax = fig.add_subplot()
        x = np.arange(len(rates))
        bars = ax.bar(x, [r["rate"] for r in rates], color=["tab:orange" if r["kv_cache"] else "tab:blue"
                                                             for r in rates], edgecolor="black", linewidth=0.4)
        ax.bar_label(bars, labels=[f"{r['loops']} of {r['runs']}" for r in rates], padding=2)
        ax.set_xticks(x, [f"{r['branch']}\nKV cache {'on' if r['kv_cache'] else 'off'}" for r in rates])
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("share of prompts whose run ends in a loop")
        ax.set_title(f"Loop rate per branch across {len(s.ids)} prompts")
        ax.grid(axis="y", alpha=0.3)
        save(fig, out("plots/set_loops.png"))
    return Figure("set_loops", "plots/set_loops.png", "plots/set_loops.csv",
                  "The share of prompts whose continuation ends in a loop (a tail repeating at least two full "
                  "periods), per branch and cache mode.")


def draw(s: overview.SetInputs, out: Callable[[str], Path], font: Fonts) -> list[Figure]:
    """The figures across prompts, for a set of at least two (one prompt has no distribution)."""
    if len(s.ids) < 2:
        return []
    figs = []
    temps = s.temperatures()
    if s.probs:
        nucleus_name = overview.nucleus_filter(s.filters(), set(s.probs[0]))
        if nucleus_name:
            figs.append(nucleus(out, s, nucleus_name, font))
        figs.append(next_token(out, s, overview.shown_temperature(temps), font))
    if s.runs:
        figs.append(loops(out, s, font))
    return figs
