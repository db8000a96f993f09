"""The probs stage's tables: FP64 probabilities per temperature, filtered sets, a summary, and
the next-token figures per prompt and temperature (prompt_metrics.parquet).

Everything is derived from the stored logits (float32 holding the exact bf16 values), so
the audit can recompute every number bit for bit from `logits.parquet` alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from pipeline.config.schema import ProbsConfig, SamplingConfig
from pipeline.errors import UserError, bad_value
from pipeline.numerics.aggregates import PROBS_KEYS, probs_set_metrics
from pipeline.numerics.exactsum import fsum
from pipeline.numerics.sampling import (
    Distributions,
    SamplingSettings,
    check_temperature,
    largest_logit,
    ranks,
    top_order,
)
from pipeline.store import logits_io, paths
from pipeline.store.artifacts import (
    parquet_facts,
    read_json,
    read_once,
    read_parquet,
    tables_stored,
)


def prob_column(t: float) -> str:
    """Column name of the FP64 probabilities at temperature t: p_T0_5, p_T1, p_T2."""
    return "p_T" + f"{t:g}".replace(".", "_").replace("-", "m")


@dataclass(frozen=True)
class NamedFilter:
    name: str
    settings: SamplingSettings


def filters(probs: ProbsConfig, sampling: SamplingConfig) -> list[NamedFilter]:
    """The configured sampling filter first, then the extra demonstrations."""
    out = [NamedFilter("sampling", SamplingSettings(sampling.temperature, sampling.top_k, sampling.top_p))]
    out += [NamedFilter(f.name, SamplingSettings(f.temperature, f.top_k, f.top_p)) for f in probs.extra_filters]
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise bad_value("probs.extra_filters", names, "distinct names (and not 'sampling')")
    return out


def resolve_positions(requested: tuple[int, ...], n_positions: int, available: list[int]) -> list[int]:
    """Prompt positions to tabulate; negative counts from the end of the prompt."""
    out = []
    for p in requested:
        if not -n_positions <= p < n_positions:
            raise bad_value("probs.positions", p, f"a prompt position in [{-n_positions}, {n_positions - 1}]")
        pos = p % n_positions
        if pos not in available:
            raise bad_value("probs.positions", p, f"a position with stored logits: {available} "
                            f"(capture.positions=last stores only the last one)")
        out.append(pos)
    return sorted(set(out))


def check_finite(position: int, row: np.ndarray) -> None:
    """NaN and +inf are refused; -inf is a masked id (probability 0), as `generate` treats it."""
    bad = np.flatnonzero(np.isnan(row) | (row == np.inf))
    if bad.size:
        raise UserError(f"logits at position {position} are not finite for {bad.size} ids "
                        f"(first: {bad[:5].tolist()}): the model produced NaN/Inf (NaN or +inf; -inf, a masked id, "
                        f"is allowed); no probabilities computed")
    if not np.isfinite(row).any():
        raise UserError(f"logits at position {position} are -inf for every id: the model masked them all; "
                        f"no probabilities computed")


def check_temperatures(probs_cfg: ProbsConfig, named: list[NamedFilter], largest: float) -> None:
    """Every temperature that divides float32 logits must keep them finite (see
    `sampling.check_temperature`): the filters' and the tables' (whose FP32 path divides too)."""
    for f in named:
        key = "sampling.temperature" if f.name == "sampling" else f"probs.extra_filters.{f.name}.temperature"
        check_temperature(key, f.settings.temperature, largest)
    for t in probs_cfg.temperatures:
        check_temperature("probs.temperatures", t, largest, greedy=False)


def position_table(position: int, row: np.ndarray, temperatures: tuple[float, ...],
                   dist: Distributions | None = None) -> tuple[pa.Table, dict]:
    """table.parquet rows of one position, and its probability tables by temperature (`dist`: the row's
    `Distributions`, shared with the rest of `build`)."""
    logits = torch.from_numpy(row)
    dist = dist or Distributions(logits)
    tables = {t: dist.table(t) for t in temperatures}
    cols = {
        "position": pa.array(np.full(row.size, position, np.int32)),
        "token_id": pa.array(np.arange(row.size, dtype=np.int32)),
        "logit": pa.array(row.astype(np.float32)),
        "rank": pa.array(ranks(logits).astype(np.int32)),
    }
    cols.update({prob_column(t): pa.array(tables[t].p64) for t in temperatures})
    return pa.table(cols), tables


# ---------------------------------------------------------------- table.parquet: stored or derived
def table_mode(probs_cfg: ProbsConfig, n_prompts: int) -> str:
    """`stored` or `derived`: `probs.table` resolved for a run of `n_prompts` prompts (`auto`: stored for
    one prompt, derived for a set). The probs manifest's `facts.table` records it."""
    if probs_cfg.table != "auto":
        return probs_cfg.table
    return "stored" if n_prompts == 1 else "derived"


DERIVABLE = (paths.TABLE, paths.FILTERED)    # the full-vocabulary files `probs.table` stores or derives
DERIVED_NOTE = "derived.json"                # in their folders when derived (no partition there)


def derived_note(item: tuple[str, str]) -> dict:
    return {"file": item[1], "stored": False,
            "why": "probs.table resolved to derived (auto: a set): re-derived bit for bit from logits.parquet "
                   "when read", "read": "from pipeline.api import open_run; open_run('.')."
                   + ("probs()" if item == paths.TABLE else "filtered()") + "  (docs/artifacts.md)"}


def derive_table(logits_path: Path, positions: list[int], temperatures: list[float] | tuple[float, ...]) -> pa.Table:
    """table.parquet of one prompt, from its logits.parquet, by the stage's own `position_table` (the
    positions ascending, as `build` tabulates them): what a reader of a run with `probs.table=derived`
    gets in place of the file, bit for bit the table the stage would have stored."""
    return pa.concat_tables([position_table(pos, logits_io.read_position(logits_path, pos), tuple(temperatures))[0]
                             for pos in sorted(positions)])


def derive_filtered(logits_path: Path, positions: list[int], named: list[NamedFilter]) -> pa.Table:
    """filtered.parquet of one prompt, from its logits.parquet, by the stage's own `add_filtered`: what a
    reader of a run with `probs.table=derived` gets in place of the file, bit for bit."""
    kept: dict[str, list] = {n: [] for n in FILTERED_SCHEMA.names}
    for pos in sorted(positions):
        add_filtered(pos, logits_io.read_position(logits_path, pos), named, kept, [])
    return pa.table(kept, schema=FILTERED_SCHEMA)


def config_filters(config: dict) -> list[NamedFilter]:
    """`filters` of a probs manifest's config (its `probs` section and sampling temperature / top_k / top_p)."""
    s = config["sampling"]
    return [NamedFilter("sampling", SamplingSettings(s["temperature"], s["top_k"], s["top_p"]))] + \
        [NamedFilter(f["name"], SamplingSettings(f["temperature"], f["top_k"], f["top_p"]))
         for f in config["probs"]["extra_filters"]]


def read_table(find, prompt_id: str, manifest: dict, item: tuple[str, str] = paths.TABLE) -> pa.Table:
    """One prompt's table.parquet (or `item=paths.FILTERED`, filtered.parquet) as a table, stored or
    derived (`manifest`: the probs stage's). `find(item, prompt_id)` gives a file's path
    (`paths.lookup(root)`, or `StageRun.use`, which records it as an input): the file itself, or the
    logits.parquet and summary.json (its positions) it is derived from, with the manifest's temperatures
    and filters."""
    if item not in DERIVABLE:
        raise ValueError(f"{item[1]} is not one of the probs files a run may derive")
    if tables_stored(manifest):
        return read_parquet(find(item, prompt_id))
    positions = read_json(find(paths.PROBS_SUMMARY, prompt_id))["positions"]
    if item == paths.FILTERED:
        return derive_filtered(find(paths.LOGITS, prompt_id), positions, config_filters(manifest["config"]))
    return derive_table(find(paths.LOGITS, prompt_id), positions, manifest["facts"]["temperatures"])


def add_filtered(position: int, row: np.ndarray, named: list[NamedFilter], kept: dict[str, list] | None,
                 entries: list[dict], dist: Distributions | None = None) -> None:
    """filtered.parquet's rows of every filter at one position, appended to `kept` (column -> values; None:
    a derived run's, which stores no rows), and each filter's summary.json entry to `entries`."""
    dist = dist or Distributions(torch.from_numpy(row))
    for flt in named:
        rows, entry = filtered_rows(position, row, flt, dist, rows=kept is not None)
        for k, v in rows.items():
            kept[k] += v
        entries.append(entry)


def filtered_rows(position: int, row: np.ndarray, flt: NamedFilter, dist: Distributions,
                  rows: bool = True) -> tuple[dict, dict]:
    """filtered.parquet rows for one filter at one position (none without `rows`), and its summary entry."""
    s = flt.settings
    figures = dist.kept_figures(s)      # the same for a single prompt and a set: no order of the kept ids needed
    if rows:
        kept = dist.kept(s)
        rows = {
            "position": [position] * kept.count, "filter": [flt.name] * kept.count,
            "temperature": [s.temperature] * kept.count, "top_k": [s.top_k] * kept.count,
            "top_p": [s.top_p] * kept.count, "kept_rank": list(range(1, kept.count + 1)),
            "token_id": kept.ids.tolist(), "logit": row[kept.ids].astype(np.float32).tolist(),
            "prob_before": kept.prob_before.tolist(), "prob_after": kept.prob_after.tolist(),
        }
    else:                               # a set: no rows stored
        rows = {}
    summary = {
        "position": position, "filter": flt.name, "temperature": s.temperature, "top_k": s.top_k,
        "top_p": s.top_p, "kept_count": figures.count, "kept_mass": figures.mass,
        "renormalised_sum_error": figures.renormalised_sum_error,
        # top-p minimality: without its last kept id, the set must fall below p.
        "mass_without_last_kept": figures.mass_without_last,
        "top_id": figures.top_id, "top_prob_after": figures.top_prob_after,
    }
    return rows, summary


FILTERED_SCHEMA = pa.schema([
    ("position", pa.int32()), ("filter", pa.string()), ("temperature", pa.float64()), ("top_k", pa.int32()),
    ("top_p", pa.float64()), ("kept_rank", pa.int32()), ("token_id", pa.int32()), ("logit", pa.float32()),
    ("prob_before", pa.float64()), ("prob_after", pa.float64()),
])


def temperature_summary(position: int, row: np.ndarray, dist: Distributions, temperatures: tuple[float, ...],
                        top_n: int, tolerance32: float, tolerance64: float, vocab: dict[int, str]) -> list[dict]:
    """Per temperature: top-N candidates, the rest mass, entropy, sums and their verdicts."""
    order = top_order(torch.from_numpy(row), top_n)          # rank_order(row)[:top_n]
    out = []
    for t in temperatures:
        tab, entropy = dist.table(t), dist.entropy_nats(t)
        top = [{"token_id": int(i), "text": vocab.get(int(i)), "logit": float(row[i]), "prob": float(tab.p64[i])}
               for i in order]
        out.append({
            "position": position, "temperature": t, "top": top,
            "rest": fsum(np.delete(tab.p64, order)),   # every id not in `top`
            "entropy_nats": entropy, "entropy_bits": entropy / math.log(2),
            "sum_error_fp64": tab.sum_err64, "sum_error_fp32": tab.sum_err32,
            "fp64_within_tolerance": tab.sum_err64 <= tolerance64,
            "fp32_within_tolerance": tab.sum_err32 <= tolerance32,
        })
    return out


def sweep_metrics(dist: Distributions, sampling_filter: dict) -> dict:
    """The figures a sweep compares (DVC metrics, columns of `dvc exp show`): the configured filter
    at the last probability position, under short names so a sweep's table fits a terminal. `kept`
    and `mass` (the ids the filter keeps and their probability), `top_bits` (the top candidate's
    probability in bits, -log2 p: DVC prints it faithfully at any size, where `dvc metrics show`
    rounds p = 1.3876e-05 to 1e-05; after renormalising it is p / mass) and `entropy` (nats, as every
    `entropy` of the project: prompt_metrics.parquet, lens_summary.parquet, the report, the API; it was
    bits here, under the same name, issue 50). The per-temperature detail stays in summary.json and the
    report. Temperature 0 is greedy: its distribution is reported at T = 1, as the filter's.
    """
    s = sampling_filter
    t = s["temperature"] if s["temperature"] > 0 else 1.0
    return {"kept": s["kept_count"], "mass": s["kept_mass"], "top_bits": bits(float(dist.p64(t).max())),
            "entropy": dist.entropy_nats(t)}


def bits(p: float) -> float:
    """-log2 p (0 for p = 1, not -0)."""
    return -math.log2(p) + 0.0


# ---------------------------------------------------------------- prompt_metrics.parquet
def metrics_schema(named: list[NamedFilter]) -> pa.Schema:
    """prompt_metrics.parquet's columns: the keys, the distribution's figures, then per filter
    `<filter>_kept` (ids kept) and `<filter>_mass` (their FP64 probability before renormalising)."""
    return pa.schema([("prompt_id", pa.string()), ("position", pa.int32()), ("temperature", pa.float64()),
                      ("entropy", pa.float64()), ("top1_id", pa.int32()), ("top1_text", pa.string()),
                      ("top1_prob", pa.float64())]
                     + [c for f in named for c in ((f"{f.name}_kept", pa.int32()), (f"{f.name}_mass", pa.float64()))])


def at_temperature(flt: NamedFilter, t: float) -> SamplingSettings:
    """A filter's top_k and top_p after temperature t instead of its own; a greedy filter (T = 0)
    stays greedy: it keeps the argmax, its mass reported at T = 1 as in summary.json."""
    s = flt.settings
    return s if s.is_greedy else SamplingSettings(t, s.top_k, s.top_p)


def metric_filters(named: list[NamedFilter], temperatures: tuple[float, ...]) -> list[SamplingSettings]:
    """The filter settings `prompt_metrics` asks of the last position's row: every filter at every temperature."""
    return [at_temperature(f, t) for t in sorted(temperatures) for f in named]


def prompt_metrics(prompt_id: str, position: int, row: np.ndarray, temperatures: tuple[float, ...],
                   named: list[NamedFilter], vocab: dict[int, str], dist: Distributions | None = None) -> pa.Table:
    """One row per temperature (ascending) of one prompt's next-token distribution (`row`: the
    logits at its last position): entropy in nats, the top-1 id (rank 1: highest logit, lower id
    on ties) and its FP64 probability, and each filter's kept count and mass, by the very
    computations of summary.json (`Distributions.entropy_nats`) and filtered.parquet (`Distributions.kept`;
    `dist`: the row's, shared with the rest of `build`)."""
    logits = torch.from_numpy(row)
    dist, top1 = dist or Distributions(logits), int(top_order(logits, 1)[0])
    dist.prefetch(metric_filters(named, temperatures))
    rows = []
    for t in sorted(temperatures):
        rec = {"prompt_id": prompt_id, "position": position, "temperature": t, "entropy": dist.entropy_nats(t),
               "top1_id": top1, "top1_text": vocab.get(top1), "top1_prob": float(dist.p64(t)[top1])}
        for f in named:
            count, mass = dist.kept_count_and_mass(at_temperature(f, t))
            rec |= {f"{f.name}_kept": count, f"{f.name}_mass": mass}
        rows.append(rec)
    return pa.Table.from_pylist(rows, schema=metrics_schema(named))


def prompt_id(tokenize_summary: Path) -> str:
    """The prompt's id as the tokenize stage recorded it."""
    recorded = read_json(tokenize_summary).get("prompt_id")
    if not isinstance(recorded, str) or not recorded:
        raise UserError(f"{tokenize_summary} records no prompt_id (edited or corrupt?): re-run `dvc repro tokenize`")
    return recorded


@read_once
def read_vocab(vocab_path: Path) -> dict[int, str]:
    """vocab.parquet as {token_id: text}, read once per process and file version (`read_once`: 152k ids for
    Qwen, which a set's prompts would each read again). Shared: read only."""
    table = read_parquet(vocab_path, columns=["token_id", "text"])
    return dict(zip(table["token_id"].to_pylist(), table["text"].to_pylist()))


# ---------------------------------------------------------------- the stage's outputs
KEEP_ROWS = 2       # `build` keeps the rows it checked when it tabulates at most this many positions (else re-reads)


def build(logits_path: Path, vocab_path: Path, probs_cfg: ProbsConfig, sampling_cfg: SamplingConfig,
          tokenize_summary: Path, kind: str = "stored") -> tuple[dict[tuple[str, str], Any], dict]:
    """Every output of the probs stage (artifact item -> table or JSON object) and its facts.

    One function for the stage and for `nexttoken audit`, which re-derives a past run's files
    with these same calls and compares them bit for bit. prompt_metrics.parquet takes the
    prompt's id from its tokenize.json (`tokenize_summary`). `kind` (of table.parquet, `table_mode`): `derived`
    leaves table.parquet out of the outputs (readers re-derive it: `read_table`).
    """
    named = filters(probs_cfg, sampling_cfg)
    facts = parquet_facts(logits_path)
    positions = resolve_positions(probs_cfg.positions, facts["n_positions"], facts["positions"])
    vocab = read_vocab(vocab_path)
    if len(vocab) != facts.get("output_size"):
        raise UserError(f"{vocab_path} lists {len(vocab)} ids but {logits_path} holds {facts.get('output_size')} "
                        "per position: they come from different models; re-run `dvc repro`")
    last_prompt = facts["n_positions"] - 1                     # the next-token distribution's row
    largest, rows = 0.0, {}             # rows: position -> its logits, read once while few (capture.positions=last)
    for pos in sorted(set(positions) | {last_prompt}):   # refuse before any work
        row = logits_io.read_position(logits_path, pos)
        check_finite(pos, row)
        largest = max(largest, largest_logit(row))
        if len(positions) <= KEEP_ROWS:
            rows[pos] = row
    check_temperatures(probs_cfg, named, largest)
    tables, kept, summary = [], {n: [] for n in FILTERED_SCHEMA.names}, {"temperatures": [], "filters": []}
    dists = {}                          # position -> its row's Distributions, each softmax / filter once
    for pos in positions:               # ascending
        row = rows[pos] if pos in rows else logits_io.read_position(logits_path, pos)
        dist = Distributions(torch.from_numpy(row))
        dist.prefetch([f.settings for f in named]     # the summary's filters, and at the last position the metrics'
                      + (metric_filters(named, probs_cfg.temperatures) if pos == last_prompt else []))
        if pos in (positions[-1], last_prompt):     # read again below; the others' tables are let go
            dists[pos] = dist
        if kind == "stored":            # derived: the same tables, without the full-vocabulary rows and ranks
            tables.append(position_table(pos, row, probs_cfg.temperatures, dist)[0])
        summary["temperatures"] += temperature_summary(
            pos, row, dist, probs_cfg.temperatures, probs_cfg.top_n, probs_cfg.fp32_sum_tolerance,
            probs_cfg.fp64_sum_tolerance, vocab)
        add_filtered(pos, row, named, kept if kind == "stored" else None, summary["filters"], dist)
    last = positions[-1]
    sampling_filter = next(f for f in summary["filters"] if f["position"] == last and f["filter"] == "sampling")
    outputs = {**({paths.TABLE: pa.concat_tables(tables)} if kind == "stored" else {}),
               **({paths.FILTERED: pa.table(kept, schema=FILTERED_SCHEMA)} if kind == "stored" else {}),
               paths.PROBS_SUMMARY: {"positions": positions, **summary},
               paths.PROBS_METRICS: sweep_metrics(dists[last], sampling_filter)}
    # this prompt as a set of one: its set keys (a set's: `pipeline.record.probs`)
    last_row = rows[last_prompt] if last_prompt in rows else logits_io.read_position(logits_path, last_prompt)
    outputs[paths.PROBS_PROMPT_METRICS] = prompt_metrics(
        prompt_id(tokenize_summary), last_prompt, last_row, probs_cfg.temperatures, named, vocab,
        dists.get(last_prompt) or Distributions(torch.from_numpy(last_row)))
    outputs[paths.PROBS_METRICS] = run_metrics([outputs[paths.PROBS_METRICS]])
    return outputs, {"model": facts.get("model"), "positions": positions, "rows_per_position": len(vocab),
                     "temperatures": list(probs_cfg.temperatures), "table": kind,
                     "logits_content_sha256": facts.get("logits_content_sha256")}


def set_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """prompt_metrics.parquet of a set: every prompt's rows (`prompt_metrics`' as Python dicts), sorted by
    (prompt_id, temperature)."""
    return pa.Table.from_pylist(rows, schema=schema).sort_by([("prompt_id", "ascending"), ("temperature", "ascending")])


def run_metrics(per_prompt: list[dict]) -> dict:
    """probs/metrics.json: `sweep_metrics` of the run's last prompt (kept, mass, top_bits, entropy: a set of
    one's figures, unchanged) and the set keys over every prompt's sweep figures, in run order."""
    return {**{k: v for k, v in per_prompt[-1].items() if k not in PROBS_KEYS}, **probs_set_metrics(per_prompt)}
