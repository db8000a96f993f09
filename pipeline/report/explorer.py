"""The explorer: one self-contained, offline HTML page per prompt of a run (artifacts/report/explorer.html).

`page_data` gathers what the page shows from the report's `Inputs` and a few more artifacts (all
positions' top candidates, the captured attention weights, the lens where that stage ran);
`render_page` writes it into one HTML file with inline script and style and a Content-Security-
Policy that forbids every remote load, so it opens from file:// with no server and no network.

Numbers are exact where they are recorded exactly. The last position's logits travel as the
float32 values logits.parquet holds (bf16 values, exact), base64; the page recomputes
softmax(logits / T) in float64 (JavaScript numbers) over the full output size at whatever
temperature the reader picks. Kept sets: at a configured filter (probs.extra_filters and the
sampling filter) the page shows the set the pipeline recorded with transformers' warpers
(filtered.parquet, as a bitmap over the vocabulary), since float32 ties at the boundary are
the warper's to break; at any other setting it computes the FP64 nucleus itself (temperature ->
top-k (ties kept) -> top-p: the smallest prefix by probability, ties by lower id, whose mass
reaches p), and says which it shows. The test contract (`#temperature`, `#top-k`, `#top-p`,
`#kept-count`, `#kept-mass`, `#candidates tr[data-token-id][data-prob]`) is stable for users'
own automation too: docs/explorer.md.

The Equivalence panel (where the equivalence stage ran for the prompt) compares, at the page's
temperature, the recorded next-token distribution with each forward variation's own logits at the
same position (variant_logits.parquet): the top candidates of both, Δ logit and ranks, the top-1,
the FP64 top-p kept sets and their Jaccard, KL(record || variant) in FP64; beside them the stored
row of equivalence.parquet. A variant's row travels in the fewest bytes that hold it exactly
(`variant_encoding`): none when it is bit-identical to the record, the high half of each float32
for bf16 values, IEEE half for float16 values, float32 otherwise.

Size: the logits are 4 bytes per id (about 1.4 MB of base64 for a 262,144-id vocabulary), each
configured kept set a bit per id; everything else is bounded whatever the prompt's length:
MAX_POSITIONS positions of top candidates and MAX_ATTENTION positions of attention (the last
ones), TOP_IDS candidate rows; each variation 0, 2 or 4 bytes per id (`variant_encoding`), EQ_TOP rows.
"""

from __future__ import annotations

import base64
import html
import json

import numpy as np

TOP_IDS = 200            # candidate rows the page can list, in logit order (temperature keeps that order)
TOP_PER_POSITION = 10    # recorded candidates shown for a clicked position
MAX_POSITIONS = 512      # positions whose candidates are embedded (the last ones)
MAX_ATTENTION = 64       # attention maps cover at most the last 64 query and key positions
EQ_TOP = 20              # Equivalence panel: the union of each side's top 20 ids (text embedded for those)
EQ_FIGURES = ("n_positions", "max_abs_diff", "mean_abs_diff", "top1_changed", "kept_recorded", "kept_variant",
              "kept_jaccard", "kl_mean", "kl_max", "kl_last", "bit_identical", "first_differing_tensor", "note")
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
       "connect-src 'none'; font-src 'none'; frame-src 'none'; form-action 'none'; base-uri 'none'")


def b64_floats(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


def b64_bits(ids: np.ndarray, size: int) -> str:
    bits = np.zeros(size, dtype=bool)
    bits[ids] = True
    return base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode("ascii")


def variant_encoding(recorded: np.ndarray, variant: np.ndarray) -> tuple[str, str | None]:
    """(encoding, base64) of a variant's float32 logits row in the fewest bytes that give back every value:
    "same" (the record's bits: nothing embedded), "nan" (every value NaN: nothing), "bf16" (every low half
    zero: the high 16 bits), "f16" (IEEE half gives back every value; a NaN stays NaN), else "f4"."""
    v = np.ascontiguousarray(variant, dtype="<f4")
    bits = v.view("<u4")
    if np.array_equal(bits, np.ascontiguousarray(recorded, dtype="<f4").view("<u4")):
        return "same", None
    nan = np.isnan(v)
    if nan.all():
        return "nan", None
    if not (bits & 0xFFFF).any():
        return "bf16", base64.b64encode((bits >> 16).astype("<u2").tobytes()).decode("ascii")
    with np.errstate(over="ignore", invalid="ignore"):
        half = v.astype("<f2")
    back = half.astype("<f4")
    if np.array_equal(np.isnan(back), nan) and np.array_equal(back.view("<u4")[~nan], bits[~nan]):
        return "f16", base64.b64encode(half.tobytes()).decode("ascii")
    return "f4", b64_floats(v)


def _json_number(x):
    return None if isinstance(x, float) and not np.isfinite(x) else x


NOT_SHOWN_KV = ("decode steps, not the prompt's last position: both runs step by step are in the Trajectories "
                "panel, their step logits in trajectories/step_logits.parquet")


def equivalence_data(recorded: np.ndarray, position: int, rows: list[dict] | None,
                     variants: dict[str, tuple[str, list[int], np.ndarray]] | None,
                     vocab_text: dict[int, str]) -> dict | None:
    """The Equivalence panel: per row of equivalence.parquet its stored figures and, for a forward variation,
    its logits at `position` (variants: variant_logits.read of that position). None: the stage did not run
    for the prompt."""
    if rows is None:
        return None
    out = []
    for r in rows:
        item = {"name": r["variation"], "compared": r["compared"],
                "row": {k: _json_number(r.get(k)) for k in EQ_FIGURES}, "shown": False}
        stored = (variants or {}).get(r["variation"])
        if r["variation"].startswith("kv_cache_"):
            item["why"] = NOT_SHOWN_KV
        elif variants is None:
            item["why"] = "no variant_logits.parquet for this prompt (made by older code: re-run the equivalence stage)"
        elif stored is None:
            item["why"] = f"not run here: {r.get('note')}" if r["kept_recorded"] == -1 else \
                "variant_logits.parquet holds no rows for it"
        elif position not in stored[1]:
            item["why"] = f"variant_logits.parquet holds no row at position {position}"
        else:
            row = stored[2][stored[1].index(position)]
            encoding, data = variant_encoding(recorded, row)
            top = logit_order(row)[:EQ_TOP]
            item.update(shown=True, dtype=stored[0], encoding=encoding, logits=data,
                        text={str(int(i)): vocab_text.get(int(i), "") for i in top},
                        kept={"recorded": [int(i) for i in r.get("kept_recorded_ids") or []],
                              "variant": [int(i) for i in r.get("kept_variant_ids") or []]}
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
              lens: dict | None, equivalence: dict | None = None) -> dict:
    """Everything one page shows, as JSON-ready values. inp: the report's `render.Inputs` for the prompt;
    pages: prompt id -> file name of every page of the run; filters: the probs summary's filters at the
    page's position, kept: filter name -> kept ids (filtered.parquet); positions: (position, logits row)
    of the positions shown; attention: layer -> [heads, T, T] float32; vocab_text: id -> readable text;
    equivalence: `equivalence_data`'s panel (None: the stage did not run for the prompt)."""
    order = logit_order(inp.logits)
    top = order[:TOP_IDS]
    size = int(inp.logits.size)
    forward = inp.manifests.get("forward", {})
    return {
        "prompt_id": inp.prompt_id,
        "pages": pages,
        "conditions": _conditions(inp, forward),
        "tokens": [{"position": r["position"], "id": r["token_id"], "piece": r["piece"], "text": r["text"],
                    "bytes": r["piece_bytes_hex"], "alone": bool(r["decodes_alone"]),
                    "special": bool(r.get("is_special", False))} for r in inp.tokens],
        "chat": inp.tokenize.get("messages") if inp.tokenize.get("chat") else None,
        "prompt_text": inp.tokenize.get("prompt"),
        "last": {"position": inp.position, "size": size, "logits": b64_floats(inp.logits),
                 "top": [int(i) for i in top], "text": {str(int(i)): vocab_text.get(int(i), "") for i in top}},
        "filters": [{"name": f["filter"], "temperature": f["temperature"], "top_k": f["top_k"], "top_p": f["top_p"],
                     "count": f["kept_count"], "kept": b64_bits(kept[f["filter"]], size)}
                    for f in filters if f["filter"] in kept],
        "temperatures": [t["temperature"] for t in inp.summary["temperatures"]],
        "positions": [{"position": p, "top": [[int(i), vocab_text.get(int(i), ""), float(row[i])]
                                              for i in logit_order(row)[:TOP_PER_POSITION]]}
                      for p, row in positions],
        "attention": {str(layer): {"heads": int(w.shape[0]), "n": int(w.shape[-1]), "offset": int(offset),
                                   "weights": b64_floats(w)} for layer, (offset, w) in attention.items()},
        "trajectories": _trajectories(inp),
        "checks": _checks(inp.checks),
        "lens": lens,
        "equivalence": equivalence,
    }


def _conditions(inp, forward: dict) -> list[list[str]]:
    facts, hw = inp.facts, forward.get("hardware", {})
    git, kernels = forward.get("git") or {}, forward.get("kernels") or {}
    cpu = f"{hw.get('cpu_model', '?')}, {hw.get('cpu_cores', '?')} cores"
    device = facts.get("device", "?") + ("" if not facts.get("gpu_name") else f" ({facts['gpu_name']})")
    kernel = (f"{kernels.get('mode', '?')}: ATen {kernels.get('aten_cpu_capability', '?')}, MKL {kernels.get('mkl')}, "
              f"oneDNN {kernels.get('onednn')}, {kernels.get('torch_threads')} threads; flags "
              f"{' '.join(kernels.get('cpu_flags') or [])}") if kernels else "not recorded"
    commit = git.get("commit") or "not a git checkout"
    return [["model", f"{inp.source.get('name')} ({facts.get('model_type')}, {facts.get('num_layers')} layers, "
                      f"capture {facts.get('capture_level', 'full')})"],
            ["dtype / attention", f"{facts.get('dtype')} / {facts.get('attn_implementation')}"],
            ["device", f"{device}; {cpu}"],
            ["kernel path", kernel],
            ["commit", f"{commit}{' (dirty)' if git.get('dirty') else ''}"],
            ["created", str(forward.get("created_at", ""))]]


def _trajectories(inp) -> list[dict]:
    branches: dict[str, dict] = {}
    for r in inp.steps:
        key = f"{r['branch']}{' (KV cache)' if r['kv_cache'] else ''}"
        b = branches.setdefault(key, {"name": key, "branch": r["branch"], "kv": bool(r["kv_cache"]), "steps": []})
        alts = [[int(i), float(p)] for i, p in zip(r["top_ids"], r["top_probs"])]
        b["steps"].append({"step": r["step"], "id": r["token_id"], "text": r["text_so_far"], "prob": r["prob"],
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


def render_page(data: dict) -> str:
    """The page: data as inline JSON (`</` escaped so no text in it can end the script), inline CSS and JS."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    title = html.escape(f"nexttoken explorer: {data['prompt_id']}")
    return (_TEMPLATE.replace("__CSP__", CSP).replace("__TITLE__", title).replace("__STYLE__", _STYLE)
            .replace("__SCRIPT__", _SCRIPT).replace("__DATA__", payload))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="__CSP__">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title><style>__STYLE__</style></head>
<body>
<header><h1>nexttoken explorer</h1><nav id="pages"></nav></header>
<main>
<section id="panel-conditions"><h2>Run</h2><table id="conditions"></table><div id="checks-summary"></div></section>
<section id="panel-tokens"><h2>Tokens</h2><div id="chat"></div><div id="tokens"></div>
<p class="note">A piece marked &#9888; does not decode alone (part of a multi-byte character); special tokens are
grey. Click a position to see its recorded top candidates.</p><div id="position-top"></div></section>
<section id="panel-next"><h2>Next token at the last position</h2>
<div class="controls">
<label>temperature <input id="temperature" type="number" min="0.05" max="10" step="0.05" value="1"></label>
<label>top-k (0 = off) <input id="top-k" type="number" min="0" step="1" value="0"></label>
<label>top-p (1 = off) <input id="top-p" type="number" min="0.01" max="1" step="0.01" value="1"></label>
</div>
<p>kept: <b id="kept-count"></b> ids, mass <b id="kept-mass"></b> <span id="kept-source" class="note"></span></p>
<table id="candidates"><thead><tr><th>rank</th><th>id</th><th>token</th><th>logit</th><th>p (FP64, before
filtering)</th><th></th></tr></thead><tbody></tbody></table></section>
<section id="panel-equivalence"><h2>Equivalence: a variation against the record</h2>
<div class="controls">
<label>variation <select id="eq-variation"></select></label>
<label>top-p <input id="eq-top-p" type="number" min="0.01" max="1" step="0.01" value="0.9"></label>
<span class="note">temperature: the Next token panel's (<span id="eq-temperature"></span>); top-k off</span>
</div>
<div id="eq-status" class="note"></div>
<table id="eq-figures"><tbody>
<tr><th>KL(record &#8214; variant), FP64, this position</th><td id="eq-kl"></td></tr>
<tr><th>top-1 (record &#8594; variant)</th><td id="eq-top1"></td></tr>
<tr><th>top-p kept (record &#8594; variant)</th><td><span id="eq-kept-recorded"></span> &#8594;
<span id="eq-kept-variant"></span>, Jaccard <b id="eq-jaccard"></b> <span id="eq-kept-source" class="note"></span>
</td></tr>
<tr><th>max / mean |&#916; logit|, this position</th><td><span id="eq-max-diff"></span> / <span id="eq-mean-diff">
</span></td></tr></tbody></table>
<p class="note" id="eq-row"></p>
<table id="eq-candidates"><thead><tr><th>id</th><th>token</th><th>rank rec</th><th>rank var</th><th>&#916; rank</th>
<th>logit rec</th><th>logit var</th><th>&#916; logit</th><th>p rec</th><th>p var</th><th>kept</th></tr></thead>
<tbody></tbody></table></section>
<section id="panel-lens"><h2>Logit lens</h2><div id="lens"></div></section>
<section id="panel-attention"><h2>Attention</h2><div id="attention"></div></section>
<section id="panel-trajectories"><h2>Trajectories</h2><div id="trajectories"></div></section>
<section id="panel-checks"><h2>Checks</h2><table id="checks"></table></section>
</main>
<script type="application/json" id="nt-data">__DATA__</script>
<script>__SCRIPT__</script>
</body></html>
"""

_STYLE = """
body{font-family:system-ui,sans-serif;margin:0;color:#1b1b1b;background:#fafafa}
header{background:#23395d;color:#fff;padding:8px 16px}header h1{font-size:18px;margin:0 0 4px}
nav a{color:#cfe0ff;margin-right:10px}nav a.current{color:#fff;font-weight:bold}
main{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:12px;padding:12px}
section{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;overflow:auto;max-height:640px}
h2{font-size:15px;margin:4px 0 8px}table{border-collapse:collapse;font-size:12px}
td,th{border-bottom:1px solid #eee;padding:2px 6px;text-align:left;vertical-align:top}
.tok{display:inline-block;border:1px solid #ccc;border-radius:3px;margin:2px;padding:1px 3px;font:12px monospace;
cursor:pointer}.tok small{color:#777}.tok.special{background:#eee;color:#777}.tok.split{border-color:#d08000}
.tok.sel{outline:2px solid #23395d}tr.kept{background:#e3f2e1}.note{color:#666;font-size:12px}
.controls label{margin-right:12px;font-size:13px}.controls input{width:70px}
.grid{display:grid;gap:1px;font:10px monospace}.cell{padding:1px;overflow:hidden;white-space:nowrap;min-width:26px}
.heat{image-rendering:pixelated;border:1px solid #ccc;margin:4px}
tr.flip{background:#fde2e2}#eq-figures th{font-weight:normal;color:#444}
.pass{color:#2a7a2a}.fail{color:#b00020;font-weight:bold}.step{font:12px monospace}.leave{background:#fff3cd}
"""

_SCRIPT = r"""
"use strict";
const D = JSON.parse(document.getElementById("nt-data").textContent);
const $ = (id) => document.getElementById(id);
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) { if (k === "class") e.className = v; else e.setAttribute(k, v); }
  for (const k of kids) e.append(k);
  return e;
}
function floats(b64) {
  const bin = atob(b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new Float32Array(bytes.buffer);
}
function bits(b64, n) {
  const bin = atob(b64), out = new Uint8Array(n);
  for (let i = 0; i < n; i++) out[i] = (bin.charCodeAt(i >> 3) >> (i & 7)) & 1;
  return out;
}
const LOGITS = floats(D.last.logits);             // float32 values of the bf16 logits, exact
const N = D.last.size;
// Ids by descending logit, equal logits by lower id: the order of p at any temperature > 0.
const ORDER = Array.from({length: N}, (_, i) => i).sort((a, b) => (LOGITS[b] - LOGITS[a]) || (a - b));
const RANK = new Int32Array(N); ORDER.forEach((id, r) => { RANK[id] = r + 1; });

// softmax(logits / T) in float64 over the full output size: x = l / T, p = exp(x - max) / sum.
function softmax64(T, L = LOGITS) {
  const p = new Float64Array(N);
  let m = -Infinity;
  for (let i = 0; i < N; i++) { const x = L[i] / T; p[i] = x; if (x > m) m = x; }
  let s = 0;
  for (let i = 0; i < N; i++) { const e = Math.exp(p[i] - m); p[i] = e; s += e; }
  for (let i = 0; i < N; i++) p[i] = p[i] / s;
  return p;
}
// The FP64 nucleus: top-k (ids tied with the k-th kept), then the smallest prefix (by p, ties by lower
// id) of the top-k-renormalised distribution whose mass reaches top_p.
function keptFP64(p, k, topP, order = ORDER, L = LOGITS) {
  let ids = order;
  if (k > 0 && k < N) { const kth = L[order[k - 1]]; ids = order.filter((i) => L[i] >= kth); }
  if (topP >= 1) return ids;
  let z = 0; for (const i of ids) z += p[i];
  const out = []; let c = 0;
  for (const i of ids) { out.push(i); c += p[i] / z; if (c >= topP) break; }
  return out;
}
function configured(T, k, topP) {
  return D.filters.find((f) => f.temperature === T && f.top_k === k && f.top_p === topP);
}
function update() {
  const T = Number($("temperature").value), k = Math.trunc(Number($("top-k").value)), topP = Number($("top-p").value);
  if (!(T > 0) || !(k >= 0) || !(topP > 0 && topP <= 1)) { $("kept-source").textContent = "(invalid setting)"; return; }
  const p = softmax64(T);
  const f = configured(T, k, topP);
  let keptMask, count;
  if (f) {
    keptMask = bits(f.kept, N); count = f.count;
    $("kept-source").textContent = `(the set recorded by transformers' warpers for filter ${f.name}: filtered.parquet)`;
  } else {
    keptMask = new Uint8Array(N); const ids = keptFP64(p, k, topP); ids.forEach((i) => { keptMask[i] = 1; });
    count = ids.length;
    $("kept-source").textContent = "(computed here in FP64: not a configured filter)";
  }
  let mass = 0;
  for (const i of ORDER) if (keptMask[i]) mass += p[i];
  $("kept-count").textContent = String(count);
  $("kept-mass").textContent = String(mass);
  updateEquivalence();
  const body = $("candidates").tBodies[0];
  body.replaceChildren(...D.last.top.map((id) => {
    const tr = el("tr", {"data-token-id": String(id), "data-prob": String(p[id]), class: keptMask[id] ? "kept" : ""},
      el("td", {}, String(RANK[id])), el("td", {}, String(id)), el("td", {}, JSON.stringify(D.last.text[id] ?? "")),
      el("td", {}, String(LOGITS[id])), el("td", {}, String(p[id])), el("td", {}, keptMask[id] ? "kept" : ""));
    return tr;
  }));
}
function pages() {
  const nav = $("pages");
  for (const [pid, file] of Object.entries(D.pages)) {
    nav.append(el("a", {href: file, class: pid === D.prompt_id ? "current" : ""}, pid));
  }
}
function conditions() {
  $("conditions").append(...D.conditions.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))));
}
function tokens() {
  if (D.chat) $("chat").append(el("p", {class: "note"}, "Chat prompt, rendered by the tokenizer's own template:"),
    ...D.chat.map((m) => el("p", {}, el("b", {}, m.role + ": "), m.content)));
  const box = $("tokens");
  for (const t of D.tokens) {
    const cls = "tok" + (t.special ? " special" : "") + (t.alone ? "" : " split");
    const span = el("span", {class: cls, "data-position": String(t.position), title: `id ${t.id}, bytes ${t.bytes}`},
      (t.alone ? "" : "\u26a0") + JSON.stringify(t.text).slice(1, -1), el("small", {}, " " + t.id));
    span.addEventListener("click", () => showPosition(t.position, span));
    box.append(span);
  }
}
function showPosition(pos, span) {
  document.querySelectorAll(".tok.sel").forEach((s) => s.classList.remove("sel"));
  if (span) span.classList.add("sel");
  const row = D.positions.find((r) => r.position === pos);
  const out = $("position-top");
  if (!row) { out.replaceChildren(el("p", {class: "note"}, `position ${pos}: no logits recorded there`)); return; }
  out.replaceChildren(el("p", {}, `position ${pos}: recorded top candidates (logit)`),
    el("table", {id: "position-candidates"}, ...row.top.map(([id, text, logit]) =>
      el("tr", {"data-token-id": String(id)}, el("td", {}, String(id)), el("td", {}, JSON.stringify(text)),
        el("td", {}, String(logit))))));
}
function heat(canvas, w, h, value) {
  const ctx = canvas.getContext("2d"), img = ctx.createImageData(w, h);
  for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) {
    const v = Math.max(0, Math.min(1, value(x, y))), o = 4 * (y * w + x);
    img.data[o] = 255 - Math.round(220 * v); img.data[o + 1] = 255 - Math.round(180 * v);
    img.data[o + 2] = 255 - Math.round(90 * v); img.data[o + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
}
function attention() {
  const box = $("attention");
  const layers = Object.keys(D.attention);
  if (!layers.length) { box.append(el("p", {class: "note"}, "no attention weights captured")); return; }
  for (const layer of layers) {
    const a = D.attention[layer], w = floats(a.weights), n = a.n;
    const row = el("div", {}, el("p", {}, `layer ${layer} (positions ${a.offset}..${a.offset + n - 1}; row = query)`));
    for (let h = 0; h < a.heads; h++) {
      const c = el("canvas", {class: "heat", width: String(n), height: String(n), title: `layer ${layer} head ${h}`});
      c.style.width = c.style.height = Math.max(96, 3 * n) + "px";
      heat(c, n, n, (x, y) => w[h * n * n + y * n + x]);
      row.append(el("span", {}, `head ${h} `), c);
    }
    box.append(row);
  }
}
function lens() {
  const box = $("lens"), L = D.lens;
  if (!L) { box.append(el("p", {class: "note"}, "no logit lens in this run")); return; }
  box.append(el("p", {class: "note"}, "layer x position: the top-1 piece after the model's own final norm and " +
    "LM head; colour = its probability (FP64); hover for the top 5 and the final token's rank"));
  const grid = el("div", {class: "grid", id: "lens-grid"});
  grid.style.gridTemplateColumns = `60px repeat(${L.positions.length}, minmax(26px, 1fr))`;
  grid.append(el("div", {}, "layer"), ...L.positions.map((p) => el("div", {class: "cell"}, String(p))));
  for (let li = L.layers.length - 1; li >= 0; li--) {
    grid.append(el("div", {}, String(L.layers[li])));
    for (let pi = 0; pi < L.positions.length; pi++) {
      const c = L.cells[li][pi], v = c.p;
      const cell = el("div", {class: "cell", title: c.top5.map(([t, q]) => `${JSON.stringify(t)} ${q.toPrecision(4)}`)
        .join("\n") + `\nfinal token's rank: ${c.final_rank}`}, c.text);
      cell.style.background = `rgba(35,57,93,${0.08 + 0.9 * v})`; cell.style.color = v > 0.5 ? "#fff" : "#111";
      grid.append(cell);
    }
  }
  box.append(grid);
}
function trajectories() {
  const box = $("trajectories");
  const greedy = D.trajectories.find((b) => b.branch === "greedy" && !b.kv);
  for (const b of D.trajectories) {
    const twin = D.trajectories.find((o) => o.branch === b.branch && o.kv !== b.kv);
    const agree = twin ? b.steps.every((s, i) => twin.steps[i] && twin.steps[i].id === s.id) : null;
    const kv = agree === null ? "" : agree ? ": KV cache and full prefix agree" : ": KV cache and full prefix DIFFER";
    const head = `${b.name}${kv}${b.loop ? " (loop)" : ""}`;
    const t = el("table", {class: "step"}, el("tr", {}, el("th", {}, "step"), el("th", {}, "id"), el("th", {}, "p"),
      el("th", {}, "text so far"), el("th", {}, "alternatives (id p)")));
    b.steps.forEach((s, i) => {
      const leaves = greedy && b.branch !== "greedy" && greedy.steps[i] && greedy.steps[i].id !== s.id;
      t.append(el("tr", {class: leaves ? "leave" : ""}, el("td", {}, String(s.step)), el("td", {}, String(s.id)),
        el("td", {}, s.prob.toPrecision(6)), el("td", {}, JSON.stringify(s.text)),
        el("td", {}, s.alts.map(([id, q]) => `${id} ${q.toPrecision(3)}`).join(", "))));
    });
    box.append(el("h3", {}, head), t);
  }
}
function checks() {
  if (!D.checks) { $("checks").append(el("tr", {}, el("td", {}, "the checks stage has not run"))); return; }
  if (!D.checks.length) {
    $("checks-summary").append(el("p", {},
      "checks: none ran on this prompt (outside the checks.prompts sample of a large set)"));
    return;
  }
  const failed = D.checks.filter((c) => c.verdict !== "pass");
  const errors = failed.filter((c) => c.severity === "error").length;
  $("checks-summary").append(el("p", {}, `checks: ${D.checks.length - failed.length} of ${D.checks.length} pass; ` +
    `${errors} error and ${failed.length - errors} report checks fail`));
  $("checks").append(...D.checks.map((c) => el("tr", {}, el("td", {class: c.verdict}, c.verdict),
    el("td", {}, c.severity), el("td", {}, c.name), el("td", {}, c.value === null ? "" : String(c.value)))));
}
// ---- Equivalence: the recorded next-token distribution against a variation's, at the page's temperature
const EQ = D.equivalence, EQ_CACHE = {};
function half(x) {
  const s = x & 0x8000 ? -1 : 1, e = (x >> 10) & 0x1f, f = x & 0x3ff;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}
function variantLogits(v) {            // exact: the encodings are lossless (explorer.variant_encoding)
  if (v.encoding === "same") return LOGITS;
  if (v.encoding === "nan") return new Float32Array(N).fill(NaN);
  const bin = atob(v.logits), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  if (v.encoding === "f4") return new Float32Array(bytes.buffer);
  const h = new Uint16Array(bytes.buffer), out = new Float32Array(h.length);
  if (v.encoding === "bf16") {
    const u = new Uint32Array(out.buffer);
    for (let i = 0; i < h.length; i++) u[i] = h[i] << 16;
  }
  else for (let i = 0; i < h.length; i++) out[i] = half(h[i]);
  return out;
}
function variant(i) {
  if (!EQ_CACHE[i]) {
    const L = variantLogits(EQ.variations[i]);
    const order = L === LOGITS ? ORDER : Array.from({length: N}, (_, j) => j).sort((a, b) => (L[b] - L[a]) || (a - b));
    const rank = new Int32Array(N); order.forEach((id, r) => { rank[id] = r + 1; });
    EQ_CACHE[i] = {L, order, rank};
  }
  return EQ_CACHE[i];
}
// log softmax(logits / T) in float64: x - max - log(sum exp(x - max)), for the KL
function logSoftmax64(T, L) {
  const out = new Float64Array(N);
  let m = -Infinity;
  for (let i = 0; i < N; i++) { const x = L[i] / T; out[i] = x; if (x > m) m = x; }
  let s = 0;
  for (let i = 0; i < N; i++) s += Math.exp(out[i] - m);
  const c = m + Math.log(s);
  for (let i = 0; i < N; i++) out[i] = out[i] - c;
  return out;
}
function g(x) {
  return x === null || x === undefined ? "n/a" : typeof x === "number" && x !== 0 ? x.toPrecision(4) : String(x);
}
function storedRow(v) {
  const r = v.row;
  return `stored row (equivalence.parquet, ${v.compared}, ${r.n_positions} positions, T = 1): ` +
    `KL mean ${g(r.kl_mean)}, max ${g(r.kl_max)}, at the last one ${g(r.kl_last)}; ` +
    `top-p 0.9 kept ${r.kept_recorded} → ${r.kept_variant}, Jaccard ${g(r.kept_jaccard)} ` +
    `(transformers' float32 warper); top-1 changed at ` +
    `${r.top1_changed.length ? r.top1_changed.join(", ") : "no position"}; max |Δ logit| ${g(r.max_abs_diff)}, ` +
    `mean ${g(r.mean_abs_diff)}; bit-identical ${r.bit_identical ? "yes" : "no"}; first differing tensor ` +
    `${r.first_differing_tensor || "none"}; ${r.note || ""}`;
}
function eqClear(why) {
  for (const id of ["eq-kl", "eq-top1", "eq-kept-recorded", "eq-kept-variant", "eq-jaccard", "eq-max-diff",
                    "eq-mean-diff", "eq-kept-source"]) $(id).textContent = "";
  $("eq-candidates").tBodies[0].replaceChildren();
  $("eq-status").textContent = why;
}
function equivalenceSetup() {
  if (!EQ) { $("eq-variation").disabled = true; $("eq-top-p").disabled = true;
    eqClear("the equivalence stage did not run for this prompt (equivalence.prompts)"); return; }
  $("eq-variation").append(...EQ.variations.map((v, i) =>
    el("option", {value: v.name, "data-index": String(i)}, v.name + (v.shown ? "" : " (not shown)"))));
  const first = EQ.variations.findIndex((v) => v.shown);
  if (first >= 0) $("eq-variation").selectedIndex = first;
  $("eq-variation").addEventListener("change", updateEquivalence);
  $("eq-top-p").addEventListener("input", updateEquivalence);
}
function updateEquivalence() {
  if (!EQ) return;
  const T = Number($("temperature").value), topP = Number($("eq-top-p").value);
  $("eq-temperature").textContent = `T = ${T}`;
  const idx = EQ.variations.findIndex((v) => v.name === $("eq-variation").value), v = EQ.variations[idx];
  if (!v) { eqClear("no variation chosen"); return; }
  $("eq-row").textContent = storedRow(v);
  if (!v.shown) { eqClear(`${v.name}: not shown: ${v.why}`); return; }
  if (!(T > 0) || !(topP > 0 && topP <= 1)) { eqClear("(invalid setting)"); return; }
  if (v.encoding === "nan") { eqClear(`${v.name}: every logit is NaN at position ${EQ.position} (${v.dtype}): ` +
    "no distribution to compare"); return; }
  const V = variant(idx);
  const p = softmax64(T), q = softmax64(T, V.L), lp = logSoftmax64(T, LOGITS), lq = logSoftmax64(T, V.L);
  let kl = 0, maxd = 0, sumd = 0;
  for (let i = 0; i < N; i++) {
    if (p[i] > 0) kl += p[i] * (lp[i] - lq[i]);
    const d = Math.abs(LOGITS[i] - V.L[i]); if (!(d <= maxd)) maxd = d; sumd += d;
  }
  // at the row's own setting the sets are the row's (transformers' float32 warper, which breaks ties at the
  // boundary its own way); elsewhere the FP64 nucleus
  const rows = T === 1 && topP === 0.9 && v.kept;
  const kr = rows ? v.kept.recorded : keptFP64(p, 0, topP);
  const kv = rows ? v.kept.variant : keptFP64(q, 0, topP, V.order, V.L);
  $("eq-kept-source").textContent = rows ? "(the row's sets: transformers' float32 warper at T = 1, top-p 0.9)"
    : "(computed here: the FP64 nucleus)";
  const inR = new Uint8Array(N), inV = new Uint8Array(N);
  kr.forEach((i) => { inR[i] = 1; }); kv.forEach((i) => { inV[i] = 1; });
  let both = 0; for (const i of kv) both += inR[i];
  const jaccard = kr.length + kv.length - both ? both / (kr.length + kv.length - both) : 1;
  const a = ORDER[0], b = V.order[0];
  $("eq-status").textContent = `${v.name} (${v.dtype}, embedded as ${v.encoding}) at position ${EQ.position}, ` +
    `the next token's`;
  $("eq-kl").textContent = String(kl);
  const top1 = $("eq-top1");
  top1.textContent = a === b ? `same: ${a}` : `changed: ${a} → ${b}`;
  top1.dataset.changed = String(a !== b); top1.dataset.recorded = String(a); top1.dataset.variant = String(b);
  $("eq-kept-recorded").textContent = String(kr.length); $("eq-kept-variant").textContent = String(kv.length);
  $("eq-jaccard").textContent = String(jaccard);
  $("eq-max-diff").textContent = String(maxd); $("eq-mean-diff").textContent = String(sumd / N);
  const ids = [...new Set([...ORDER.slice(0, EQ.top), ...V.order.slice(0, EQ.top)])].sort((x, y) => RANK[x] - RANK[y]);
  const text = (id) => D.last.text[id] ?? v.text[id] ?? "";
  $("eq-candidates").tBodies[0].replaceChildren(...ids.map((id) => {
    const rr = RANK[id], rv = V.rank[id];
    return el("tr", {"data-token-id": String(id), "data-p-recorded": String(p[id]), "data-p-variant": String(q[id]),
                     "data-rank-recorded": String(rr), "data-rank-variant": String(rv),
                     "data-delta-logit": String(V.L[id] - LOGITS[id]),
                     class: a !== b && (id === a || id === b) ? "flip" : ""},
      el("td", {}, String(id)), el("td", {}, JSON.stringify(text(id))), el("td", {}, String(rr)),
      el("td", {}, String(rv)), el("td", {}, rv === rr ? "0" : (rv > rr ? "+" : "") + String(rv - rr)),
      el("td", {}, String(LOGITS[id])), el("td", {}, String(V.L[id])), el("td", {}, String(V.L[id] - LOGITS[id])),
      el("td", {}, String(p[id])), el("td", {}, String(q[id])),
      el("td", {}, (inR[id] ? "rec" : "") + (inR[id] && inV[id] ? " + " : "") + (inV[id] ? "var" : "")));
  }));
}
pages(); conditions(); tokens(); lens(); equivalenceSetup(); attention(); trajectories(); checks();
for (const id of ["temperature", "top-k", "top-p"]) $(id).addEventListener("input", update);
update();
showPosition(D.last.position, document.querySelector(`.tok[data-position="${D.last.position}"]`));
"""
