"""The explorer: one self-contained, offline HTML page per prompt of a run (artifacts/report/explorer.html).

`page_data` gathers what the page shows from the report's `Inputs` and a few more artifacts (all
positions' top candidates, the captured attention weights, the lens where that stage ran);
`render_page` fills the page's real files (explorer_page/: page.html, style.css, numerics.mjs, explorer.js) in
one templating pass into one HTML file with inline script and style and a Content-Security-Policy that forbids
every remote load, so it opens from file:// with no server and no network.

Numbers are exact where they are recorded exactly. The last position's logits travel as the
values logits.parquet holds, exactly (`logits_encoding`: a bf16 run's as their high 16 bits); the page recomputes
softmax(logits / T) in float64 (JavaScript numbers) over the full output size at whatever
temperature the reader picks. Kept sets: at a configured filter (probs.extra_filters and the
sampling filter) the page shows the set the pipeline recorded with transformers' warpers
(filtered.parquet, as a count when it is a prefix of the logit order, else ids or a bitmap: `kept_set`), since
float32 ties at the boundary are
the warper's to break; at any other setting it computes the FP64 nucleus itself (temperature ->
top-k (ties kept) -> top-p: the smallest prefix by probability, ties by lower id, whose mass
reaches p), and says which it shows. T = 0 is greedy (the argmax); "sample once" draws from the shown
set by inverse CDF with SplitMix64 (docs/explorer.md gives it in numpy). The test contract (`#temperature`,
`#top-k`, `#top-p`, `#kept-count`, `#kept-mass`, `#candidates tr[data-token-id][data-prob]`, `#sample`,
`#sampled-id`, `#input-error`) is stable for users' own automation too: docs/explorer.md.

The Equivalence panel (where the equivalence stage ran for the prompt) compares, at the page's
temperature, the recorded next-token distribution with each forward variation's own logits at the
same position (variant_logits.parquet): the top candidates of both, Δ logit and ranks, the top-1,
the FP64 top-p kept sets and their Jaccard, KL(record || variant) in FP64; beside them the stored
row of equivalence.parquet. A variant's row travels in the fewest bytes that hold it exactly
(`variant_encoding`): none when it is bit-identical to the record or to an earlier variation, else the
smaller of its plain bytes (bf16 high halves, IEEE half, float32) and its Rice-coded difference from the
record or an earlier row (`rice`: a bf16 run's variations differ by a step or two, about 2 bits an id).

Size (docs/explorer.md, measured): the logits are 2 bytes per id for a bf16 run (0.7 MB of base64 for a
262,144-id vocabulary); everything else is bounded whatever the prompt's length: MAX_POSITIONS positions of top
candidates and MAX_ATTENTION positions of attention (the last ones), TOP_IDS candidate rows; each variation 0 to
4 bytes per id (`variant_encoding`), EQ_TOP rows.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import numpy as np

from pipeline.report import conditions, explorer_font, explorer_walk
from pipeline.store import paths

TOP_IDS = 200            # candidate rows the page can list, in logit order (temperature keeps that order)
TOP_PER_POSITION = 10    # recorded candidates shown for a clicked position
MAX_POSITIONS = 512      # positions whose candidates are embedded (the last ones)
MAX_ATTENTION = 64       # attention maps cover at most the last 64 query and key positions
EQ_TOP = 20              # Equivalence panel: the union of each side's top 20 ids (text embedded for those)
EQ_FIGURES = ("n_positions", "max_abs_diff", "mean_abs_diff", "top1_changed", "kept_recorded", "kept_variant",
              "kept_jaccard", "kl_mean", "kl_max", "kl_last", "bit_identical", "first_differing_tensor", "note")
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
       "connect-src 'none'; font-src data:; frame-src 'none'; form-action 'none'; base-uri 'none'")


def b64_floats(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


def b64_bits(ids: np.ndarray, size: int) -> str:
    bits = np.zeros(size, dtype=bool)
    bits[ids] = True
    return base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode("ascii")


RICE_QMAX, RICE_ESCAPE = 24, 34      # a quotient this long escapes to the next 34 bits, the zigzag value itself


def ordinals(values: np.ndarray) -> np.ndarray:
    """float32 bits as int64, one to one, near values near each other: the bits for x >= 0, minus the magnitude's
    bits for x < 0 (-0.0: -2^31); every low bit zero in the bits stays zero here (bf16 and half values)."""
    b = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.int64)
    mag = b & 0x7FFFFFFF
    return np.where(b >> 31 == 0, b, np.where(mag == 0, -(1 << 31), -mag))


def rice(values: np.ndarray, reference: np.ndarray) -> tuple[dict, str]:
    """({k, shift}, base64): a row as its difference from a reference row, exact. d = ordinals(values) -
    ordinals(reference) >> shift (shift: the trailing zero bits every d shares: 16 between two bf16 rows), zigzag
    z = 2d or -2d - 1, then Rice-coded with parameter k (the one giving the fewest bits): z >> k in unary (ones, then
    a zero), then its low k bits, most significant bit first; a quotient of RICE_QMAX or more is RICE_QMAX ones and
    z in RICE_ESCAPE bits. Values one bf16 step apart cost about 2 bits instead of 16."""
    d = ordinals(values) - ordinals(reference)
    nz = d[d != 0]
    shift = int(np.bitwise_and(nz, -nz).min()).bit_length() - 1 if nz.size else 0
    d >>= shift
    z = np.where(d >= 0, 2 * d, -2 * d - 1)
    cost = [int(np.where(z >> k < RICE_QMAX, (z >> k) + 1 + k, RICE_QMAX + RICE_ESCAPE).sum()) for k in range(34)]
    k = int(np.argmin(cost))
    q = z >> k
    esc = q >= RICE_QMAX
    ones = np.where(esc, RICE_QMAX, q)
    width = np.where(esc, RICE_ESCAPE, k)           # the bits after the unary part
    start = np.concatenate(([0], np.cumsum(ones + (~esc) + width)))
    bits = np.zeros(int(start[-1]), dtype=np.uint8)
    first = np.repeat(start[:-1], ones)
    bits[first + np.arange(first.size) - np.repeat(np.cumsum(ones) - ones, ones)] = 1
    tail = start[:-1] + ones + (~esc)               # where the k (or escape) bits begin
    payload = np.where(esc, z, z & ((1 << k) - 1))
    for j in range(RICE_ESCAPE):
        has = width > j
        bits[tail[has] + j] = (payload[has] >> (width[has] - 1 - j)) & 1
    return {"k": k, "shift": shift}, base64.b64encode(np.packbits(bits).tobytes()).decode("ascii")


def variant_encoding(recorded: np.ndarray, variant: np.ndarray,
                     earlier: dict[str, np.ndarray] | None = None) -> tuple[str, str | None, dict]:
    """(encoding, base64, params) of a variant's float32 logits row in the fewest bytes that give back every value:
    "same" (the record's bits: nothing embedded), "as" (the bits of an earlier variation, params {"ref": its name}:
    nothing), "nan" (every value NaN: nothing), else the smallest of "rice" (the difference from the record or an
    earlier variation, `rice`; params k, shift and ref, None for the record), "bf16" (every low half zero: the high
    16 bits), "f16" (IEEE half gives back every value; a NaN stays NaN) and "f4"."""
    v = np.ascontiguousarray(variant, dtype="<f4")
    bits = v.view("<u4")
    nan = np.isnan(v)
    if nan.all():
        return "nan", None, {}
    refs = {None: np.ascontiguousarray(recorded, dtype="<f4"), **(earlier or {})}
    for name, row in refs.items():
        if np.array_equal(bits, np.ascontiguousarray(row, dtype="<f4").view("<u4")):
            return ("same", None, {}) if name is None else ("as", None, {"ref": name})
    options = []
    if not (bits & 0xFFFF).any():
        options.append(("bf16", base64.b64encode((bits >> 16).astype("<u2").tobytes()).decode("ascii"), {}))
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            half = v.astype("<f2")
        back = half.astype("<f4")
        if np.array_equal(np.isnan(back), nan) and np.array_equal(back.view("<u4")[~nan], bits[~nan]):
            options.append(("f16", base64.b64encode(half.tobytes()).decode("ascii"), {}))
        else:
            options.append(("f4", b64_floats(v), {}))
    for name, row in refs.items():
        params, data = rice(v, row)
        options.append(("rice", data, {**params, "ref": name}))
    return min(options, key=lambda o: len(o[1]))


def kept_set(ids, size: int, order: np.ndarray) -> dict:
    """A kept set in the fewest bytes: {"top": n} when it is the first n ids of `order` (the side's logit_order: a
    top-k / top-p set is, unless a warper broke a tie at its boundary its own way), else {"ids": [...]} when short,
    else {"bits": base64 bitmap over the vocabulary} (a flat distribution's top-p set as an id list: megabytes)."""
    ids = np.asarray(ids if ids is not None else [], dtype=np.int64)
    if np.array_equal(np.sort(ids), np.sort(order[:ids.size])):
        return {"top": int(ids.size)}
    if ids.size * 7 < size // 8 * 4 // 3:         # ~7 bytes a JSON id against the bitmap's base64
        return {"ids": [int(i) for i in ids]}
    return {"bits": b64_bits(ids, size)}


def logits_encoding(logits: np.ndarray) -> tuple[str, str]:
    """The record's own row: "bf16" (2 bytes an id) when every value is a bf16 value (a bf16 run), else "f4"."""
    bits = np.ascontiguousarray(logits, dtype="<f4").view("<u4")
    if not (bits & 0xFFFF).any():
        return "bf16", base64.b64encode((bits >> 16).astype("<u2").tobytes()).decode("ascii")
    return "f4", b64_floats(logits)


def _json_number(x):
    return None if isinstance(x, float) and not np.isfinite(x) else x


NOT_SHOWN_KV = ("decode steps, not the prompt's last position: both runs step by step are in the Trajectories "
                "panel, their step logits in trajectories/step_logits.parquet")


def equivalence_data(recorded: np.ndarray, position: int, rows: list[dict] | None,
                     variants: dict[str, tuple[str, list[int], np.ndarray]] | None,
                     vocab_text: dict[int, str]) -> dict | None:
    """The Equivalence panel: per row of equivalence.parquet its stored figures and, for a forward variation,
    its logits at `position` (variants: variant_logits.read of that position, which the stage writes beside
    every equivalence.parquet). None: the stage did not run for the prompt (rows and variants None)."""
    if rows is None:
        return None
    out, earlier = [], {}
    for r in rows:
        item = {"name": r["variation"], "compared": r["compared"],
                "row": {k: _json_number(r.get(k)) for k in EQ_FIGURES}, "shown": False}
        stored = variants.get(r["variation"])
        if r["variation"].startswith("kv_cache_"):
            item["why"] = NOT_SHOWN_KV
        elif stored is None:
            note = str(r.get("note"))        # the stage's notes say "not applicable: ..." or "not run: ..." already
            said = note.startswith(("not applicable:", "not run:"))
            item["why"] = (note if said else f"not run here: {note}") if r["kept_recorded"] == -1 else \
                "variant_logits.parquet holds no rows for it"
        elif position not in stored[1]:
            item["why"] = f"variant_logits.parquet holds no row at position {position}"
        else:
            row = stored[2][stored[1].index(position)]
            encoding, data, params = variant_encoding(recorded, row, earlier)
            earlier[r["variation"]] = row
            top = logit_order(row)[:EQ_TOP]
            item.update(shown=True, dtype=stored[0], encoding=encoding, logits=data, params=params,
                        text={str(int(i)): vocab_text.get(int(i), "") for i in top},
                        kept={"recorded": kept_set(r.get("kept_recorded_ids"), recorded.size, logit_order(recorded)),
                              "variant": kept_set(r.get("kept_variant_ids"), recorded.size, logit_order(row))}
                        if r.get("kept_recorded_ids") is not None and r["compared"] != "step logits" else None)
        out.append(item)
    return {"position": position, "top": EQ_TOP, "variations": out}


def equivalence_ids(variants: dict[str, tuple[str, list[int], np.ndarray]] | None, position: int) -> set[int]:
    """The ids whose text the panel shows beyond the recorded top ones: each variant's top EQ_TOP."""
    out: set[int] = set()
    for _, positions, rows in (variants or {}).values():
        if position in positions:
            out |= {int(i) for i in logit_order(rows[positions.index(position)])[:EQ_TOP]}
    return out


def logit_order(logits: np.ndarray) -> np.ndarray:
    """Ids by descending logit, equal logits by lower id first (the project's rank rule)."""
    return np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))


def page_data(inp, *, pages: dict[str, str], filters: list[dict], kept: dict[str, np.ndarray],
              positions: list[tuple[int, np.ndarray]], attention: dict[int, np.ndarray], vocab_text: dict[int, str],
              lens: dict | None, equivalence: dict | None = None, language: str = "en",
              internals: dict | None = None) -> dict:
    """Everything one page shows, as JSON-ready values. inp: the report's `render.Inputs` for the prompt;
    pages: prompt id -> file name of every page of the run; filters: the probs summary's filters at the
    page's position, kept: filter name -> kept ids (filtered.parquet); positions: (position, logits row)
    of the positions shown; attention: layer -> [heads, T, T] float32; vocab_text: id -> readable text;
    equivalence: `equivalence_data`'s panel (None: the stage did not run for the prompt); internals: the walk's
    residual norms and LM-head row (explorer_walk.walk)."""
    order = logit_order(inp.logits)
    top = order[:TOP_IDS]
    size = int(inp.logits.size)
    forward = inp.manifests.get("forward", {})
    return {
        "prompt_id": inp.prompt_id,
        "language": language,                    # report.language: the page opens in it (#language switches)
        "pages": pages,
        "seed": int((forward_seeds(inp) or {}).get("sample", 0)),     # the "sample once" box starts there
        "conditions": _conditions(inp, forward),
        "tokens": [{"position": r["position"], "id": r["token_id"], "piece": r["piece"], "text": r["text"],
                    "bytes": r["piece_bytes_hex"], "alone": bool(r["decodes_alone"]),
                    "special": bool(r.get("is_special", False)), **given(dict(positions), r)} for r in inp.tokens],
        "chat": inp.tokenize.get("messages") if inp.tokenize.get("chat") else None,
        "prompt_text": inp.tokenize.get("prompt"),
        "last": {"position": inp.position, "size": size, **dict(zip(("encoding", "logits"),
                                                                   logits_encoding(inp.logits))),
                 "top": [int(i) for i in top], "text": {str(int(i)): vocab_text.get(int(i), "") for i in top}},
        "filters": [{"name": f["filter"], "temperature": f["temperature"], "top_k": f["top_k"], "top_p": f["top_p"],
                     "count": f["kept_count"], "kept": kept_set(kept[f["filter"]], size, order)}
                    for f in filters if f["filter"] in kept],
        "temperatures": [t["temperature"] for t in inp.summary["temperatures"]],
        "positions": [{"position": p, "top": [[int(i), vocab_text.get(int(i), ""), float(row[i])]
                                              for i in logit_order(row)[:TOP_PER_POSITION]]}
                      for p, row in positions],
        "attention": {str(layer): {"heads": int(w.shape[0]), "n": int(w.shape[-1]), "offset": int(offset),
                                   "weights": b64_floats(w)} for layer, (offset, w) in attention.items()},
        "trajectories": _trajectories(inp, vocab_text),
        "steps_source": paths.partition(paths.STEPS, inp.prompt_id).as_posix(),   # the what-if step's p: their file
        "checks": _checks(inp.checks),
        "lens": lens,
        "equivalence": equivalence,
        "walk": explorer_walk.walk(inp, lens, internals),
        "why": explorer_walk.why_chart(inp),
    }


def given(rows: dict[int, np.ndarray], token: dict) -> dict:
    """{"p", "rank"}: the FP64 probability (T = 1) and the rank (the project's rule) that the logits at the position
    before gave this prompt token; {} where no logits were recorded there (capture.positions=last, or position 0)."""
    row = rows.get(token["position"] - 1)
    if row is None:
        return {}
    x, i = row.astype(np.float64), int(token["token_id"])
    e = np.exp(x - x.max())
    rank = int((x > x[i]).sum() + (x[:i] == x[i]).sum()) + 1
    return {"p": float(e[i] / e.sum()), "rank": rank}


def forward_seeds(inp) -> dict | None:
    """The run's sampling seeds (trajectories/manifest.json), None where the stage has not run."""
    return inp.manifests.get("trajectories", {}).get("seeds")


def _conditions(inp, forward: dict) -> list[list[str]]:
    facts, hw = inp.facts, forward.get("hardware", {})
    git, kernels = forward.get("git") or {}, forward.get("kernels") or {}
    cpu = f"{hw.get('cpu_model', '?')}, {hw.get('cpu_cores', '?')} cores"
    device = facts.get("device", "?") + ("" if not facts.get("gpu_name") else f" ({facts['gpu_name']})")
    kernel = (f"{kernels.get('mode', '?')}: ATen {kernels.get('aten_cpu_capability', '?')}, MKL {kernels.get('mkl')}, "
              f"oneDNN {kernels.get('onednn')}, {kernels.get('torch_threads')} threads; flags "
              f"{' '.join(kernels.get('cpu_flags') or [])}") if kernels else "not recorded"
    commit = git.get("commit") or "not a git checkout"
    title = conditions.model_title(inp.source)     # a model=local run: its folder and model_type, not "local"
    arch = f"{facts.get('num_layers')} layers, capture {facts['capture_level']}"
    model = f"{title} ({arch})" if title != inp.source.get("name") else f"{title} ({facts.get('model_type')}, {arch})"
    return [["model", model],
            ["dtype / attention", f"{facts.get('dtype')} / {facts.get('attn_implementation')}"],
            ["device", f"{device}; {cpu}"],
            ["kernel path", kernel],
            ["commit", f"{commit}{' (dirty)' if git.get('dirty') else ''}"],
            ["created", str(forward.get("created_at", ""))]]


def _trajectories(inp, vocab_text: dict[int, str]) -> list[dict]:
    branches: dict[tuple[str, bool], dict] = {}
    for r in inp.steps:
        # the page words a heading in its language from these: branch, kv, forced (a what-if branch, docs/artifacts.md)
        forced = None if r.get("forced_step") is None else \
            {"step": int(r["forced_step"]), "id": int(r["forced_token_id"]), "rank": int(r["forced_rank"])}
        b = branches.setdefault((r["branch"], bool(r["kv_cache"])),
                                {"branch": r["branch"], "kv": bool(r["kv_cache"]), "forced": forced, "steps": []})
        alts = [[int(i), float(p), vocab_text.get(int(i), "")] for i, p in zip(r["top_ids"], r["top_probs"])]
        b["steps"].append({"step": r["step"], "id": r["token_id"], "text": r["text_so_far"], "prob": r["prob"],
                           "piece": vocab_text.get(int(r["token_id"]), r.get("piece")),
                           "rank": r["rank"], "alts": alts, "stop": r.get("stop_reason")})
    loops = {m.get("branch"): m for m in (inp.prompt_metrics or []) if isinstance(m, dict)}
    out = list(branches.values())
    for b in out:
        m = loops.get(b["branch"]) or {}
        b["loop"] = bool(m.get("loop")) if "loop" in m else None
    return out


def _checks(rows: list[dict] | None) -> list[dict] | None:
    if rows is None:
        return None
    return [{"name": r["name"], "severity": r["severity"], "verdict": r["verdict"],
             "value": None if r.get("value") is None else float(r["value"]), "what": r.get("what", "")}
            for r in rows]


PAGE_DIR = Path(__file__).with_name("explorer_page")   # page.html, style.css, numerics.mjs, walk.js, explorer.js
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
JS_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")


def page_file(name: str) -> str:
    return (PAGE_DIR / name).read_text(encoding="utf-8")


def fill(template: str, values: dict[str, str]) -> str:
    """One pass over the template's `{{name}}` placeholders: a value is never scanned again, so no text in it
    (a prompt id `{{script}}`, say) can pull another in. A placeholder without a value is an error."""
    missing = set(PLACEHOLDER.findall(template)) - set(values)
    if missing:
        raise ValueError(f"page template: no value for {sorted(missing)}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def _raw_text(text: str, tag: str) -> str:
    """Inline script or style: its own text must not close the element or open another (checked, never escaped:
    it is code)."""
    for bad in (f"</{tag}", f"<{tag}", "<!--"):
        if bad in text.lower():
            raise ValueError(f"explorer_page: the inline {tag} contains {bad!r}")
    return text


def render_page(data: dict) -> str:
    """The page: page.html filled once with the CSP, the title, the embedded fonts (explorer_font) + style.css,
    numerics.mjs + explorer.js (one inline module) and the data as inline JSON (`<`, `>`, `&` as \\u escapes: no
    text in it can end or confuse its script element)."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    template, style = page_file("page.html"), page_file("style.css")
    script = "\n".join(page_file(f) for f in ("numerics.mjs", "walk.js", "explorer.js"))     # walk.js's TEXT first
    title = f"nexttoken explorer: {data['prompt_id']}"
    escaped = "".join(chr(int(h, 16)) for h in JS_ESCAPE.findall(script))      # "\u26a0" in a JS string
    fonts, _ = explorer_font.font_faces(template + script + escaped + payload + title)
    return fill(template, {
        "csp": html.escape(CSP, quote=False),     # a constant without quotes
        "title": html.escape(title),
        "style": _raw_text(fonts + "\n" + style, "style"),
        "script": _raw_text(script, "script"),
        "data": payload.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e"),
    })
