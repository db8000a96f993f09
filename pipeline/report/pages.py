"""The explorer pages of a run: what each page needs beyond the report's Inputs, read from the artifacts,
and the pages written (`pipeline.report.explorer` renders them).

The detailed prompt's page is artifacts/report/explorer.html; a set's other prompts get
explorer-<id>.html beside it, up to MAX_PAGES (the first ids in the run's order), each page linking
every other. Reads stream: the logits one position (row group) at a time, the attention weights
tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from pipeline.model.names import act_name
from pipeline.report import equivalence, explorer, explorer_walk, overview
from pipeline.report.render import Inputs, filtered_rows
from pipeline.store import logits_io, paths, safetensors_io, variant_logits
from pipeline.store.artifacts import read_json, read_parquet, tables_stored

MAX_PAGES = 32      # pages a set gets; the overview in report.md covers every prompt


def file_names(ids: list[str], chosen: str) -> dict[str, str]:
    """prompt id -> page file, the detailed prompt first and on explorer.html."""
    shown = [chosen] + [pid for pid in sorted(ids) if pid != chosen][:MAX_PAGES - 1]
    return {pid: paths.EXPLORER[1] if pid == chosen else f"explorer-{pid}.html" for pid in shown}


def _kept(use: overview.Use, inp: Inputs) -> dict[str, np.ndarray]:
    if tables_stored(inp.manifests.get("probs", {})):
        rows = read_parquet(use(paths.FILTERED, inp.prompt_id), columns=["position", "filter", "token_id"],
                            filters=[("position", "=", inp.position)])
    else:       # a derived filtered.parquet (`probs.table`)
        rows = filtered_rows(use, inp.prompt_id, inp.manifests)
        rows = rows.filter(pc.field("position") == inp.position)
    names, ids = rows["filter"].to_numpy(zero_copy_only=False), rows["token_id"].to_numpy()
    return {name: ids[names == name] for name in dict.fromkeys(names.tolist())}


def _positions(use: overview.Use, inp: Inputs) -> list[tuple[int, np.ndarray]]:
    path = use(paths.LOGITS, inp.prompt_id)
    have = logits_io.positions_in(path)
    return [(p, inp.logits if p == inp.position else logits_io.read_position(path, p))
            for p in have[-explorer.MAX_POSITIONS:]]


def _attention(use: overview.Use, inp: Inputs) -> dict[int, tuple[int, np.ndarray]]:
    path = use(paths.CAPTURE, inp.prompt_id)
    tensors, _ = safetensors_io.header(path)
    out = {}
    for layer in range(inp.facts["num_layers"]):
        name = act_name("attn_weights", layer)
        if name in tensors:
            w = safetensors_io.read(path, name)[0]                  # [heads, T, T] as float32
            offset = max(0, w.shape[-1] - explorer.MAX_ATTENTION)
            out[layer] = (offset, np.ascontiguousarray(w[:, offset:, offset:]))
    return out


def _vocab_text(use: overview.Use, ids: set[int]) -> dict[int, str]:
    rows = read_parquet(use(paths.VOCAB), columns=["token_id", "text"],
                        filters=[("token_id", "in", sorted(ids))]).to_pylist()
    return {r["token_id"]: r["text"] or "" for r in rows}


LENS_TOP = 5            # candidates per lens cell on hover
LENS_POSITIONS = 64     # lens grid columns: the last ones


def _lens_rows(use: overview.Use, inp: Inputs) -> list[dict]:
    """lens.parquet's top LENS_TOP rows of the shown positions; none where the lens stage did not run."""
    if inp.lens is None:
        return []
    keep = sorted({r["position"] for r in inp.lens.summary})[-LENS_POSITIONS:]
    return read_parquet(use(paths.LENS, inp.prompt_id), filters=[("rank", "<=", LENS_TOP),
                                                               ("position", "in", keep)]).to_pylist()


def _lens(inp: Inputs, rows: list[dict], text: dict[int, str]) -> dict | None:
    """The lens heatmap's cells: per layer and position the top-1 text and FP64 probability, the top 5, and the
    rank of the model's final top-1 id there."""
    if inp.lens is None:
        return None
    positions = sorted({r["position"] for r in rows})
    layers = sorted({r["layer"] for r in rows})
    top: dict[tuple[int, int], list] = {}
    for r in sorted(rows, key=lambda r: r["rank"]):
        top.setdefault((r["layer"], r["position"]), []).append([text.get(r["token_id"], ""), r["prob"]])
    rank = {(s["layer"], s["position"]): s["final_top1_rank"] for s in inp.lens.summary}
    return {"layers": layers, "positions": positions,
            "cells": [[{"text": top[(li, p)][0][0], "p": top[(li, p)][0][1], "top5": top[(li, p)],
                        "final_rank": rank.get((li, p))} for p in positions] for li in layers]}


def _variants(use: overview.Use, inp: Inputs) -> tuple[list[dict] | None, dict | None]:
    """The prompt's equivalence rows and its variants' logits at the page's position (None, None: the
    equivalence stage did not run for it; it writes variant_logits.parquet beside every equivalence.parquet)."""
    rows = equivalence.load(use, inp.prompt_id)
    if rows is None:
        return None, None
    return rows, variant_logits.read(use(paths.VARIANT_LOGITS, inp.prompt_id), positions=[inp.position])


def _internals(use: overview.Use, inp: Inputs) -> dict:
    """The walk's figures from inside the model: the residual stream's norm after each layer (the capture) and the
    LM head's row of the top id with its dot product (the prepared snapshot's weights: the prepare_model manifest
    the report declares holds their sha256, so a change of weights re-runs the report)."""
    capture, top = use(paths.CAPTURE, inp.prompt_id), int(explorer.logit_order(inp.logits)[0])
    source = use(paths.SOURCE)
    # where the model loads from, as the stages resolve it (loader.snapshot_dir, without torch): a hub or local
    # model is used in place, its weights at source.json's snapshot_dir; a prepared one beside source.json
    weights = Path(read_json(source).get("snapshot_dir") or source.parent)
    return {"norms": explorer_walk.resid_norms(capture, int(inp.facts.get("num_layers") or 0), inp.position),
            "head": explorer_walk.head_row(weights, capture, inp.facts, inp.position, top)}


def page(use: overview.Use, inp: Inputs, files: dict[str, str], language: str = "en") -> str:
    """One prompt's page, rendered (explanations in `language` at opening: report.language)."""
    positions = _positions(use, inp)
    lens_rows = _lens_rows(use, inp)
    eq_rows, variants = _variants(use, inp)
    ids = {int(i) for i in explorer.logit_order(inp.logits)[:explorer.TOP_IDS]}
    ids |= {int(i) for _, row in positions for i in explorer.logit_order(row)[:explorer.TOP_PER_POSITION]}
    ids |= {r["token_id"] for r in lens_rows} | explorer.equivalence_ids(variants, inp.position)
    ids |= {int(i) for r in inp.steps for i in (r["token_id"], *r["top_ids"])}     # the trajectories' picks
    text = _vocab_text(use, ids)
    filters = [f for f in inp.summary["filters"] if f["position"] == inp.position]
    data = explorer.page_data(inp, pages=files, filters=filters, kept=_kept(use, inp), positions=positions,
                              internals=_internals(use, inp),
                              attention=_attention(use, inp), vocab_text=text, lens=_lens(inp, lens_rows, text),
                              equivalence=explorer.equivalence_data(inp.logits, inp.position, eq_rows, variants, text),
                              language=language)
    return explorer.render_page(data)


def write(use: overview.Use, out: Callable[[str], Path], detailed: Inputs, ids: list[str],
          load: Callable[[str], Inputs], language: str = "en") -> dict[str, str]:
    """Every page of the run (the detailed prompt's from `detailed`, the others through `load(id)`); the files."""
    files = file_names(ids, detailed.prompt_id)
    for pid, name in files.items():
        inp = detailed if pid == detailed.prompt_id else load(pid)
        out(name).write_text(page(use, inp, files, language), encoding="utf-8")
    return files
