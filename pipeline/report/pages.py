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

from pipeline.model.names import act_name
from pipeline.report import explorer, overview
from pipeline.report.render import Inputs
from pipeline.store import logits_io, paths, safetensors_io
from pipeline.store.artifacts import read_parquet

MAX_PAGES = 32      # pages a set gets; the overview in report.md covers every prompt


def file_names(ids: list[str], chosen: str) -> dict[str, str]:
    """prompt id -> page file, the detailed prompt first and on explorer.html."""
    shown = [chosen] + [pid for pid in sorted(ids) if pid != chosen][:MAX_PAGES - 1]
    return {pid: paths.EXPLORER[1] if pid == chosen else f"explorer-{pid}.html" for pid in shown}


def _kept(use: overview.Use, inp: Inputs) -> dict[str, np.ndarray]:
    rows = read_parquet(use(paths.FILTERED, inp.prompt_id), columns=["position", "filter", "token_id"],
                        filters=[("position", "=", inp.position)])
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


def page(use: overview.Use, inp: Inputs, files: dict[str, str], lens: dict | None = None) -> str:
    """One prompt's page, rendered."""
    positions = _positions(use, inp)
    ids = {int(i) for i in explorer.logit_order(inp.logits)[:explorer.TOP_IDS]}
    ids |= {int(i) for _, row in positions for i in explorer.logit_order(row)[:explorer.TOP_PER_POSITION]}
    filters = [f for f in inp.summary["filters"] if f["position"] == inp.position]
    data = explorer.page_data(inp, pages=files, filters=filters, kept=_kept(use, inp), positions=positions,
                              attention=_attention(use, inp), vocab_text=_vocab_text(use, ids), lens=lens)
    return explorer.render_page(data)


def write(use: overview.Use, out: Callable[[str], Path], detailed: Inputs, ids: list[str],
          load: Callable[[str], Inputs]) -> dict[str, str]:
    """Every page of the run (the detailed prompt's from `detailed`, the others through `load(id)`); the files."""
    files = file_names(ids, detailed.prompt_id)
    for pid, name in files.items():
        inp = detailed if pid == detailed.prompt_id else load(pid)
        out(name).write_text(page(use, inp, files), encoding="utf-8")
    return files
