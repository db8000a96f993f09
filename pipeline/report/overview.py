"""The report's view of the whole prompt set: one overview line per prompt and the numbers the
distribution plots draw, from the run-level tables.

Sources: each prompt's tokenize.json (text, token count), probs/prompt_metrics.parquet (one row per
prompt and temperature), trajectories/prompt_metrics.parquet (one row per prompt, branch and cache
mode) and checks.parquet (per prompt when it has a `prompt_id` column; a checks.parquet recorded
before that column belongs to the run's one prompt). `load` reads them once, recording each as an
input; everything else here is a pure function of those rows, so the unit tests feed hand-built tables.
The run's order is its prompt ids sorted: the order of its partitions and of both prompt_metrics tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.checks import verdicts
from pipeline.numerics.aggregates import aggregate_temperature
from pipeline.report.markdown import code, name, prob, src, table
from pipeline.store import paths
from pipeline.store.artifacts import read_json, read_parquet

Use = Callable[..., Path]        # StageRun.use(item, prompt_id=None): records an input, returns its path
UPSTREAM = ("prepare_model", "tokenize", "forward", "logits", "probs", "trajectories", "checks")
EXCERPT = 40                     # characters of a prompt's text or a continuation shown in the overview
GREEDY, SAMPLE = "greedy", "sample"


@dataclass(frozen=True)
class SetInputs:
    """The run-level rows the overview and the set plots show, read once."""

    ids: list[str]                             # the run's prompts, sorted
    manifests: dict[str, dict]                 # stage -> manifest.json, for the stages present
    tokenize: dict[str, dict]                  # prompt id -> its tokenize.json
    probs: list[dict] | None                   # probs/prompt_metrics.parquet rows; None when probs has not run
    runs: list[dict] | None                    # trajectories/prompt_metrics.parquet rows; None likewise
    # checks.parquet rows, each with its prompt_id ("": run-wide); None when the checks stage has not run
    checks: list[dict] | None

    def temperatures(self) -> list[float]:
        """probs.temperatures as configured (the probs manifest), else those of the rows, ascending."""
        cfg = self.manifests.get("probs", {}).get("config", {}).get("probs", {})
        return list(cfg.get("temperatures") or sorted({r["temperature"] for r in self.probs or []}))

    def filters(self) -> list[dict]:
        """The filters prompt_metrics.parquet has columns for: `sampling` and probs.extra_filters."""
        cfg = self.manifests.get("probs", {}).get("config", {})
        sampling = cfg.get("sampling")
        extra = list(cfg.get("probs", {}).get("extra_filters") or [])
        return ([{"name": "sampling", **sampling}] if sampling else []) + extra


def load(use: Use, ids: list[str], root: Path | str = ".") -> SetInputs:
    """Read the set-level artifacts the report shows; those of a stage that has not run are None."""
    def table_rows(item: tuple[str, str]) -> list[dict] | None:
        return read_parquet(use(item)).to_pylist() if paths.artifact(item, root).exists() else None
    manifests = {s: read_json(use(paths.manifest_path(s))) for s in UPSTREAM if paths.manifest_path(s, root).exists()}
    checks = None
    if paths.artifact(paths.CHECKS, root).exists():
        checks = list(verdicts.stored_rows(read_parquet(use(paths.CHECKS))).values())
    return SetInputs(ids=list(ids), manifests=manifests,
                     tokenize={p: read_json(use(paths.TOKENIZE_SUMMARY, p)) for p in ids},
                     probs=table_rows(paths.PROBS_PROMPT_METRICS), runs=table_rows(paths.TRAJECTORY_PROMPT_METRICS),
                     checks=checks)


# ---------------------------------------------------------------- what is shown
def shown_temperature(temperatures: list[float]) -> float:
    """The temperature the set aggregates are taken at (`aggregates.aggregate_temperature`: T = 1 when
    configured, else the lowest), so the overview and metrics.json speak of the same distribution."""
    return aggregate_temperature(temperatures)


def nucleus_filter(filters: list[dict], columns: set[str]) -> str | None:
    """The first pure top-p filter (top_k off, top_p < 1) the table has a kept column for: its kept
    count at each temperature is the nucleus size; None when no filter is one."""
    return next((f["name"] for f in filters if f.get("top_k") == 0 and f.get("top_p", 1.0) < 1.0
                 and f"{f['name']}_kept" in columns), None)


def run_row(runs: list[dict], prompt_id: str, branch: str) -> dict | None:
    """A prompt's row of one branch: the full-prefix run (the reference path) when recorded, else the KV-cache one."""
    mine = sorted((r for r in runs if r["prompt_id"] == prompt_id and r["branch"] == branch),
                  key=lambda r: r["kv_cache"])
    return mine[0] if mine else None


def check_counts(checks: list[dict] | None, ids: list[str]) -> dict[str, tuple[int, int]] | None:
    """Per prompt (pass, fail) counts of its checks. Rows of no prompt of the run (null or "": checks over the
    whole run) count for none. None when there are no checks, or none of them is a prompt's."""
    out = {p: (0, 0) for p in ids}
    if checks is None or not any(c[paths.PARTITION_KEY] in out for c in checks):
        return None
    for c in checks:
        p = c[paths.PARTITION_KEY]
        if p in out:
            ok, bad = out[p]
            out[p] = (ok + 1, bad) if c["verdict"] == "pass" else (ok, bad + 1)
    return out


def excerpt(text: str | None, n: int = EXCERPT) -> str | None:
    return None if text is None else text[:n] + ("…" if len(text) > n else "")


def rows(s: SetInputs) -> list[dict]:
    """One overview row per prompt, in the run's order."""
    temps = s.temperatures()
    t = shown_temperature(temps) if temps else None
    nucleus = nucleus_filter(s.filters(), set(s.probs[0]) if s.probs else set())
    counts = check_counts(s.checks, s.ids)
    out = []
    for p in s.ids:
        tok = s.tokenize[p]
        nt = next((r for r in s.probs or [] if r["prompt_id"] == p and r["temperature"] == t), None)
        greedy = run_row(s.runs or [], p, GREEDY)
        sample = run_row(s.runs or [], p, SAMPLE)
        out.append({
            "prompt_id": p, "text": tok["prompt"], "n_tokens": tok["n_tokens"], "temperature": t,
            "top1_id": nt and nt["top1_id"], "top1_text": nt and nt["top1_text"],
            "top1_prob": nt and nt["top1_prob"], "entropy": nt and nt["entropy"],
            "nucleus_filter": nucleus, "nucleus": nt[f"{nucleus}_kept"] if nt and nucleus else None,
            "greedy_text": greedy and greedy["text"], "greedy_loop": greedy and greedy["loop"],
            "greedy_period": greedy["loop_period"] if greedy and greedy["loop"] else None,
            "diverge": sample and sample["diverge"],
            "checks": None if counts is None else counts[p]})
    return out


# ---------------------------------------------------------------- plot data
def by_temperature(s: SetInputs, column: str) -> list[tuple[float, list[tuple[str, float]]]]:
    """(T, [(prompt id, value of `column`)]) for each configured temperature, ascending; prompts in the run's order."""
    at = {(r["prompt_id"], r["temperature"]): r[column] for r in s.probs or []}
    return [(t, [(p, at[p, t]) for p in s.ids if (p, t) in at]) for t in sorted(s.temperatures())]


def loop_rates(runs: list[dict]) -> list[dict]:
    """Per (branch, kv_cache): the runs, how many end in a loop, and their share."""
    groups: dict[tuple[str, bool], list[bool]] = {}
    for r in runs:
        groups.setdefault((r["branch"], r["kv_cache"]), []).append(bool(r["loop"]))
    return [{"branch": b, "kv_cache": kv, "runs": len(v), "loops": sum(v), "rate": sum(v) / len(v)}
            for (b, kv), v in sorted(groups.items())]


# ---------------------------------------------------------------- Markdown
def section(s: SetInputs, chosen: str, figures: list[list[str]]) -> list[str]:
    """The overview: a table with one line per prompt, then the figures across prompts."""
    rs = rows(s)
    t, nucleus = rs[0]["temperature"], rs[0]["nucleus_filter"]
    head = ["prompt", "text", "tokens", f"top-1 at T = {t:g}" if t is not None else "top-1", "p(top-1)",
            "entropy (nats)", f"{nucleus} kept" if nucleus else "top-p kept", "greedy continuation", "greedy loop",
            "sample leaves greedy at", "checks pass / fail"]
    cells = [[name(r["prompt_id"]) + (" (detail below)" if r["prompt_id"] == chosen else ""), code(excerpt(r["text"])),
              r["n_tokens"], "-" if r["top1_id"] is None else f"{r['top1_id']} {code(r['top1_text'])}",
              "-" if r["top1_prob"] is None else prob(r["top1_prob"]),
              "-" if r["entropy"] is None else f"{r['entropy']:.4f}", "-" if r["nucleus"] is None else r["nucleus"],
              "-" if r["greedy_text"] is None else code(excerpt(r["greedy_text"])), _loop(r),
              "-" if r["diverge"] is None else ("never" if r["diverge"] == 0 else f"step {r['diverge']}"),
              _checks(r["checks"], s.checks is not None)] for r in rs]
    every = paths.dataset(paths.TOKENIZE_SUMMARY) / f"{paths.PARTITION_KEY}=*" / paths.TOKENIZE_SUMMARY[1]
    sources = [every.as_posix(), src(paths.PROBS_PROMPT_METRICS),
               src(paths.TRAJECTORY_PROMPT_METRICS)] + ([src(paths.CHECKS)] if s.checks is not None else [])
    intro = "One line per prompt, in the order of their ids."
    if t is not None:
        intro += f" The next token (last prompt position) at T = {t:g}"
        intro += f"; the nucleus: the ids `{nucleus}` (top_k off, top_p < 1) keeps at that T." if nucleus else "."
    intro += (" Greedy and sample runs without the KV cache (the full-prefix reference path) where recorded; a loop "
              "is a tail repeating at least two full periods. Checks: the prompt's rows of checks.parquet (checks "
              f"over the whole run count for no prompt). The detail below is of {name(chosen)} (`report.prompt_id`).")
    return [f"## Prompts of this run ({len(rs)})", "", intro, ""] + table(head, cells, sources) + \
        [line for f in figures for line in f]


def _loop(r: dict) -> str:
    if r["greedy_loop"] is None:
        return "-"
    return f"yes, period {r['greedy_period']}" if r["greedy_loop"] else "no"


def _checks(counts: tuple[int, int] | None, ran: bool) -> str:
    if counts is None:
        return "n/a" if ran else "-"
    return f"{counts[0]} / {counts[1]}" if counts[1] == 0 else f"{counts[0]} / **{counts[1]}**"
