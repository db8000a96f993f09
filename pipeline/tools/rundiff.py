"""`nexttoken diff A B`: explain how two runs differ, from their recorded files.

Sections: config (dotted params.yaml keys that differ), environment (library versions,
hardware, dtype, device), the kernel path (one line: which fields differ), then per prompt
(a run is a set of prompts; prompts pair by id, those only one run holds are named at the end):
the capture (the first diverging tensor in forward order, its max |Δ| and where), numbers (max
|Δlogit| per prompt position, the largest probability change per temperature, kept counts per
filter), trajectories (per branch, the first step whose chosen id differs, with both
candidates' probabilities), the prompt_metrics rows that differ (by temperature, by branch) and
the check verdicts that differ (`pipeline.tools.prompt_tables`). Two runs of one prompt each are
compared whatever their ids; on different prompts at their last prompt positions, aligned from
the end (the next-token distributions), and the diff says the prompts differ.
A and B are each a git revision, an experiment name or `workspace`, read as
`pipeline.tools.revisions` reads them. The comparisons are functions over tensors, tables and
summaries (`pipeline.numerics.divergence`, `kept_lines_from`, `trajectory_lines_from`), shared
with `nexttoken verify`; nothing here imports torch at import time (verify pins the kernels
before torch loads).
"""

from __future__ import annotations

import math
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import schema
from pipeline.config.compose import diff_keys
from pipeline.numerics.divergence import (
    capture_order,
    divergence_line,
    first_diverging_tensor,
    kernel_difference_line,
    recorded_kernels,
)
from pipeline.store import paths, provenance
from pipeline.store.artifacts import read_json, read_manifest, read_safetensors, tables_stored
from pipeline.tools import prompt_tables, revisions


def cli(args) -> int:
    print("\n".join(diff(Path.cwd(), args.rev_a, args.rev_b)))
    return 0


def diff(repo: Path, rev_a: str, rev_b: str) -> list[str]:
    ra, rb = revisions.resolve(repo, rev_a), revisions.resolve(repo, rev_b)
    with ExitStack() as stack:
        a, b = (stack.enter_context(revisions.open_run(repo, r)) for r in (ra, rb))
        return compare(a, b, f"diff A={ra}  B={rb}")


def compare(a: Path, b: Path, head: str) -> list[str]:
    """The diff's lines for the runs in folders a and b (laid out as the workspace)."""
    revisions.load_manifests(a), revisions.load_manifests(b)   # both must hold a run (a clear error if not)
    pairs, only = prompt_pairs(a, b)
    tables_a, tables_b = ({item: prompt_tables.prompt_metrics(r, item) for item in prompt_tables.ROW_KEYS}
                          for r in (a, b))
    checks_a, checks_b = prompt_tables.checks(a), prompt_tables.checks(b)
    out = [head, *config_lines(a, b), *environment_lines(a, b, *(pairs or [(None, None)])[0]),
           kernel_line(a, b)]
    for ia, ib in pairs:
        out += [f"prompt {ia}:" if ia == ib else f"prompt {ia} | {ib}:"] if len(pairs) > 1 or ia != ib else []
        out += [capture_line(a, b, ia, ib), *number_lines(a, b, ia, ib), *trajectory_lines(a, b, ia, ib)]
        for item in prompt_tables.ROW_KEYS:
            out += prompt_tables.metric_lines(item, prompt_tables.of_prompt(tables_a[item], ia),
                                              prompt_tables.of_prompt(tables_b[item], ib))
        out += prompt_tables.check_lines(prompt_tables.of_prompt(checks_a, ia),
                                         prompt_tables.of_prompt(checks_b, ib))
    return out + only


def prompt_pairs(a: Path, b: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """The prompts compared, (id in A, id in B): those both runs hold, by id; two runs of one prompt
    each are compared whatever their ids. Then a line per prompt only one run holds."""
    ia, ib = paths.run_prompt_ids(a), paths.run_prompt_ids(b)
    if len(ia) == 1 and len(ib) == 1:
        return [(ia[0], ib[0])], []
    pairs = [(i, i) for i in ia if i in ib]
    return pairs, [f"prompt {i}: only in {side}" for side, ids, other in (("A", ia, ib), ("B", ib, ia))
                   for i in ids if i not in other]


# ---------------------------------------------------------------- config
def config_differences(a: Path, b: Path) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in A, value in B) for every params.yaml key that differs."""
    pa_, pb = schema.read_params(a / paths.PARAMS), schema.read_params(b / paths.PARAMS)
    return [(k, revisions.dotted(pa_, k), revisions.dotted(pb, k)) for k in diff_keys(pa_, pb)]


def config_lines(a: Path, b: Path) -> list[str]:
    diffs = config_differences(a, b)
    return [f"config: {len(diffs)} key(s) differ" if diffs else "config: identical params.yaml",
            *(f"  config {k}: {_show(x)} | {_show(y)}" for k, x, y in diffs)]


def _show(v: Any, width: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= width else text[:width - 1] + "…"


# ---------------------------------------------------------------- environment
def environment_lines(a: Path, b: Path, ia: str | None, ib: str | None) -> list[str]:
    ea, eb = (revisions.recorded_environment(revisions.load_manifests(r)) for r in (a, b))
    keys = sorted(k for k in set(ea) | set(eb) if ea.get(k) != eb.get(k))
    out = [f"environment: {len(keys)} recorded version/hardware value(s) differ" if keys
           else "environment: same recorded versions and hardware"]
    out += [f"  environment {k}: {_one(ea.get(k))} | {_one(eb.get(k))}" for k in keys]
    for what, key in (("dtype", "compute_dtype"), ("device", "device")):
        va, vb = _forward_fact(a, key, ia), _forward_fact(b, key, ib)
        out.append(f"  {what}: {va} | {vb}" + (" (same)" if va == vb else "  <- differs"))
    return out


def _one(values: list | None) -> str:
    if values is None:
        return "<not recorded>"
    return str(values[0]) if len(values) == 1 else f"mixed {values}"


def _forward_fact(root: Path, key: str, pid: str | None) -> Any:
    path = paths.partition(paths.FORWARD_FACTS, pid, root)
    return read_json(path).get(key, "<not recorded>") if path.exists() else "<no forward run>"


# ---------------------------------------------------------------- kernel path and capture
def kernel_line(a: Path, b: Path) -> str:
    return kernel_difference_line(*(recorded_kernels(revisions.load_manifests(r)) for r in (a, b)))


def capture_line(a: Path, b: Path, ia: str | None, ib: str | None) -> str:
    pa_, pb = paths.partition(paths.CAPTURE, ia, a), paths.partition(paths.CAPTURE, ib, b)
    if not (pa_.exists() and pb.exists()):
        return "capture: not in both runs"
    ta, tb = read_safetensors(pa_), read_safetensors(pb)
    n = _forward_fact(a, "n_positions", ia)
    d = first_diverging_tensor(ta, tb, capture_order(pa_), n if isinstance(n, int) else None)
    return divergence_line(d, len(ta))


# ---------------------------------------------------------------- numbers
class Alignment:
    """Which position of B is compared with a position of A. The same prompt: the same position.
    Different prompts: the last prompt positions are aligned (A's last with B's last: the next-token
    distributions), and only positions counted from the end that both prompts have are compared."""

    def __init__(self, a: Path, b: Path, pa_: str | None, pb: str | None):
        self.files = (lambda item: paths.partition(item, pa_, a), lambda item: paths.partition(item, pb, b))
        self.roots, self.prompts = (a, b), (pa_, pb)
        ia, ib = _token_ids(self.files[0]), _token_ids(self.files[1])
        self.same = ia == ib
        self.lengths = (len(ia or []), len(ib or []))
        self.offset = 0 if self.same or ia is None or ib is None else len(ib) - len(ia)

    def b_of(self, pos_a: int) -> int:
        return pos_a + self.offset

    def label(self, pos_a: int) -> str:
        return f"position {pos_a}" if not self.offset else f"position {pos_a} | {self.b_of(pos_a)}"

    def lines(self) -> list[str]:
        if self.same:
            return []
        na, nb = self.lengths
        return [f"  prompts differ (A {na} tokens, B {nb}): positions aligned at the last prompt position "
                f"(A {na - 1} | B {nb - 1}: the next-token distributions); earlier ones hold other prefixes"]


def _token_ids(file) -> list[int] | None:
    path = file(paths.TOKENS)
    return pq.read_table(path, columns=["token_id"])["token_id"].to_pylist() if path.exists() else None


def number_lines(a: Path, b: Path, ia: str | None, ib: str | None) -> list[str]:
    align = Alignment(a, b, ia, ib)
    return ["numbers:", *align.lines(), *logit_lines(align), *probability_lines(align), *kept_lines(align)]


def _same_file(align: Alignment, item: tuple[str, str]) -> bool | None:
    pa_, pb = (f(item) for f in align.files)
    if not (pa_.exists() and pb.exists()):
        return None
    return provenance.sha256_file(pa_) == provenance.sha256_file(pb)


def _by_position(path: Path | pa.Table, column: str) -> dict[int, np.ndarray]:
    """position -> the column's values ordered by token id (files are sorted that way)."""
    t = path.select(["position", "token_id", column]) if isinstance(path, pa.Table) else \
        pq.read_table(path, columns=["position", "token_id", column])
    pos, values = t["position"].to_numpy(), t[column].to_numpy().astype(np.float64)
    return {int(p): values[pos == p] for p in np.unique(pos)}


def logit_lines(align: Alignment) -> list[str]:
    fa, fb = align.files
    same = _same_file(align, paths.LOGITS)
    if same is None:
        return ["  logits: not in both runs"]
    la = _by_position(fa(paths.LOGITS), "logit")
    if same:
        return [f"  logits: identical {paths.LOGITS[1]} (same sha256): max |Δlogit| = 0 at all {len(la)} positions"]
    lb = _by_position(fb(paths.LOGITS), "logit")
    head = "per position" if align.same else "at the aligned last position (A | B)"
    out, same_at = [f"  logits: max |Δlogit| {head} (token id of the largest change)"], 0
    # different prompts: the last positions only (the next-token distributions); the rest are other prefixes
    pairs = [(p, align.b_of(p)) for p in sorted(la)] if align.same else \
        [(p, align.b_of(p)) for p in sorted(la)[-1:]]
    for p, q in pairs:
        if q not in lb or la[p].shape != lb[q].shape:
            out.append(f"    {align.label(p)}: not comparable (only in one run, or another vocabulary size)")
            continue
        d = np.abs(la[p] - lb[q])
        if d.max() == 0:
            same_at += 1
        else:
            out.append(f"    {align.label(p)}: {d.max():.6g} (token {int(d.argmax())}: {la[p][d.argmax()]:g} | "
                       f"{lb[q][d.argmax()]:g})")
    only = len(set(lb) - {q for _, q in pairs}) if align.same else 0
    return out + ([f"    0 at the other {same_at} positions"] if same_at else []) + \
        ([f"    {only} position(s) only in B"] if only else [])


def _tables(align: Alignment) -> tuple[Any, Any] | None:
    """Each run's table.parquet: its path, or where the run derives it (`probs.table`), the table re-derived
    from its logits.parquet (`probs.read_table`); None when a run has neither."""
    out = []
    for root, pid, file in zip(align.roots, align.prompts, align.files):
        manifest = paths.manifest_path(paths.TABLE[0], root)
        if file(paths.TABLE).exists() or not manifest.exists() or not file(paths.LOGITS).exists():
            out.append(file(paths.TABLE) if file(paths.TABLE).exists() else None)
            continue
        from pipeline.numerics import probs  # torch: only to re-derive a table
        record = read_manifest(paths.TABLE[0], root)
        out.append(None if tables_stored(record) else probs.read_table(paths.lookup(root), pid, record))
    return None if None in out else (out[0], out[1])


def probability_lines(align: Alignment) -> list[str]:
    tables = _tables(align)
    if tables is None:
        return ["  probabilities: not in both runs"]
    if all(isinstance(t, Path) for t in tables) and _same_file(align, paths.TABLE):
        return [f"  probabilities: identical {paths.TABLE[1]} (same sha256): largest change 0 at every temperature"]
    cols = lambda t: [c for c in (t.schema if isinstance(t, pa.Table) else pq.read_schema(t)).names
                      if c.startswith("p_T")]
    fa, fb = tables
    out = ["  probabilities: largest |Δp| per temperature"]
    for col in sorted(set(cols(fa)) | set(cols(fb))):
        if col not in cols(fa) or col not in cols(fb):
            out.append(f"    {col}: only in one run")
            continue
        ta, tb = _by_position(fa, col), _by_position(fb, col)
        pairs = [(ta[p], tb[align.b_of(p)], p) for p in ta
                 if align.b_of(p) in tb and ta[p].shape == tb[align.b_of(p)].shape]
        worst = max(((float(np.abs(x - y).max()), p, int(np.abs(x - y).argmax())) for x, y, p in pairs), default=None)
        if worst is None or worst[0] == 0:
            out.append(f"    {col}: {'no common position' if worst is None else '0 (identical values)'}")
        else:
            d, p, i = worst
            out.append(f"    {col}: {d:.6g} ({align.label(p)}, token {i}: {ta[p][i]:.6g} | {tb[align.b_of(p)][i]:.6g})")
    return out


def kept_lines(align: Alignment) -> list[str]:
    def filters(file) -> list[dict]:
        path = file(paths.PROBS_SUMMARY)
        return read_json(path)["filters"] if path.exists() else []

    return kept_lines_from(*(filters(f) for f in align.files), offset=None if align.same else align.offset)


def kept_lines_from(entries_a: list[dict], entries_b: list[dict], labels: tuple[str, str] = ("A", "B"),
                    offset: int | None = None) -> list[str]:
    """Kept count per (position, filter) of two probs summaries' `filters` entries; offset (runs of
    different prompts): B's position = A's + offset, keyed by A's position."""
    fa = {(f["position"], f["filter"]): f for f in entries_a}
    fb = {(f["position"] - (offset or 0), f["filter"]): f for f in entries_b}
    a_, b_ = labels
    out = [f"  kept counts per filter ({'position' if offset is None else f'aligned positions {a_} | {b_}'}, "
           f"filter: {a_} | {b_})"]
    for key in sorted(set(fa) | set(fb)):
        x, y = fa.get(key), fb.get(key)
        where = key[0] if offset is None else f"{key[0]} | {key[0] + offset}"
        out.append(f"    {where}, {key[1]}: {_kept(x)} | {_kept(y)}"
                   + ("" if x and y and x["kept_count"] == y["kept_count"] else "  <- differs"))
    return out


def _kept(f: dict | None) -> str:
    if f is None:
        return "-"
    return f"{f['kept_count']} (T={f['temperature']:g}, k={f['top_k']}, p={f['top_p']:g}, mass {f['kept_mass']:.6g})"


# ---------------------------------------------------------------- trajectories
def _runs(root: Path, pid: str | None) -> dict[str, list[dict]]:
    path = paths.partition(paths.STEPS, pid, root)
    return runs_from_table(pq.read_table(path)) if path.exists() else {}


def runs_from_table(steps: pa.Table) -> dict[str, list[dict]]:
    """steps.parquet rows by run (branch, `_kv` with the cache), each in step order."""
    out: dict[str, list[dict]] = {}
    for row in steps.to_pylist():
        out.setdefault(row["branch"] + ("_kv" if row["kv_cache"] else ""), []).append(row)
    return {k: sorted(v, key=lambda r: r["step"]) for k, v in out.items()}


def first_divergence(a: list[dict], b: list[dict]) -> int | None:
    """Index of the first step whose chosen id differs (or where one run stopped), else None."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i]["token_id"] != b[i]["token_id"]:
            return i
    return None


def trajectory_lines(a: Path, b: Path, ia: str | None, ib: str | None) -> list[str]:
    return trajectory_lines_from(_runs(a, ia), _runs(b, ib))


def trajectory_lines_from(ra: dict[str, list[dict]], rb: dict[str, list[dict]],
                          labels: tuple[str, str] = ("A", "B")) -> list[str]:
    """Per run of two sets of trajectories (`runs_from_table`), the first step whose chosen id differs."""
    a, b = labels
    out = ["trajectories: first step where the chosen ids differ, per branch"]
    for name in sorted(set(ra) | set(rb)):
        sa, sb = ra.get(name, []), rb.get(name, [])
        i = first_divergence(sa, sb)
        if i is None:
            out.append(f"  {name}: identical ({len(sa)} steps)")
        elif i >= len(sa) or i >= len(sb):
            out.append(f"  {name}: same first {i} steps; then only {a if len(sa) > i else b} continues")
        else:
            x, y = sa[i], sb[i]
            prefix = sa[i - 1]["text_so_far"] if i else ""   # the same in both runs up to step i
            out.append(f"  {name}: diverges at step {x['step']}: {a} chose {_pick(x, y, a, b, prefix)} | "
                       f"{b} chose {_pick(y, x, b, a, prefix)}")
    return out


def _pick(row: dict, other: dict, mine: str, theirs: str, prefix: str) -> str:
    """A chosen id (and its text), its probability in its own run and (from the stored top-N) in the other."""
    tops = dict(zip(other["top_ids"] or [], other["top_probs"] or []))
    there = f"{tops[row['token_id']]:.4g} in {theirs}" if row["token_id"] in tops \
        else f"not in {theirs}'s top {len(tops)}"
    # The decoded text the step added; the raw piece where it ends inside a multi-byte character.
    text = row["text_so_far"] or ""
    shown = text[len(prefix):] if text.startswith(prefix) and "\ufffd" not in text else row["piece"]
    return f"{row['token_id']} {shown!r} (p {row['prob']:.4g} in {mine}, {there})"


# ---------------------------------------------------------------- bit-exact differences
def table_difference(stored: pa.Table, derived: pa.Table) -> str | None:
    """None when the tables are equal bit for bit (floats compared by their bits), else the first difference."""
    stored, derived = stored.replace_schema_metadata(None), derived.replace_schema_metadata(None)
    if stored.schema != derived.schema:
        return f"schema differs: stored {stored.schema.names} vs re-derived {derived.schema.names}"
    if stored.num_rows != derived.num_rows:
        return f"{stored.num_rows} rows stored, {derived.num_rows} re-derived"
    for name in stored.column_names:
        if pa.types.is_floating(stored.schema.field(name).type):
            a, b = stored[name].to_numpy(), derived[name].to_numpy()
            bits = {4: "<u4", 8: "<u8"}[a.dtype.itemsize]
            bad = (a.view(bits) != b.view(bits)).nonzero()[0]
        else:   # ints, strings, lists (steps.parquet's top-N): as Python values
            a, b = stored[name].to_pylist(), derived[name].to_pylist()
            bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if len(bad):
            i = int(bad[0])
            key = ", ".join(f"{k}={stored[k][i].as_py()}" for k in ("position", "filter", "token_id")
                            if k in stored.column_names)
            x, y = (v.item() if hasattr(v, "item") else v for v in (a[i], b[i]))   # numpy -> Python repr
            return (f"{len(bad)} value(s) differ in column {name}; first at row {i} ({key}): "
                    f"stored {x!r}, re-derived {y!r}")
    return None


def shared_keys(a: Any, b: Any, where: str = "") -> tuple[Any, Any, list[str]]:
    """Two JSON values cut to the mapping keys both have, and the dotted keys only one has."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a, b, []
    out_a, out_b, only = {}, {}, sorted(f"{where}{k}" for k in set(a) ^ set(b))
    for k in sorted(set(a) & set(b), key=str):
        out_a[k], out_b[k], deeper = shared_keys(a[k], b[k], f"{where}{k}.")
        only += deeper
    return out_a, out_b, only


def json_difference(stored: Any, derived: Any, where: str = "") -> str | None:
    """The first key path where two JSON values differ; floats must be the same bits."""
    if isinstance(stored, dict) and isinstance(derived, dict):
        for k in sorted(set(stored) | set(derived), key=str):
            if k not in stored or k not in derived:
                return f"{where}{k}: present in only one"
            d = json_difference(stored[k], derived[k], f"{where}{k}.")
            if d:
                return d
        return None
    if isinstance(stored, list) and isinstance(derived, list) and len(stored) == len(derived):
        return next((d for i, (a, b) in enumerate(zip(stored, derived))
                     if (d := json_difference(a, b, f"{where}{i}."))), None)
    if isinstance(stored, float) and isinstance(derived, float):
        same = struct.pack("<d", stored) == struct.pack("<d", derived) or (math.isnan(stored) and math.isnan(derived))
    else:
        same = stored == derived and type(stored) is type(derived)
    return None if same else f"{where.rstrip('.') or '<root>'}: stored {stored!r}, re-derived {derived!r}"
