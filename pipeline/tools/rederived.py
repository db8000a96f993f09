"""The audit's re-derivation of a run's computed files from the stored files they were computed from,
by the stages' own functions, each compared bit for bit with what the run stored.

probs: every prompt's tables, filtered sets and summary from its logits.parquet, then the set files
(metrics.json, prompt_metrics.parquet). trajectories: the set files from each prompt's
trajectories.json (the continuations themselves need the model: `nexttoken verify` re-runs them).
A file that differs is a finding; `Findings` is what the audit collects them in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from pipeline.config import schema
from pipeline.errors import UserError
from pipeline.store import paths
from pipeline.store.artifacts import read_json, read_parquet, tables_stored
from pipeline.tools.rundiff import json_difference, shared_keys, table_difference


class Findings(Protocol):
    notes: list[str]

    def find(self, area: str, what: str) -> None: ...

    def warn(self, what: str) -> None: ...


def rederive_probs(root: Path, params: dict, manifest: dict, result: Findings, same_code: bool) -> None:
    """Recompute the probs stage's files from logits.parquet exactly as stages/probs.py does, per
    prompt (its partition), then the set files from every prompt's.

    same_code: dvc.lock shows the run's code is this code; else metrics.json (DVC's metrics
    view, whose layout follows the code) is compared on the keys both layouts have."""
    recorded, items, per_prompt, figures, failed = {o["path"] for o in manifest["outputs"]}, [], [], [], False
    prompt_ids = paths.run_prompt_ids(root)
    table = "stored" if tables_stored(manifest) else "derived"     # derived: no table / filtered file to compare
    for pid in prompt_ids:
        try:
            derived = probs_outputs(root, params, pid, table)
        except Exception as e:   # tampered inputs can break a reader anywhere: that is a finding, named
            result.find("re-derive", f"probs could not be recomputed from "
                                     f"{_rel(paths.partition(paths.LOGITS, pid, root), root)}: {type(e).__name__}: {e}")
            failed = True
            continue
        figures.append(derived.pop(paths.PROBS_METRICS))      # set-level: compared once below
        per_prompt.append(derived.pop(paths.PROBS_PROMPT_METRICS))   # set-level: every prompt's rows, likewise
        items = list(derived)
        for item, want in derived.items():
            _compare(paths.lookup(root)(item, pid), want, root, recorded, result, False)
    if failed:          # the set-level files need every prompt: the finding above says why they are not compared
        return
    from pipeline.numerics import probs  # torch, as probs_outputs: only when re-deriving
    if figures:         # metrics.json: the last prompt's figures and the set's aggregates
        items.append(paths.PROBS_METRICS)
        _compare(paths.artifact(paths.PROBS_METRICS, root), probs.run_metrics(figures), root, recorded,
                 result, not same_code)
    if per_prompt:
        items.append(paths.PROBS_PROMPT_METRICS)
        want = probs.set_table([r for t in per_prompt for r in t.to_pylist()], per_prompt[0].schema)
        _compare(paths.artifact(paths.PROBS_PROMPT_METRICS, root), want, root, recorded, result, False)
    result.notes.append(f"re-derived {', '.join(i[1] for i in items)} from {paths.LOGITS[1]} "
                        f"({len(prompt_ids)} prompt(s))")
    if table == "derived":
        for item in (paths.TABLE, paths.FILTERED):
            stray = [pid for pid in prompt_ids if paths.partition(item, pid, root).exists()]
            if stray:
                result.find("re-derive", f"{item[1]} of {len(stray)} prompt(s) (first {stray[0]!r}) is on disk "
                                         "though the probs manifest records it derived (probs.table)")
        result.notes.append(f"{paths.TABLE[1]} and {paths.FILTERED[1]} are derived (probs.table): not stored, "
                            f"every reader re-derives them from {paths.LOGITS[1]} by the stage's own functions")


def rederive_trajectories(root: Path, manifest: dict, result: Findings, same_code: bool) -> None:
    """trajectories' set files (prompt_metrics.parquet, metrics.json) from each prompt's stored
    trajectories.json, by the stage's `set_files`. same_code: as for `rederive_probs` (metrics.json's layout)."""
    recorded = {o["path"] for o in manifest["outputs"]}
    from pipeline.model import trajectories  # torch: only when re-deriving
    from pipeline.numerics import probs
    summaries = []
    for pid in paths.run_prompt_ids(root):
        try:
            summaries.append((probs.prompt_id(paths.partition(paths.TOKENIZE_SUMMARY, pid, root)),
                              read_json(paths.partition(paths.TRAJECTORIES, pid, root))))
        except UserError as e:
            result.find("re-derive", f"trajectories' set files could not be recomputed: {e}")
            return
    try:
        files = trajectories.set_files(summaries)
    except Exception as e:   # a tampered summary can break the computation anywhere: a finding, named
        result.find("re-derive", f"trajectories' set files could not be recomputed from {paths.TRAJECTORIES[1]}: "
                                 f"{type(e).__name__}: {e}")
        return
    for item, want in files.items():
        _compare(paths.artifact(item, root), want, root, recorded, result,
                 item == paths.TRAJECTORIES_METRICS and not same_code)
    result.notes.append(f"re-derived {', '.join(i[1] for i in files)} from {paths.TRAJECTORIES[1]} "
                        f"({len(summaries)} prompt(s))")


def _compare(path: Path, want: Any, root: Path, recorded: set[str], result: Findings, shared: bool) -> None:
    """A stored file against its re-derivation, bit for bit (shared: on the keys both have)."""
    where = _rel(path, root)
    if where not in recorded:   # one format_version: the stage always writes it
        result.find("re-derive", f"{where} is not among the outputs the run's manifest records")
        return
    try:
        stored = read_parquet(path) if isinstance(want, pa.Table) else read_json(path)
    except UserError as e:
        result.find("re-derive", str(e))
        return
    if not isinstance(want, pa.Table):   # through JSON, as the stage wrote it (tuples -> lists)
        want = json.loads(json.dumps(want, ensure_ascii=False))
    if shared:
        stored, want, only = shared_keys(stored, want)
        if only:
            result.warn(f"{where}: {len(only)} key(s) only in the run's layout or only in this code's "
                        f"({', '.join(only[:3])}{', ...' if len(only) > 3 else ''}): made by other "
                        "code, or by code dvc.lock cannot show; the keys both have are compared")
    diff = table_difference(stored, want) if isinstance(want, pa.Table) else json_difference(stored, want)
    if diff:
        result.find("re-derive", f"{where}: {diff}")


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def probs_outputs(root: Path, params: dict, prompt_id: str, table: str = "stored") -> dict[tuple[str, str], Any]:
    """One prompt's probs tables and JSON, recomputed by the stage's own function from its stored
    logits, the run's vocab.parquet and the prompt's tokenize.json (what the stage read); `table`: the
    run's table mode (derived: no table.parquet among them)."""
    from pipeline.numerics import probs
    outputs, _ = probs.build(paths.partition(paths.LOGITS, prompt_id, root), paths.artifact(paths.VOCAB, root),
                             schema.load_section(params, "probs"), schema.load_section(params, "sampling"),
                             paths.partition(paths.TOKENIZE_SUMMARY, prompt_id, root), table)
    return outputs
