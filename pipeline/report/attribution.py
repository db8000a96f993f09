"""The report's "why this token" section: the logit parts of the top-1 and of its lead over the runner-up,
and the prompt coloured by input attribution.

From the attribution stage's tables only (`logit_parts.parquet`, `inputs.parquet`, nothing recomputed but
sums and differences of their rows, in FP64): the parts that moved the top-1's logit most, the parts that
decide the pick (top-1 minus top-2, part by part: `numerics.parts_table.top1_differences`), the same per
layer as a bar chart (attention and MLP), and each prompt token's integrated-gradients attribution to the
top-1's logit, as a table and as the prompt's tokens shaded by it. A run where the stage did not run, or
did not attribute this prompt (`attribution.prompts`), gets a line saying so.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.numerics import parts_table
from pipeline.report import plots
from pipeline.report.markdown import code, figure, name, src, table
from pipeline.report.plots import Figure, Fonts
from pipeline.store import paths
from pipeline.store.artifacts import read_json, read_parquet

TOP_PARTS = 10          # rows of each parts table
TOP_INPUTS = 10         # rows of the input-attribution table (the figure shades every token)
IG = "integrated_gradients"
LINE = 48.0            # the prompt figure's line width, in axis units (_width)


@dataclass(frozen=True)
class AttributionInputs:
    parts: pd.DataFrame         # logit_parts.parquet (may be empty: a family the split is not written for)
    inputs: pd.DataFrame        # inputs.parquet
    reason: str | None          # the stage's one line where the split does not apply
    prompt_id: str

    @property
    def top1(self) -> int:
        return int(self.inputs["target_token_id"].iloc[0])

    def candidates(self) -> list[int]:
        """The split candidates, the model's logit descending (ties by lower id), as the stage chose them."""
        logits = self.parts.groupby("token_id")["logit"].first()
        return [int(i) for i in sorted(logits.index, key=lambda i: (-logits[i], i))]


def load(use: Callable[..., Path], prompt_id: str, root: Path | str = ".") -> AttributionInputs | str:
    """The prompt's attribution tables (recorded as inputs through `use`), or the line saying why there are
    none: the stage has not run, or it did not attribute this prompt."""
    manifest = paths.manifest_path(paths.LOGIT_PARTS[0], root)
    if not manifest.exists():
        return (f"`{paths.dataset(paths.LOGIT_PARTS).as_posix()}` is missing: the attribution stage has not run "
                "(`dvc repro attribution`).")
    if not paths.partition(paths.LOGIT_PARTS, prompt_id, root).exists():
        done = sorted(p.name.split("=", 1)[1] for p in paths.dataset(paths.LOGIT_PARTS, root).glob("prompt_id=*"))
        return (f"The attribution stage did not attribute prompt {name(prompt_id)} (it attributed "
                f"{', '.join(name(p) for p in done) or 'none'}: `attribution.prompts` chooses).")
    reason = read_json(use(manifest)).get("facts", {}).get("logit_parts")
    return AttributionInputs(read_parquet(use(paths.LOGIT_PARTS, prompt_id)).to_pandas(),
                             read_parquet(use(paths.INPUTS, prompt_id)).to_pandas(),
                             reason if isinstance(reason, str) and reason != "recorded" else None, prompt_id)


def token_ids(attr: AttributionInputs | str) -> set[int]:
    """The ids the section names (their text comes from vocab.parquet)."""
    if isinstance(attr, str):
        return set()
    return set(attr.candidates()) | {attr.top1}


def _label(row) -> str:
    if pd.isna(row["layer"]):
        return row["component"]
    return f"layer {int(row['layer'])} " + ("MLP" if pd.isna(row["head"]) and row["component"].endswith("mlp")
                                           else f"head {int(row['head'])}" if not pd.isna(row["head"])
                                           else row["component"].rsplit(".", 1)[-1])


def _largest(df: pd.DataFrame, value: str, n: int) -> pd.DataFrame:
    """The n rows of largest |value|, largest first (ties: the table's order)."""
    order = np.argsort(-df[value].abs().to_numpy(), kind="stable")[:n]
    return df.iloc[order]


def section(attr: AttributionInputs | str, text: Callable[[int], str], pieces: list[str],
            figures: dict[str, Figure]) -> list[str]:
    out = ["## 10. Why this token (attribution)", ""]
    if isinstance(attr, str):
        return out + [attr, ""]
    parts_src, inputs_src = src(paths.LOGIT_PARTS, attr.prompt_id), src(paths.INPUTS, attr.prompt_id)
    if attr.parts.empty:
        out += [f"No logit parts for this model: {attr.reason or 'the split does not apply'}.", ""]
    else:
        cands = attr.candidates()
        top1, position = cands[0], int(attr.parts["position"].iloc[0])
        mine = attr.parts[attr.parts["token_id"] == top1]
        total = float(mine["contribution"].sum())
        out += [f"The logit of the top-1, {top1} {text(top1)}, at position {position} (the last prompt position), "
                "written as a sum of the residual stream's parts: the embeddings, each attention head's output and "
                "each MLP's output, through the final norm with its scale frozen at the recorded value and the LM "
                f"head's row, in FP64. The {len(mine)} parts sum to {total:.6g}; the logit recomputed in FP64 from "
                f"the recorded final-norm output is {float(mine['logit_fp64'].iloc[0]):.6g} and the model's own "
                f"is {float(mine['logit'].iloc[0]):.6g} (the stage's checks bound the gap). Largest parts:", ""]
        out += table(["part", "component", "contribution"],
                     [[_label(r), name(r["component"]), f"{r['contribution']:+.6g}"]
                      for _, r in _largest(mine, "contribution", TOP_PARTS).iterrows()], parts_src)
        if len(cands) > 1:
            diffs = parts_table.top1_differences(attr.parts)
            second = cands[1]
            lead = diffs[diffs["token_id"] == second]
            out += [f"What decides the pick: the top-1's lead over the runner-up {second} {text(second)}, "
                    f"{float(lead['difference'].sum()):.6g} logits, part by part (a part's contribution to the "
                    "top-1 minus its contribution to the runner-up; positive parts favour the top-1):", ""]
            out += table(["part", "component", "top-1 minus runner-up"],
                         [[_label(r), name(r["component"]), f"{r['difference']:+.6g}"]
                          for _, r in _largest(lead, "difference", TOP_PARTS).iterrows()], parts_src)
        if "attribution_layers" in figures:
            out += figure(figures["attribution_layers"])
    ig = attr.inputs[attr.inputs["method"] == IG].sort_values("source_position")
    if not ig.empty:
        r0 = ig.iloc[0]
        diff = float(r0["logit_input"] - r0["logit_baseline"])
        out += [f"Which prompt tokens the top-1's logit depends on: integrated gradients over the input embeddings "
                "(float32 model; baseline: the pad token at every position, <bos> kept), each token's share of "
                f"logit(input) - logit(baseline) = "
                f"{float(r0['logit_input']):.6g} - {float(r0['logit_baseline']):.6g} = {diff:.6g}; the shares sum "
                f"to {float(ig['attribution'].sum()):.6g} (the completeness check in "
                f"`{paths.artifact(paths.ATTRIBUTION_CHECKS).as_posix()}` says how close). Attribution is not "
                "causation: it says how the logit moves along a straight path from the baseline, not what the "
                "model would do without a token. Largest shares:", ""]
        out += table(["position", "token", "integrated gradients", "input x gradient"],
                     [[int(r["source_position"]), code(pieces[int(r["source_position"])]),
                       f"{r['attribution']:+.6g}", f"{_ixg(attr.inputs, int(r['source_position'])):+.6g}"]
                      for _, r in _largest(ig, "attribution", TOP_INPUTS).iterrows()], inputs_src)
        if "attribution_inputs" in figures:
            out += figure(figures["attribution_inputs"])
    return out


def _width(label: str) -> float:
    """A label's width on the prompt figure, in axis units (a Latin character about 0.6, a wide CJK one 1.1),
    with the box's padding."""
    return 0.9 + sum(1.1 if unicodedata.east_asian_width(c) in "WF" else 0.62 for c in label)


def _ixg(inputs: pd.DataFrame, position: int) -> float:
    row = inputs[(inputs["method"] == "input_x_gradient") & (inputs["source_position"] == position)]
    return float(row["attribution"].iloc[0]) if len(row) else float("nan")


def draw(out: Callable[[str], Path], attr: AttributionInputs | str, pieces: list[str], text: Callable[[int], str],
         font: Fonts) -> list[Figure]:
    """The per-layer bar chart of the top-1's parts and the prompt shaded by integrated gradients."""
    if isinstance(attr, str):
        return []
    figs = []
    if not attr.parts.empty:
        figs.append(_layers(out, attr, text, font))
    ig = attr.inputs[attr.inputs["method"] == IG].sort_values("source_position")
    if not ig.empty:
        figs.append(_prompt(out, ig, pieces, font))
    return figs


def _layers(out: Callable[[str], Path], attr: AttributionInputs, text: Callable[[int], str], font: Fonts) -> Figure:
    import matplotlib
    top1 = attr.candidates()[0]
    layers = parts_table.by_layer(attr.parts[attr.parts["token_id"] == top1])
    rows = [[int(r["position"]), int(r["token_id"]), "" if pd.isna(r["layer"]) else int(r["layer"]), r["kind"],
             float(r["contribution"])] for _, r in layers.iterrows()]
    plots.write_csv(out("plots/attribution_layers.csv"), ["position", "token_id", "layer", "kind", "contribution"],
                    rows)
    n = int(layers["layer"].max()) + 1 if layers["layer"].notna().any() else 0
    grid = {(int(r["layer"]), r["kind"]): float(r["contribution"]) for _, r in layers.iterrows()
            if not pd.isna(r["layer"])}
    outside = [(r["kind"], float(r["contribution"])) for _, r in layers.iterrows() if pd.isna(r["layer"])]
    with matplotlib.rc_context(plots.rc(font)):
        fig = plots.new_figure()
        ax = fig.add_subplot()
        x = np.arange(n)
        ax.bar(x - 0.2, [grid.get((i, "attn"), 0.0) for i in x], 0.4, label="attention (heads summed)",
               color="#4C72B0")
        ax.bar(x + 0.2, [grid.get((i, "mlp"), 0.0) for i in x], 0.4, label="MLP", color="#DD8452")
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(x, [str(i) for i in x], fontsize=8)
        ax.set_xlabel("layer")
        ax.set_ylabel("contribution to the logit (FP64)")
        extra = ", ".join(f"{k} {v:+.3g}" for k, v in outside)
        ax.set_title(font.drawable(f"Parts of the top-1 logit ({top1}) by layer" + (f"; {extra}" if extra else "")))
        ax.legend(loc="best", fontsize=9)
        plots.save(fig, out("plots/attribution_layers.png"))
    return Figure("attribution_layers", "plots/attribution_layers.png", "plots/attribution_layers.csv",
                  "Why this token: each layer's attention and MLP contribution to the top-1's logit (final norm "
                  "scale frozen at the recorded value); the embeddings and other parts outside a layer are in the "
                  "title and the CSV.")


def _prompt(out: Callable[[str], Path], ig: pd.DataFrame, pieces: list[str], font: Fonts) -> Figure:
    """The prompt's tokens as boxes in reading order, wrapped, each shaded by its IG share (red: raises the
    top-1's logit, blue: lowers it; the scale is symmetric about 0)."""
    import matplotlib
    from matplotlib.colors import TwoSlopeNorm
    values = ig["attribution"].to_numpy(dtype=np.float64)
    plots.write_csv(out("plots/attribution_inputs.csv"), ["source_position", "piece", "integrated_gradients"],
                    [[int(p), pieces[int(p)], float(v)] for p, v in zip(ig["source_position"], values)])
    span = float(np.abs(values).max()) or 1.0
    norm, cmap = TwoSlopeNorm(0.0, -span, span), matplotlib.colormaps["coolwarm"]
    labels = [font.drawable(pieces[int(p)].replace("\n", "\\n")) or " " for p in ig["source_position"]]
    widths = [_width(label) for label in labels]
    lines: list[list[int]] = [[]]
    used = 0.0
    for i, w in enumerate(widths):
        if used + w > LINE and lines[-1]:
            lines.append([])
            used = 0.0
        lines[-1].append(i)
        used += w
    with matplotlib.rc_context(plots.rc(font)):
        fig = plots.new_figure((9.0, 1.0 + 0.5 * len(lines)))
        ax = fig.add_subplot()
        ax.set_axis_off()
        ax.set_xlim(0, LINE + 1)
        ax.set_ylim(len(lines), 0)
        for row, members in enumerate(lines):
            x = 0.0
            for i in members:
                ax.text(x + 0.1, row + 0.5, labels[i], fontsize=12, va="center", ha="left",
                        bbox={"boxstyle": "round,pad=0.25", "facecolor": cmap(norm(values[i])), "edgecolor": "none"})
                x += widths[i]
        fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, orientation="horizontal",
                     fraction=0.08, pad=0.02, label="integrated gradients: share of the top-1's logit")
        plots.save(fig, out("plots/attribution_inputs.png"))
    return Figure("attribution_inputs", "plots/attribution_inputs.png", "plots/attribution_inputs.csv",
                  "The prompt, each token shaded by its integrated-gradients share of the top-1's logit (red raises "
                  "it, blue lowers it).")
