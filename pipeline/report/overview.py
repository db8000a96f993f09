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
from pipeline.store.artifacts import read_json, read_manifest_once, read_parquet

Use = Callable[..., Path]        # StageRun.use(item, prompt_id=None): records an input, returns its path
UPSTREAM = tuple(s for s in paths.STAGES if s != "report")    # every stage whose manifest the report reads
EXCERPT = 40                     # characters of a prompt's text or a continuation shown in the overview
GREEDY, SAMPLE = "greedy", "sample"
# A set of more prompts than this gets their distribution (quantiles, counts), not one line each (issue 29):
# a report of 10,000 prompts stays a page; the per-prompt rows are the prompt_metrics tables it cites.
PER_PROMPT_MAX = 50
QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
FAILING_SHOWN = 10               # prompts with a failing check named in a large set's overview


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
    manifests = {}
    for s in UPSTREAM:
        if paths.manifest_path(s, root).exists():
            use(paths.manifest_path(s))
            manifests[s] = read_manifest_once(s, root)      # the one parsed copy the stage run holds too
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


def _runs_by_prompt(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(r["prompt_id"], []).append(r)
    return out


def check_counts(checks: list[dict] | None, ids: list[str]) -> dict[str, tuple[int, int] | None] | None:
    """Per prompt (pass, fail) counts of its checks; None for a prompt the checks did not run on (a set larger
    than `checks.prompts`). Rows of no prompt of the run (null or "": checks over the whole run) count for none.
    None when there are no checks, or none of them is a prompt's."""
    out: dict[str, tuple[int, int] | None] = dict.fromkeys(ids)
    if checks is None or not any(c[paths.PARTITION_KEY] in out for c in checks):
        return None
    for c in checks:
        p = c[paths.PARTITION_KEY]
        if p in out:
            ok, bad = out[p] or (0, 0)
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
    at_t = {}                                   # indexed once: a set of 10,000 prompts is one pass
    for r in s.probs or []:
        if r["temperature"] == t:
            at_t.setdefault(r["prompt_id"], r)
    runs = _runs_by_prompt(s.runs or [])
    out = []
    for p in s.ids:
        tok = s.tokenize[p]
        nt = at_t.get(p)
        greedy = run_row(runs.get(p, []), p, GREEDY)
        sample = run_row(runs.get(p, []), p, SAMPLE)
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
def quantiles(values: list[float]) -> list[float]:
    """QUANTILES of `values` (numpy's linear interpolation); [] for none."""
    import numpy as np
    return [float(q) for q in np.quantile(np.asarray(values, np.float64), QUANTILES)] if values else []


def distribution(rs: list[dict]) -> list[tuple[str, list[float], str]]:
    """(quantity, its values across prompts, how a value is shown) for the figures of `rows`."""
    def col(key: str) -> list[float]:
        return [float(r[key]) for r in rs if r[key] is not None]
    diverged = [float(r["diverge"]) for r in rs if r["diverge"]]             # 0 (never) and null left out
    return [("tokens", col("n_tokens"), "g"), ("p(top-1)", col("top1_prob"), "p"),
            ("entropy (nats)", col("entropy"), ".4f"), ("nucleus kept", col("nucleus"), "g"),
            ("sample leaves greedy at step (runs that leave)", diverged, "g")]


def _shown(v: float, how: str) -> str:
    return prob(v) if how == "p" else f"{v:{how}}"


def distribution_section(s: SetInputs, rs: list[dict], chosen: str) -> list[str]:
    """A large set's overview: quantiles of each per-prompt figure and counts, instead of one line each."""
    t, nucleus = rs[0]["temperature"], rs[0]["nucleus_filter"]
    head = ["across prompts", "prompts", *(f"{q:.0%}" if 0 < q < 1 else ("min" if q == 0 else "max")
                                          for q in QUANTILES)]
    cells = []
    for label, values, how in distribution(rs):
        label = label.replace("nucleus", f"{nucleus}" if nucleus else "top-p")
        if label.startswith(("p(top-1)", "entropy")) and t is not None:
            label += f" at T = {t:g}"
        cells.append([label, len(values), *([_shown(q, how) for q in quantiles(values)] or ["-"] * len(QUANTILES))])
    greedy = [r for r in rs if r["greedy_loop"] is not None]
    loops = sum(1 for r in greedy if r["greedy_loop"])
    sample = [r for r in rs if r["diverge"] is not None]
    left = sum(1 for r in sample if r["diverge"])
    failing = [r["prompt_id"] for r in rs if r["checks"] is not None and r["checks"][1]]
    counted = [r for r in rs if r["checks"] is not None]

    def share(k: int, n: int) -> str:
        return f"{k} of {n} ({k / n:.1%})" if n else "-"
    counts = [["greedy run ends in a loop", share(loops, len(greedy))],
              ["sample run leaves the greedy run", share(left, len(sample))],
              ["prompts the per-prompt checks ran on (`checks.prompts`)",
               share(len(counted), len(rs)) if s.checks is not None else "-"],
              ["prompts with a failing check", share(len(failing), len(counted)) if s.checks is not None else "-"]]
    if failing:
        more = f", and {len(failing) - FAILING_SHOWN} more" if len(failing) > FAILING_SHOWN else ""
        counts.append(["first failing prompts", ", ".join(name(p) for p in failing[:FAILING_SHOWN]) + more])
    counts.append(["detail below", name(chosen) + " (`report.prompt_id`)"])
    every = paths.dataset(paths.TOKENIZE_SUMMARY) / f"{paths.PARTITION_KEY}=*" / paths.TOKENIZE_SUMMARY[1]
    sources = [every.as_posix(), src(paths.PROBS_PROMPT_METRICS),
               src(paths.TRAJECTORY_PROMPT_METRICS)] + ([src(paths.CHECKS)] if s.checks is not None else [])
    intro = (f"{len(rs)} prompts: more than {PER_PROMPT_MAX}, so their distribution rather than one line each (every "
             "prompt's row is in the prompt_metrics tables cited). ")
    if t is not None:
        intro += f"The next token (last prompt position) at T = {t:g}"
        intro += f"; the nucleus: the ids `{nucleus}` (top_k off, top_p < 1) keeps at that T. " if nucleus else ". "
    intro += "Quantiles by linear interpolation; greedy and sample runs without the KV cache where recorded."
    return [intro, ""] + table(head, cells, sources) + table(["count", "prompts"], counts, sources)


def section(s: SetInputs, chosen: str, figures: list[list[str]]) -> list[str]:
    """The overview: a table with one line per prompt (their distribution for more than PER_PROMPT_MAX
    prompts), then the figures across prompts."""
    rs = rows(s)
    if len(rs) > PER_PROMPT_MAX:
        return [f"## Prompts of this run ({len(rs)})", ""] + distribution_section(s, rs, chosen) + \
            [line for f in figures for line in f]
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
