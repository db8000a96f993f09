"""The report: the article's tables rebuilt from this run's artifacts, as one Markdown file.

`load` reads every artifact the report shows (recording each as an input through the
stage's `use`); `render` turns them into Markdown with no further I/O. Every table names
the artifact it comes from, and numbers the artifacts store exactly (bf16 activations,
logits) are printed exactly (float repr), so a reader can check any figure against the
file. The output depends only on the artifacts (and on which fonts the machine has, for
the figures): running the stage twice writes the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import UserError
from pipeline.model.names import act_name
from pipeline.report import attribution as attribution_report
from pipeline.report import conditions as run_conditions
from pipeline.report import lens as lens_report
from pipeline.report import overview, plots
from pipeline.report.markdown import code, exact, figure, name, prob, src, table, yes
from pipeline.report.plots import Figure, Fonts
from pipeline.store import logits_io, paths, safetensors_io
from pipeline.store.artifacts import read_json, read_parquet, tables_stored

Use = overview.Use
N_COORDS = 4                    # the article prints the first 4 coordinates
ARTICLE_STEPS = 4               # the article's trajectory tables: the first 4 steps (the rest: steps.parquet)
MAX_ROWS = 40                   # per-position tables show the first and last rows of longer prompts
SAFETENSORS_DTYPES = {"I64": "int64", "I32": "int32"}


@dataclass(frozen=True)
class Inputs:
    """Everything the report shows, read once from the artifacts."""

    source: dict                       # prepare_model/source.json
    manifests: dict[str, dict]         # stage -> manifest.json, for the stages present
    tokenize: dict                     # tokenize/tokenize.json
    tokens: list[dict]                 # tokenize/tokens.parquet rows
    facts: dict                        # forward/facts.json
    input_ids: tuple[list[int], str]   # shape and dtype of the captured input ids
    coords: dict[str, np.ndarray]      # embed / final_norm_out -> [T, 4], bf16 values as float32
    position: int                      # the last position with probability tables (default: the last one)
    logits: np.ndarray                 # [V] float32 logits at `position` (exact bf16 values)
    summary: dict                      # probs/summary.json
    kept_top: list[dict]               # probs/filtered.parquet rows with kept_rank <= top_n
    steps: list[dict]                  # trajectories/steps.parquet rows
    trajectories: dict                 # trajectories/trajectories.json
    prompt_metrics: list[dict]         # trajectories/prompt_metrics.parquet rows (one per run)
    checks: list[dict] | None          # checks/checks.parquet rows, None when not run
    probs_prompt_metrics: list[dict] | None   # probs/prompt_metrics.parquet rows, None when probs has not run
    vocab: dict[int, dict]             # token_id -> vocab.parquet row, for every id shown
    prompt_id: str = ""                # whose partitions these are
    lens: lens_report.LensInputs | None = None   # lens/ tables, None where the lens stage did not run
    attribution: attribution_report.AttributionInputs | str = ""   # attribution/ tables, or why there are none

    @property
    def top_n(self) -> int:
        return len(self.summary["temperatures"][0]["top"])

    def where(self) -> str:
        last = self.facts["n_positions"] - 1
        return f"position {self.position}" + (" (the last prompt position)" if self.position == last else "")

    def cite(self, item) -> str:
        return src(item, self.prompt_id)

    def top_logit_ids(self) -> list[int]:
        return top_ids(self.logits, self.top_n)


def top_ids(logits: np.ndarray, n: int) -> list[int]:
    """The n best ids: rank 1 = highest logit, equal logits by lower id (pipeline.numerics.sampling's
    rule, and DuckDB's `order by logit desc, token_id`)."""
    return np.argsort(-logits.astype(np.float64), kind="stable")[:n].tolist()


def _first_coords(path: Path) -> tuple[dict[str, np.ndarray], tuple[list[int], str]]:
    """The first N_COORDS coordinates of embed and final_norm_out at every position (float32
    holds every bf16/fp16 value exactly), and the captured input ids' shape and dtype; read
    without torch, these tensors only."""
    tensors, _ = safetensors_io.header(path)
    want = [act_name("embed"), act_name("final_norm_out")]
    missing = [n for n in want + ["input_ids"] if n not in tensors]
    if missing:
        raise UserError(f"{path} has no tensor {missing[0]!r}: re-run the forward stage")
    coords = {n: safetensors_io.read(path, n)[0, :, :N_COORDS] for n in want}
    ids = tensors["input_ids"]
    return coords, (list(ids.shape), ids.dtype)


def filtered_rows(use: Use, prompt_id: str, manifests: dict[str, dict]):
    """filtered.parquet of a run whose probs stage derived it (`probs.table`): re-derived from logits.parquet
    by the stage's own function (`probs.read_table`; torch, imported only here)."""
    from pipeline.numerics import probs
    return probs.read_table(use, prompt_id, manifests["probs"], paths.FILTERED)


def load(use: Use, prompt_id: str, root: Path | str = ".", prompts: overview.SetInputs | None = None) -> Inputs:
    """Read every artifact the report needs, the per-prompt ones from `prompt_id`'s partitions, the run-level
    ones from `prompts` (`overview.load`; read here for this prompt alone when not given); `checks` is
    optional (its stage may not have run): this prompt's rows and the run-wide ones."""
    prompts = prompts or overview.load(use, [prompt_id], root)
    manifests = prompts.manifests
    facts = read_json(use(paths.FORWARD_FACTS, prompt_id))
    coords, input_ids = _first_coords(use(paths.CAPTURE, prompt_id))
    summary = read_json(use(paths.PROBS_SUMMARY, prompt_id))
    position = summary["positions"][-1]      # probs.positions, resolved; -1 (the last) by default
    top_n = len(summary["temperatures"][0]["top"])
    checks = None if prompts.checks is None else [
        c for c in prompts.checks if c[paths.PARTITION_KEY] in (None, "", prompt_id)]

    def own(rows: list[dict] | None) -> list[dict] | None:
        """This prompt's rows of a set-level prompt_metrics table; None when its stage has not run."""
        return None if rows is None else [r for r in rows if r["prompt_id"] == prompt_id]
    metrics = own(prompts.probs)
    inp = Inputs(
        source=read_json(use(paths.SOURCE)), manifests=manifests,
        tokenize=prompts.tokenize[prompt_id],
        tokens=read_parquet(use(paths.TOKENS, prompt_id)).to_pylist(),
        facts=facts, input_ids=input_ids, coords=coords, position=position,
        logits=logits_io.read_position(use(paths.LOGITS, prompt_id), position), summary=summary,
        kept_top=[r for r in filtered_rows(use, prompt_id, manifests).to_pylist()
                  if r["kept_rank"] <= top_n] if not tables_stored(manifests.get("probs", {})) else
        read_parquet(use(paths.FILTERED, prompt_id), filters=[("kept_rank", "<=", top_n)]).to_pylist(),
        steps=read_parquet(use(paths.STEPS, prompt_id)).to_pylist(),
        trajectories=read_json(use(paths.TRAJECTORIES, prompt_id)),
        prompt_metrics=own(prompts.runs), checks=checks, probs_prompt_metrics=metrics, vocab={},
        prompt_id=prompt_id, lens=lens_report.load(use, prompt_id, root),
        attribution=attribution_report.load(use, prompt_id, root))
    ids = set(inp.top_logit_ids()) | {r["token_id"] for r in inp.kept_top} | {r["token_id"] for r in inp.steps}
    ids |= lens_report.token_ids(inp.lens) | attribution_report.token_ids(inp.attribution)
    ids |= {c["token_id"] for t in summary["temperatures"] for c in t["top"]}
    rows = read_parquet(use(paths.VOCAB), filters=[("token_id", "in", sorted(ids))]).to_pylist()
    inp.vocab.update({r["token_id"]: r for r in rows})
    return inp


def shown_positions(n: int) -> list[int | None]:
    """All positions, or the first and last MAX_ROWS/2 with None marking the gap."""
    if n <= MAX_ROWS:
        return list(range(n))
    half = MAX_ROWS // 2
    return [*range(half), None, *range(n - half, n)]


def pieces(inp: Inputs) -> list[str]:
    """Each prompt position's text as it decodes alone (tokens.parquet's `text`)."""
    return [r["text"] if r["text"] is not None else "" for r in inp.tokens]


def token_text(inp: Inputs, token_id: int) -> str:
    row = inp.vocab.get(token_id)
    return code(row["text"]) if row and row.get("text") is not None else "(no token)"


# ---------------------------------------------------------------- sections
def tokens(inp: Inputs) -> list[str]:
    t = inp.tokenize
    rows = []
    for p in shown_positions(len(inp.tokens)):
        if p is None:
            rows.append(["...", "", "", "", "", ""])
            continue
        r = inp.tokens[p]
        rows.append([r["position"], r["token_id"], code(r["piece"]), code(r["text"]), name(r["piece_bytes_hex"]),
                     yes(r["decodes_alone"])])
    chat = [] if not t.get("chat") else [
        "A chat prompt: these messages, rendered by the tokenizer's own chat template "
        "(`apply_chat_template(..., add_generation_prompt=True)`), are the text below.", "",
        *[f"- **{m['role']}**: {m['content']}" for m in t["messages"]], "", *_special_marks(inp)]
    return ["## 2. Prompt and tokens", "", *chat, "```text", t["prompt"], "```", "",
            f"{t['n_tokens']} tokens (add_special_tokens = {t['add_special_tokens']}); decoding them gives the "
            f"prompt back: {yes(t['round_trip_ok'])}; expected ids for `{t.get('tokenizer_family')}` match: "
            f"{yes(t.get('expected_token_ids_match'))}. A piece that does not decode alone is part of a "
            f"multi-byte character.", ""] + table(
        ["position", "id", "piece", "text alone", "bytes (hex)", "decodes alone?"], rows,
        [inp.cite(paths.TOKENS), inp.cite(paths.TOKENIZE_SUMMARY)])


def _special_marks(inp: Inputs) -> list[str]:
    """The template's special tokens in the rendered text, by position (they are text in the prompt below)."""
    special = inp.tokenize.get("special_positions") or []
    # not code(): that escapes | for a table cell, and ChatML's <|im_start|> is all pipes
    pieces = [(json.dumps(inp.tokens[p]["piece"], ensure_ascii=False), p) for p in special if p < len(inp.tokens)]
    marks = ", ".join(f"{'``' if '`' in s else '`'}{s}{'``' if '`' in s else '`'} at {p}" for s, p in pieces)
    return [f"Special tokens of the template ({len(special)}): {marks}.", ""] if special else []


def shapes(inp: Inputs) -> list[str]:
    names, f = inp.facts["names"], inp.facts

    def row(label: str, tensor: str) -> list:
        return [label, name(tensor), str(names[tensor]["shape"]), names[tensor]["dtype"]]
    shape, dtype = inp.input_ids
    rows = [["input ids", name("input_ids"), str(shape), SAFETENSORS_DTYPES.get(dtype, dtype)],
            row("embeddings", act_name("embed"))]
    rows += [row(f"layer {i} output", act_name("resid_post", i)) for i in range(f["num_layers"])
             if act_name("resid_post", i) in names]
    rows += [row("final norm (LM-head input)", act_name("final_norm_out")),
             ["LM-head weight", "`lm_head.weight`", str(f["lm_head_weight_shape"]),
              f"bias: {yes(f['lm_head_has_bias'])}"], row("logits", act_name("logits")),
             [f"next id (argmax at position {inp.position})", "-", "[1]", f"id {inp.top_logit_ids()[0]}"]]
    return ["## 3. Shapes through the model", ""] + table(["step", "tensor", "shape", "dtype"], rows,
                                                         [inp.cite(paths.FORWARD_FACTS), inp.cite(paths.CAPTURE)])


def coordinates(inp: Inputs) -> list[str]:
    emb, fin = inp.coords[act_name("embed")], inp.coords[act_name("final_norm_out")]
    rows = []
    for p in shown_positions(len(inp.tokens)):
        if p is None:
            rows.append(["...", "", "", "", ""])
            continue
        r = inp.tokens[p]
        rows.append([p, r["token_id"], code(r["text"]), ", ".join(exact(v) for v in emb[p]),
                     ", ".join(exact(v) for v in fin[p])])
    n = inp.facts["n_positions"] - 1
    last = ", ".join(exact(v) for v in fin[n])
    return ["## 4. First coordinates: embeddings and LM-head input", "",
            f"The first {N_COORDS} coordinates of each position's embedding row (`embed`) and of the LM-head "
            f"input (`final_norm_out`), printed exactly ({inp.facts['names']['embed']['dtype']} values). "
            f"LM-head input at the last position ({n}): `[{last}]`.", ""] + table(
        ["position", "id", "text", f"embed[:{N_COORDS}]", f"final_norm_out[:{N_COORDS}]"], rows,
        inp.cite(paths.CAPTURE))


def top_logits(inp: Inputs) -> list[str]:
    rows = [[k + 1, i, token_text(inp, i), exact(inp.logits[i])] for k, i in enumerate(inp.top_logit_ids())]
    return [f"## 5. Top-{inp.top_n} logits at {inp.where()}", "",
            f"Raw {inp.facts['compute_dtype']} logits over all {inp.logits.size} outputs (the tokenizer has "
            f"{inp.facts['tokenizer_len']} tokens).", ""] + table(
        ["rank", "id", "text", "logit"], rows, [inp.cite(paths.LOGITS), src(paths.VOCAB)])


def temperatures(inp: Inputs, figures: dict[str, Figure]) -> list[str]:
    tol = inp.manifests.get("probs", {}).get("config", {}).get("probs", {})
    out = ["## 6. Probabilities by temperature", "",
           "FP64 softmax of logits / T over every output id; `rest` is the mass of every id not listed.", ""]
    for pos in inp.summary["positions"]:
        temps = [t for t in inp.summary["temperatures"] if t["position"] == pos]
        head = ["id", "text"] + [f"T = {t['temperature']:g}" for t in temps]
        rows = [[c["token_id"], token_text(inp, c["token_id"])] + [prob(t["top"][k]["prob"]) for t in temps]
                for k, c in enumerate(temps[0]["top"])]
        rows.append(["rest", "(all other ids)"] + [prob(t["rest"]) for t in temps])
        out += [f"Position {pos}:", ""] + table(head, rows, inp.cite(paths.PROBS_SUMMARY))
        sums = [[f"{t['temperature']:g}", f"{t['entropy_nats']:.4f}", f"{t['entropy_bits']:.4f}",
                 f"{t['sum_error_fp64']:.3e}", yes(t["fp64_within_tolerance"]),
                 f"{t['sum_error_fp32']:.3e}", yes(t["fp32_within_tolerance"])] for t in temps]
        out += [f"Sum errors |sum(p) - 1| (tolerance FP64 {tol.get('fp64_sum_tolerance')}, "
                f"FP32 {tol.get('fp32_sum_tolerance')}) and entropy, position {pos}:", ""] + table(
            ["T", "entropy (nats)", "entropy (bits)", "FP64 error", "FP64 within", "FP32 error", "FP32 within"],
            sums, [inp.cite(paths.PROBS_SUMMARY), src(paths.manifest_path("probs"))])
    return out + next_token(inp) + [line for f in ("temperature_top", "entropy") if f in figures
                                    for line in figure(figures[f])]


def next_token(inp: Inputs) -> list[str]:
    """The next-token figures per temperature (prompt_metrics.parquet): each filter's top_k / top_p
    applied at that temperature, its kept ids and their mass."""
    if not inp.probs_prompt_metrics:
        return []
    first = inp.probs_prompt_metrics[0]
    kept = [c[:-len("_kept")] for c in first if c.endswith("_kept")]
    rows = [[f"{r['temperature']:g}", f"{r['entropy']:.4f}", f"{r['top1_id']} {code(r['top1_text'])}",
             prob(r["top1_prob"])] + [f"{r[f + '_kept']} ({r[f + '_mass']:.4f})" for f in kept]
            for r in inp.probs_prompt_metrics]
    return [f"Next token of prompt {name(first['prompt_id'])} (position {first['position']}) by temperature; "
            "each filter's top_k / top_p after that temperature (a greedy filter keeps the argmax), kept ids "
            "(their mass):", ""] + table(["T", "entropy (nats)", "top-1", "p(top-1)"] + [name(f) for f in kept],
                                         rows, src(paths.PROBS_PROMPT_METRICS))


def filters(inp: Inputs, figures: dict[str, Figure]) -> list[str]:
    rows = [[name(f["filter"]), f["position"], f"{f['temperature']:g}", f["top_k"], f"{f['top_p']:g}",
             f["kept_count"], f"{f['kept_mass']:.6f}", f"{f['mass_without_last_kept']:.6f}"]
            for f in inp.summary["filters"]]
    out = ["## 7. Top-k and top-p", "",
           "Temperature, then top-k, then top-p, then renormalise (transformers' order). `top_k = 0` and "
           "`top_p = 1` are off. Top-p keeps the smallest set whose mass reaches p: without its last id the "
           "mass falls below p.", ""]
    out += table(["filter", "position", "T", "top_k", "top_p", "kept ids", "kept mass", "mass without last"],
                 rows, inp.cite(paths.PROBS_SUMMARY))
    kept = [[name(r["filter"]), r["position"], r["kept_rank"], r["token_id"], token_text(inp, r["token_id"]),
             prob(r["prob_before"]), prob(r["prob_after"])] for r in inp.kept_top]
    out += [f"Renormalised probabilities of the top {inp.top_n} kept ids of each filter:", ""] + table(
        ["filter", "position", "kept rank", "id", "text", "p before", "p after (renormalised)"], kept,
        [inp.cite(paths.FILTERED), src(paths.VOCAB)])
    return out + (figure(figures["cumulative"]) if "cumulative" in figures else [])


def trajectories(inp: Inputs) -> list[str]:
    cfg = inp.manifests.get("trajectories", {}).get("config", {}).get("sampling", {})
    out = ["## 8. Trajectories", "",
           f"Sampling branch: T = {cfg.get('temperature')}, top_k = {cfg.get('top_k')}, top_p = {cfg.get('top_p')}, "
           f"seed {cfg.get('seed')} (FP32 probabilities, CPU generator); greedy branch: argmax of the raw logits. "
           f"Without the KV cache every step re-runs the full prefix (the reference path).", ""]
    for t in inp.trajectories.values():
        steps = [s for s in inp.steps if s["branch"] == t["branch"] and s["kv_cache"] == t["kv_cache"]]
        rows = [[s["step"], s["prefix_len"], s["token_id"], code(s["piece"]), code(s["text_so_far"]),
                 exact(s["logit"]), prob(s["prob"]), s["rank"]] for s in sorted(steps, key=lambda s: s["step"])]
        forced = f" What if: id {t['forced']['token_id']} (rank {t['forced']['rank']}) forced at step " \
                 f"{t['forced']['step']}, then greedy." if t.get("forced") else ""
        out += [f"Branch `{t['branch']}`, KV cache {'on' if t['kv_cache'] else 'off'}: {len(t['token_ids'])} new "
                f"tokens, stop: {t['stop_reason']}, text {code(t['text'])}.{forced}", ""]
        more = f" (the article's table; steps {ARTICLE_STEPS + 1}-{len(rows)}: {inp.cite(paths.STEPS)})" \
            if len(rows) > ARTICLE_STEPS else ""
        out += [f"The first {min(len(rows), ARTICLE_STEPS)} steps{more}:", ""]
        out += table(["step", "prefix length", "id", "piece", "text so far", "logit", "prob", "rank"],
                     rows[:ARTICLE_STEPS], [inp.cite(paths.STEPS), inp.cite(paths.TRAJECTORIES)])
    for branch in dict.fromkeys(t["branch"] for t in inp.trajectories.values()):
        runs = {t["kv_cache"]: t["token_ids"] for t in inp.trajectories.values() if t["branch"] == branch}
        if len(runs) == 2:
            out += [f"`{branch}`: KV cache and full prefix chose the same ids: {yes(runs[True] == runs[False])}.", ""]
    return out + repetition(inp.prompt_metrics)


def repetition(rows: list[dict]) -> list[str]:
    """Per run: where it left the greedy run, the loop it ends in and its distinct n-gram ratios."""
    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"
    cells = [[name(r["branch"]), "on" if r["kv_cache"] else "off", r["n_new"], r["stop_reason"] or "-",
              "-" if r["diverge"] is None else r["diverge"], r["loop_start"] if r["loop"] else "no loop",
              r["loop_period"] if r["loop"] else "-", *(ratio(r[f"distinct_{n}"]) for n in (1, 2, 3))] for r in rows]
    return ["Repetition per run: the step where the run left the greedy run of the same cache mode (0: never), "
            "the step where its loop starts and the loop's period (a tail repeating at least two full periods), "
            "and distinct n-grams / n-grams (`-`: fewer than n tokens).", ""] + table(
        ["branch", "KV cache", "new tokens", "stop", "leaves greedy at step", "loop start", "loop period",
         "distinct-1", "distinct-2", "distinct-3"], cells, src(paths.TRAJECTORY_PROMPT_METRICS))


def checks(inp: Inputs) -> list[str]:
    out = ["## 11. Checks", ""]
    if inp.checks is None:
        return out + [f"`{src(paths.CHECKS)}` is missing: the checks stage has not run (`dvc repro checks`).", ""]
    if not inp.checks:
        return out + [f"No check ran on this prompt: a set larger than `checks.prompts` is checked on a fixed sample "
                      f"of its prompts, and this one is outside it (`{src(paths.CHECKS)}`; docs/prompt_sets.md).", ""]
    failed = [c for c in inp.checks if c["verdict"] != "pass"]
    errors = [c for c in failed if c["severity"] == "error"]
    rows = [[name(c["name"]), c["what"], _measured(c["measured"]), _measured(c["tolerance"]),
             c["verdict"] if c["verdict"] == "pass" else f"**{c['verdict'].upper()}**", c["severity"],
             c.get("detail") or ""] for c in inp.checks]
    return out + [f"{len(inp.checks)} checks: {len(inp.checks) - len(failed)} pass, {len(failed)} fail "
                  f"({len(errors)} of severity `error`). Each compares a recorded number with a second derivation "
                  f"of it (another implementation, another library or another path through the model): the "
                  f"\"compares\" column names both. `report` checks record numerical findings; they never fail "
                  f"the run.", ""] + table(
        ["check", "compares", "measured", "tolerance", "verdict", "severity", "detail"], rows, src(paths.CHECKS))


def _measured(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.6g}"


def draw(inp: Inputs, out: Callable[[str], Path], font: Fonts) -> dict[str, Figure]:
    """The three figures at `inp.position` (and the lens heatmap, where the run has a lens), drawn into `out(...)`
    paths."""
    temps = [t for t in inp.summary["temperatures"] if t["position"] == inp.position]
    labels = {c["token_id"]: plots.token_label(c["token_id"], inp.vocab.get(c["token_id"]), font)
              for c in temps[0]["top"]}
    cuts = [f for f in inp.summary["filters"] if f["position"] == inp.position and f["top_p"] < 1.0]
    t_cut = cuts[0]["temperature"] if cuts else 1.0
    figs = [plots.temperature_bars(out, inp.position, temps, labels, font),
            plots.cumulative_curve(out, inp.position, inp.logits, t_cut,
                                   [c for c in cuts if c["temperature"] == t_cut], font),
            plots.entropy_plot(out, inp.position, inp.logits, temps, font)]
    if inp.lens is not None:
        figs.append(lens_report.heatmap(out, inp.lens, font))
    figs += attribution_report.draw(out, inp.attribution, pieces(inp), lambda i: token_text(inp, i), font)
    return {f.name: f for f in figs}


def render(inp: Inputs, figures: dict[str, Figure], font: Fonts, prompts: overview.SetInputs | None = None,
           set_figures: list[Figure] = ()) -> str:
    """report.md: the title, the overview of the run's prompts (`prompts`: one line each, with `set_figures`
    across them), then every section for the detailed prompt `inp`."""
    prompt_name = inp.tokenize.get("prompt_name", "?")    # the run's name (schema.prompt_name), not params' null
    fonts = ", ".join(font.families) + ("" if font.cjk else " (no CJK font: labels the fonts cannot draw are "
                                                            "escaped, \\uXXXX)")
    shown = json.dumps(overview.excerpt(inp.tokenize["prompt"]), ensure_ascii=False)
    n = len(prompts.ids) if prompts else 1
    what = (f"prompt {prompt_name} ({shown})" if n == 1 else
            f"prompt set {prompt_name} ({n} prompts; detail: {inp.prompt_id}, {shown})")
    lines = [f"# Next-token report: {run_conditions.model_title(inp.source)} on {what}", "",
             "Written by the `report` stage from the artifacts only: each table names the file its numbers come "
             f"from. Figures of one prompt are drawn at {inp.where()}; plot fonts: {fonts}.", "",
             f"Explore it: [{paths.EXPLORER[1]}]({paths.EXPLORER[1]}), one offline page per prompt (tokens, the "
             "next-token distribution with temperature / top-k / top-p computed exactly over the full vocabulary, "
             "attention, trajectories, checks); a screenshot, where a browser made one (`nexttoken screenshot`): "
             f"[{paths.EXPLORER_SHOT[1]}]({paths.EXPLORER_SHOT[1]}).", ""]
    if prompts is not None:
        lines += overview.section(prompts, inp.prompt_id, [figure(f) for f in set_figures])
    for part in (run_conditions.conditions(inp), tokens(inp), shapes(inp), coordinates(inp), top_logits(inp),
                 temperatures(inp, figures), filters(inp, figures), trajectories(inp),
                 lens_report.section(inp.lens, lambda i: token_text(inp, i), figures),
                 attribution_report.section(inp.attribution, lambda i: token_text(inp, i), pieces(inp), figures),
                 checks(inp)):
        lines += part
    return "\n".join(lines).rstrip("\n") + "\n"
