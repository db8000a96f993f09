"""`nexttoken sweep`: the current baseline's experiments as one table and two plots.

Reads `dvc exp show --json` (DVC 3.67: a list of baselines, each with its own `data` and
`experiments`, each with `revs[0].data.params/metrics`), writes one row per run, the baseline
commit first (`kind` baseline) and then its experiments (its name, commit, the swept params and
every metric, flattened to dotted columns) as Parquet and CSV, prints the table's main columns,
and draws: kept count against top_p per temperature, and the top candidate's probability and
the entropy against temperature. A line joins runs only along a numeric axis they were swept
on; the baseline, greedy runs (T = 0 is a decoding mode, not a temperature) and a series with
one value on the axis are points. Over a prompt set the metrics are the set's (the
`pipeline.numerics.aggregates` keys beside the last prompt's figures), and sweep_prompts.parquet /
.csv hold one row per experiment and prompt (from each experiment's prompt_metrics tables) plus
the experiment's set line. `sweep` is not a DVC stage (it reads DVC's record of many runs), so
its folder is git-ignored rather than a DVC output.
"""

from __future__ import annotations

import json
import math
import numbers
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic
from pipeline.config import schema
from pipeline.errors import UserError
from pipeline.numerics import aggregates
from pipeline.report import plots
from pipeline.store import paths
from pipeline.tools import prompt_tables, revisions

OUT = Path(paths.ARTIFACTS) / "sweep"
TABLE, CSV = "sweep.parquet", "sweep.csv"
KEPT_PLOT, TEMPERATURE_PLOT = "kept_count_vs_top_p.png", "top_prob_entropy_vs_temperature.png"
# Always shown, varying or not; any other param that varies across the experiments is added.
PARAM_COLUMNS = ("model.name", "prompt.name", "sampling.temperature", "sampling.top_k", "sampling.top_p")
T, TOP_P = "sampling.temperature", "sampling.top_p"
MARKERS = "osD^v<>"   # one per series (model / prompt / top_k ...) when more than the swept axes vary
LABEL_CHARS = 24      # of a param value in a legend entry
SERIES_KEYS = {"prompt.name": "prompt", "model.name": "model"}   # legend names of a series' params
# Metric columns are `<stage>:<dotted key>` (DVC writes `<file>:<key>`): never confused with params.
KEPT, MASS, ENTROPY, TOP_BITS = "probs:kept", "probs:mass", "probs:entropy", "probs:top_bits"
# The probs metrics give the top candidate's probability in bits (-log2 p); the table adds p itself,
# and after the filter (the top candidate is always kept: renormalised, it is p / kept mass).
TOP, TOP_AFTER = "probs:top_prob", "probs:top_prob_after"


# Per prompt (sweep_prompts.*): one row per experiment and prompt from the run's prompt_metrics tables, and
# the experiment's set line (prompt_id SET_ROW) from its set-level metrics: each per-prompt column beside
# the metric that summarises it over the set.
PROMPTS_TABLE, PROMPTS_CSV = "sweep_prompts.parquet", "sweep_prompts.csv"
SET_ROW = "(set)"
SET_OF = {"entropy": "probs:entropy_median", "kept": "probs:kept_median",
          "greedy_loop": "trajectories:greedy_loop_rate", "sample_loop": "trajectories:sample_loop_rate",
          "diverge": "trajectories:diverge_mean"}


# The terminal's view of the table (every column is in the files): the runs' metric columns, in this order.
SHOWN_METRICS = (KEPT, TOP, TOP_AFTER, ENTROPY, "trajectories:greedy", "trajectories:sample",
                 "trajectories:diverge", "checks:failed_error", "checks:failed_report")
BASELINE, EXPERIMENT = "baseline", "experiment"     # the `kind` column


def cli(args) -> int:
    out = collect(Path.cwd(), args.out or OUT)
    print(terminal_table(out["table"]))
    n_exp = sum(r["kind"] == EXPERIMENT for r in out["rows"])
    print(f"wrote {n_exp} experiments and their baseline ({out['prompt_rows']} prompt rows) to {out['dir']}: "
          f"{', '.join(out['files'])}")
    for line in out["skipped"]:
        print(line)
    return 0


def exp_show(repo: Path) -> list[dict]:
    """`dvc exp show --json` of the current baseline (the same DVC as this Python: `-m dvc`)."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=repo,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()[-1]
        raise UserError(f"`dvc exp show --json` failed: {last.removeprefix('ERROR: ')}")
    return json.loads(proc.stdout)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> dotted keys; lists become JSON text (one cell per setting)."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): json.dumps(d, ensure_ascii=False) if isinstance(d, list) else d}


def experiment_rows(shown: list[dict], repo: Path | None = None) -> list[dict]:
    """One dict per run: name, kind (baseline / experiment), rev, state, baseline, all params, all metrics
    (dotted). Each baseline commit comes first, named by its branch (else its short commit), then its
    experiments; the workspace entry is left out (it is the baseline, or not a committed run).

    `prompt.name` is the run's prompt name (`schema.prompt_name`: params.yaml's null becomes the
    known or derived name), with the prompt file read from git at the run's commit.
    """
    rows = []
    for baseline in shown:
        exps = baseline.get("experiments") or []
        if baseline.get("rev") != revisions.WORKSPACE and (baseline.get("data") or {}).get("metrics"):
            state = "failed" if baseline.get("error") else "success"
            name = baseline.get("name") or str(baseline.get("rev"))[:7]
            rows.append(_row(baseline, name, BASELINE, state, baseline.get("rev"), repo))
        for exp in exps:
            rev = (exp.get("revs") or [{}])[0]
            state = (exp.get("executor") or {}).get("state") or ("failed" if rev.get("error") else "success")
            rows.append(_row(rev, exp.get("name") or rev.get("name"), EXPERIMENT, state, baseline.get("rev"), repo))
    return rows


def _row(rev: dict, name: str, kind: str, state: str, baseline: str | None, repo: Path | None) -> dict:
    data = rev.get("data") or {}
    row = {"exp": name, "kind": kind, "rev": rev.get("rev"), "state": state, "baseline": baseline}
    for fname, content in (data.get("params") or {}).items():
        prefix = "" if fname == paths.PARAMS else f"{fname}:"
        params = (content or {}).get("data") or {}
        row.update({prefix + k: v for k, v in flatten(params).items()})
        if fname == paths.PARAMS and isinstance(params.get("prompt"), dict):
            row["prompt.name"] = run_prompt_name(params["prompt"], repo, rev.get("rev"))
    for fname, content in (data.get("metrics") or {}).items():
        stage = Path(fname).parent.name   # artifacts/<stage>/metrics.json -> <stage>:
        row.update({f"{stage}:{k}": v for k, v in flatten((content or {}).get("data") or {}).items()})
    return row


def run_prompt_name(prompt: dict, repo: Path | None, commit: str | None) -> str | None:
    """The name the run's stages gave its prompt; params' own `name` when it cannot be worked out."""
    try:
        cfg = schema.parse(schema.PromptConfig, prompt, "prompt")
        if cfg.file is not None:
            data = revisions.git_file(repo, commit, cfg.file) if repo is not None and commit else None
            if data is None:
                return prompt.get("name")
            cfg = cfg.model_copy(update={"text": data.decode("utf-8", errors="replace")})
        return schema.prompt_name(cfg)
    except UserError:
        return prompt.get("name")


HEAD = ("exp", "kind", "rev", "state", "baseline")      # a run's own columns, before its params


def table(rows: list[dict]):
    """The sweep as a DataFrame: the baseline first, then fixed and varying params, then the metrics,
    sorted by them."""
    import pandas as pd
    df = pd.DataFrame(rows)
    if "kind" not in df.columns:
        df["kind"] = EXPERIMENT
    metric_cols = [c for c in df.columns if ":" in c]
    params = [c for c in df.columns if c not in metric_cols and c not in HEAD]
    varying = [c for c in params if c not in PARAM_COLUMNS and df[c].astype(str).nunique() > 1]
    shown = [c for c in PARAM_COLUMNS if c in df.columns] + varying
    df = df[[*HEAD, *shown, *metric_cols]].copy()
    if TOP_BITS in df.columns and MASS in df.columns:
        df[TOP] = 2.0 ** -pd.to_numeric(df[TOP_BITS], errors="coerce")
        df[TOP_AFTER] = df[TOP] / pd.to_numeric(df[MASS], errors="coerce")
    df["_first"] = df["kind"] != BASELINE
    df = df.sort_values(["_first", *shown, "exp"], kind="stable").reset_index(drop=True)
    return df.drop(columns="_first")


def terminal_table(df) -> str:
    """The table as the terminal shows it: each run's name and kind, the sampling params and any param that
    varies, then the main metrics (`SHOWN_METRICS`), short column names, 4 significant digits."""
    params = [c for c in df.columns[len(HEAD):] if ":" not in c
              and (c in (T, TOP_P) or df[c].astype(str).nunique() > 1)
              and (not c.startswith(("prompt.", "model.")) or c in ("prompt.name", "model.name"))]   # as _series
    cols = ["exp", "kind", *params, *[c for c in SHOWN_METRICS if c in df.columns]]
    view = df[cols].rename(columns=lambda c: c.rpartition(":")[2] if ":" in c else c.removeprefix("sampling."))
    view = view.apply(lambda col: col.str.replace("\n", " ") if col.dtype == object else col)   # one line a run
    if (df["state"] != "success").any():
        view.insert(2, "state", df["state"])
    return view.to_string(index=False, float_format=lambda v: f"{v:.4g}", max_colwidth=LABEL_CHARS)


def collect(repo: Path, out_dir: Path) -> dict:
    rows = experiment_rows(exp_show(repo), repo)
    if not rows:
        raise UserError("no experiments of the current baseline: queue some with "
                        "`dvc exp run --queue -S 'sampling.temperature=0.5,1.0,2.0'` and `dvc queue start`")
    df = table(rows)
    out_dir = repo / out_dir if not Path(out_dir).is_absolute() else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / TABLE, lambda p: df.to_parquet(p, index=False))
    write_atomic(out_dir / CSV, lambda p: df.to_csv(p, index=False))
    files = [TABLE, CSV]
    done = df[df["state"] == "success"]
    skipped: list[str] = []
    per_prompt = prompt_table(done, lambda row: experiment_figures(repo, row, skipped))
    write_atomic(out_dir / PROMPTS_TABLE, lambda p: per_prompt.to_parquet(p, index=False))
    write_atomic(out_dir / PROMPTS_CSV, lambda p: per_prompt.to_csv(p, index=False))
    files += [PROMPTS_TABLE, PROMPTS_CSV]
    if KEPT in done.columns and TOP_P in done.columns:
        write_atomic(out_dir / KEPT_PLOT, lambda p: kept_plot(done, p))
        files.append(KEPT_PLOT)
    if T in done.columns and TOP in done.columns:
        write_atomic(out_dir / TEMPERATURE_PLOT, lambda p: temperature_plot(done, p))
        files.append(TEMPERATURE_PLOT)
    return {"dir": out_dir, "rows": rows, "table": df, "files": files, "skipped": skipped,
            "prompt_rows": int((per_prompt["prompt_id"] != SET_ROW).sum())}


# ---------------------------------------------------------------- per prompt
def prompt_figures(root: Path) -> dict[str, dict]:
    """Per prompt of the run at root, from its prompt_metrics tables: at the sampling filter's temperature
    (the one the set aggregates of probs/metrics.json are taken at) when probs.temperatures lists it, else
    at T = 1 or the lowest, the entropy in nats (as the table stores it), the sampling filter's kept count,
    the top-1 probability and text; without the KV cache, whether greedy / sampling end in a loop (1.0 or
    0.0: the set line holds their rate) and the step where sampling left the greedy path (0: never). A run of another
    format_version than this code's is refused (`revisions.load_manifests`)."""
    manifests = revisions.load_manifests(root)
    probs_rows = prompt_tables.prompt_metrics(root, paths.PROBS_PROMPT_METRICS) or {}
    runs = prompt_tables.prompt_metrics(root, paths.TRAJECTORY_PROMPT_METRICS) or {}
    sampling_t = _sampling_temperature(manifests)
    out: dict[str, dict] = {}
    for pid in sorted(set(probs_rows) | set(runs)):
        fig: dict[str, Any] = {}
        if probs_rows.get(pid):
            listed = [key[0] for key in probs_rows[pid]]
            t = sampling_t if sampling_t in listed else aggregates.aggregate_temperature(listed)
            r = probs_rows[pid][(t,)]
            fig |= {"T": t, "entropy": r["entropy"], "kept": r["sampling_kept"],
                    "top1_prob": r["top1_prob"], "top1_text": r["top1_text"]}
        for branch in ("greedy", "sample"):
            if (r := (runs.get(pid) or {}).get((branch, False))) is not None:
                fig[f"{branch}_loop"] = float(r["loop"])
                if branch == "sample" and r["diverge"] is not None:
                    fig["diverge"] = r["diverge"]
        out[pid] = fig
    return out


def _sampling_temperature(manifests: dict[str, dict]) -> float | None:
    """The temperature the run's sampling filter had (greedy 0 is shown at 1, as `probs.sweep_metrics`),
    from the probs stage's recorded config; None when probs has not run."""
    config = (manifests.get("probs") or {}).get("config") or {}
    t = (config.get("sampling") or {}).get("temperature")
    return None if t is None else (float(t) if t > 0 else 1.0)


def experiment_figures(repo: Path, row: dict, skipped: list[str]) -> dict[str, dict]:
    """`prompt_figures` of one experiment, its outputs linked from the DVC cache (none when not there)."""
    try:
        exp = row["exp"] if row.get("kind") != BASELINE else None
        with revisions.open_run(repo, revisions.Revision(row["exp"], row["rev"], exp=exp)) as root:
            return prompt_figures(root)
    except UserError as e:
        skipped.append(f"{row.get('kind', EXPERIMENT)} {row['exp']}: no per-prompt rows ({e})")
        return {}


def prompt_table(df, figures_of):
    """sweep_prompts: per experiment of `table`'s frame, a row per prompt (`figures_of(row)`) and its set line."""
    import pandas as pd
    head = [c for c in df.columns if ":" not in c and c not in ("state", "baseline")]
    rows = []
    for exp in df.to_dict("records"):
        figures = figures_of(exp)
        rows += [{**{c: exp[c] for c in head}, "prompt_id": pid, **fig} for pid, fig in figures.items()]
        t = next((f["T"] for f in figures.values() if "T" in f), None)
        rows.append({**{c: exp[c] for c in head}, "prompt_id": SET_ROW, "T": t,
                     **{c: exp.get(m) for c, m in SET_OF.items() if m in exp}})
    columns = [*head, "prompt_id", "T", *SET_OF, "top1_prob", "top1_text"]
    return pd.DataFrame(rows, columns=columns)


# ---------------------------------------------------------------- plots
def _series(df, exclude: tuple[str, ...], font: plots.Fonts) -> list[tuple[str, Any]]:
    """(label, sub-frame) per combination of the varying params not on an axis: a prompt by its name and
    a model by its name (not by each of their keys), other params (seed, dtype, top_k ...) by value."""
    cols = [c for c in df.columns[len(HEAD):] if ":" not in c and c not in exclude and df[c].astype(str).nunique() > 1
            and (not c.startswith(("prompt.", "model.")) or c in ("prompt.name", "model.name"))]
    if not cols:
        return [("", df)]
    out = []
    for key, sub in df.groupby(cols, sort=True, dropna=False):
        values = key if isinstance(key, tuple) else (key,)
        out.append((", ".join(f"{SERIES_KEYS.get(c, c.rpartition('.')[2])}={_short(v, font)}"
                              for c, v in zip(cols, values)), sub))
    return out


def _short(value: Any, font: plots.Fonts, width: int = LABEL_CHARS) -> str:
    text = font.drawable(str(value).replace("\n", " "))
    return text if len(text) <= width else text[:width - 1] + "…"


def _figure(ncols: int = 1):
    return plots.new_figure((5.2 * ncols + 1.0, 4.6))


def _legend(fig, axes, title: str | None = None) -> None:
    """One legend for the figure, below the axes (never over the data), as many columns as fit;
    the figure grows taller for a long legend instead of squeezing the axes."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if not entries:
        return
    width = max(len(label) for label in entries)
    ncols = max(1, min(len(entries), int(fig.get_figwidth() * 11 // (width + 4))))
    rows = -(-len(entries) // ncols)
    fig.set_figheight(fig.get_figheight() + 0.22 * rows + (0.25 if title else 0))
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=ncols, fontsize=8,
               title=title, title_fontsize=8, frameon=False)


def _trend(pts, x: str) -> bool:
    """Whether a line may join pts along x: two or more runs, each at its own numeric value of x (else the runs
    are categories, points: a line between them would read as a trend)."""
    values = pts[x]
    numeric = all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values)
    return len(pts) >= 2 and values.nunique() == len(pts) and numeric


def _plot(ax, pts, x: str, y: str, **style) -> None:
    """pts as a line along x when they are a trend (`_trend`), else as unjoined points in the same style."""
    if not _trend(pts, x):
        style["linestyle"] = "none"
    ax.plot(pts[x], pts[y], **style)


def _split(df):
    """(the experiments, the baseline rows): the baseline is a point of its own, never part of a series."""
    base = df["kind"] == BASELINE if "kind" in df.columns else df["exp"].isna()
    return (df[~base] if (~base).any() else df), df[base]


def _baseline(ax, base, x: str, y: str) -> None:
    for _, row in base.iterrows():
        ax.plot([row[x]], [row[y]], linestyle="none", marker="*", markersize=13, color="black", zorder=5,
                markerfacecolor="gold", label=f"baseline ({row['exp']})")


def _colors(n: int):
    import matplotlib
    import numpy as np
    return matplotlib.colormaps["plasma"](np.linspace(0.1, 0.8, max(n, 1)))   # cool -> hot, as the report


def kept_plot(df, path: Path):
    """Kept count (log scale: 1 .. vocabulary size) against top_p, one line per temperature (and series);
    greedy (T = 0), a single run and the baseline as points."""
    import matplotlib
    font = plots.fonts()
    runs, base = _split(df)
    with matplotlib.rc_context(plots.rc(font)):
        fig = _figure()
        ax = fig.add_subplot()
        temps = sorted(runs[T].unique())
        labelled: set[tuple[float, int]] = set()
        last = max(df[TOP_P])
        for i, (label, sub) in enumerate(_series(runs, (T, TOP_P), font)):
            for t, color in zip(temps, _colors(len(temps))):
                pts = sub[sub[T] == t].sort_values(TOP_P)
                name = "greedy (T=0)" if t == 0 else f"T={t:g}"
                if len(pts) and t == 0:     # greedy keeps one id at any top_p: a decoding mode, not a curve
                    ax.plot(pts[TOP_P], pts[KEPT], linestyle="none", marker="x", color=color,
                            label=name + (f" ({label})" if label else ""))
                elif len(pts):
                    _plot(ax, pts, TOP_P, KEPT, marker=MARKERS[i % len(MARKERS)], color=color,
                          label=name + (f" ({label})" if label else ""))
                for x, y in zip(pts[TOP_P], pts[KEPT]):
                    if (x, int(y)) not in labelled:   # lines meet at top_p = 1 (the whole vocabulary)
                        labelled.add((x, int(y)))
                        right = x == last   # labels point inwards, away from the axes
                        ax.annotate(f"{int(y):,}", (x, y), textcoords="offset points",
                                    xytext=(-7 if right else 7, 5), fontsize=8, ha="right" if right else "left")
        _baseline(ax, base, TOP_P, KEPT)
        ax.set_yscale("log")
        ax.margins(x=0.1, y=0.15)
        ax.set_xticks(sorted(df[TOP_P].unique()))
        ax.set_xlabel("top_p (1 = off: every id kept)")
        ax.set_ylabel("ids kept by the filter (log scale)")
        ax.set_title("Candidates kept by the sampling filter")
        ax.grid(True, which="major", alpha=0.3)
        _legend(fig, [ax], title="temperature")
        plots.save(fig, path)
    return fig


def temperature_plot(df, path: Path):
    """Left: the top candidate's probability, before and after the filter; right: entropy (nats).

    Both "before" curves depend on the temperature only; top_p = 1 is off, so its "after"
    curve is the "before" one and is not drawn twice. Greedy runs (T = 0: their probs metrics are
    taken at T = 1) and the baseline are points, never part of a curve.
    """
    import matplotlib
    font = plots.fonts()
    runs, base = _split(df)
    with matplotlib.rc_context(plots.rc(font)):
        fig = _figure(ncols=2)
        left, right = fig.subplots(1, 2)
        top_ps = [p for p in sorted(runs[TOP_P].unique()) if p < 1.0]
        for i, (label, sub) in enumerate(_series(runs, (T, TOP_P), font)):
            marker, suffix = MARKERS[i % len(MARKERS)], f" ({label})" if label else ""
            greedy, sub = sub[sub[T] == 0], sub[sub[T] != 0]
            for ax, y in ((left, TOP), (right, ENTROPY)):
                if len(greedy):
                    ax.plot(greedy[T], greedy[y], linestyle="none", marker="x", color="black",
                            label="greedy (T=0; figures at T=1)" + suffix)
            per_t = sub.sort_values(T).drop_duplicates(T)
            _plot(left, per_t, T, TOP, marker=marker, color="black", lw=2, label="before the filter" + suffix)
            _plot(right, per_t, T, ENTROPY, marker=marker, color="black", label="entropy" + suffix)
            for x, y in zip(per_t[T], per_t[ENTROPY]):
                right.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(6, -10), fontsize=8)
            off = sub[sub[TOP_P] >= 1.0]   # top_p off keeps every id: the vocabulary, the entropy's ceiling
            if len(off):
                vocab = int(off[KEPT].max())
                right.axhline(math.log(vocab), linestyle=":", color="grey",
                              label=f"uniform over {vocab:,} ids" + suffix)
            for p, color in zip(top_ps, _colors(len(top_ps) + 1)):
                pts = sub[sub[TOP_P] == p].sort_values(T)
                if len(pts):
                    _plot(left, pts, T, TOP_AFTER, linestyle="--", marker=marker, color=color,
                          label=f"after top_p={p:g}, renormalised" + suffix)
        _baseline(left, base, T, TOP)
        _baseline(right, base, T, ENTROPY)
        temps = sorted(df[T].unique())
        left.set(xlabel="temperature", ylabel="probability of the top candidate", ylim=(0, 1.05), xticks=temps,
                 title="Top candidate's probability")
        right.set(xlabel="temperature", ylabel="entropy before the filter (nats)", xticks=temps,
                  title="Entropy of the next-token distribution")
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
            ax.margins(x=0.08)
        _legend(fig, [left, right])
        plots.save(fig, path)
    return fig
