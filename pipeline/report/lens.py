"""The report's logit-lens section: a table per layer at the last position and a layer x position heatmap.

From lens.parquet and lens_summary.parquet only (nothing recomputed): per layer, the lens's top-1
id and its FP64 probability, and the rank and probability of the model's final top-1 id; the
heatmap colours each (layer, position) by that final id's probability, its CSV beside it.
A run where the lens stage did not run has no lens folder: the section says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.model.names import act_name
from pipeline.report import plots
from pipeline.report.markdown import figure, name, prob, src, table
from pipeline.report.plots import Figure, Fonts
from pipeline.store import paths
from pipeline.store.artifacts import read_parquet

TICKS = 40      # at most this many labelled positions / layers on the heatmap


@dataclass(frozen=True)
class LensInputs:
    top1: list[dict]        # lens.parquet rows with rank 1
    summary: list[dict]     # lens_summary.parquet rows
    prompt_id: str

    @property
    def last(self) -> int:
        return max(r["position"] for r in self.summary)

    def at_last(self) -> list[tuple[dict, dict]]:
        """(top-1 row, summary row) per layer at the last captured position, layer order."""
        top = {r["layer"]: r for r in self.top1 if r["position"] == self.last}
        return [(top[s["layer"]], s) for s in sorted(self.summary, key=lambda s: s["layer"])
                if s["position"] == self.last]


def load(use: Callable[..., Path], prompt_id: str, root: Path | str = ".") -> LensInputs | None:
    """The prompt's lens tables (recorded as inputs through `use`); None when the run has no lens stage."""
    if not paths.manifest_path(paths.LENS[0], root).exists():
        return None
    top1 = read_parquet(use(paths.LENS, prompt_id), filters=[("rank", "=", 1)]).to_pylist()
    return LensInputs(top1, read_parquet(use(paths.LENS_SUMMARY, prompt_id)).to_pylist(), prompt_id)


def residual(layer: int) -> str:
    """The capture name lens layer `layer` reads (pipeline.model.lens.residual_names)."""
    return act_name("resid_pre", 0) if layer == 0 else act_name("resid_post", layer - 1)


def token_ids(lens: LensInputs | None) -> set[int]:
    """The ids the section names (their text comes from vocab.parquet)."""
    if lens is None:
        return set()
    return {t["token_id"] for t, _ in lens.at_last()} | {s["final_top1_id"] for _, s in lens.at_last()}


def section(lens: LensInputs | None, text: Callable[[int], str], figures: dict[str, Figure]) -> list[str]:
    out = ["## 9. Logit lens", ""]
    if lens is None:
        return out + [f"`{paths.dataset(paths.LENS).as_posix()}` is missing: the lens stage has not run "
                      "(`dvc repro lens`).", ""]
    rows = [(t, s) for t, s in lens.at_last()]
    n = len(rows) - 1
    final = rows[-1][1]["final_top1_id"]
    cells = [[s["layer"], name(residual(s["layer"])),
              f"{t['token_id']} {text(t['token_id'])}", prob(t["prob"]), s["final_top1_rank"],
              prob(s["final_top1_prob"]), f"{s['kl_final']:.4g}", f"{s['entropy']:.4f}"] for t, s in rows]
    out += [f"Each layer's residual stream at position {lens.last} (the last captured one) through the model's own "
            f"final norm (that layer's own statistics) and LM head, FP64 softmax over every output id. Layer 0 is "
            f"`{act_name('resid_pre', 0)}` (the embeddings as the first block receives them), layer {n} the last "
            f"block's output, whose top-1 is the model's own next token, {final} {text(final)}.", ""]
    out += table(["layer", "residual", "lens top-1", "its probability", "rank of the final token",
                  "final token's probability", "KL(final ‖ layer) (nats)", "entropy (nats)"], cells,
                 [src(paths.LENS, lens.prompt_id), src(paths.LENS_SUMMARY, lens.prompt_id)])
    return out + (figure(figures["lens"]) if "lens" in figures else [])


def heatmap(out: Callable[[str], Path], lens: LensInputs, font: Fonts) -> Figure:
    """Layers (rows) x positions (columns), coloured by the probability of the model's final top-1 id."""
    import matplotlib
    layers = sorted({s["layer"] for s in lens.summary})
    positions = sorted({s["position"] for s in lens.summary})
    grid = np.full((len(layers), len(positions)), np.nan)
    for s in lens.summary:
        grid[layers.index(s["layer"]), positions.index(s["position"])] = s["final_top1_prob"]
    plots.write_csv(out("plots/lens.csv"), ["layer", "position", "final_top1_id", "final_top1_rank",
                                            "final_top1_prob", "kl_final", "entropy"],
                    [[s["layer"], s["position"], s["final_top1_id"], s["final_top1_rank"], float(s["final_top1_prob"]),
                      float(s["kl_final"]), float(s["entropy"])]
                     for s in sorted(lens.summary, key=lambda s: (s["layer"], s["position"]))])
    with matplotlib.rc_context(plots.rc(font)):
        fig = plots.new_figure()
        ax = fig.add_subplot()
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0,
                          interpolation="nearest")
        if len(positions) <= TICKS:         # longer prompts: matplotlib's own ticks (column i is position i)
            ax.set_xticks(range(len(positions)), [str(p) for p in positions], fontsize=8)
        if len(layers) <= TICKS:
            ax.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize=8)
        ax.set_xlabel("prompt position")
        ax.set_ylabel("lens layer (0 = embeddings, L = last block)")
        ax.set_title("Logit lens: probability of the model's final top-1 id at each layer")
        fig.colorbar(image, ax=ax, label="probability (FP64 softmax over every output id)")
        plots.save(fig, out("plots/lens.png"))
    return Figure("lens", "plots/lens.png", "plots/lens.csv",
                  "Logit lens: each (layer, position) coloured by the probability the layer's lens gives the id the "
                  "model finally ranks first there (the last row is the model's own distribution).")
