const D = JSON.parse(document.getElementById("nt-data").textContent);
const $ = (id) => document.getElementById(id);
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) { if (k === "class") e.className = v; else e.setAttribute(k, v); }
  for (const k of kids) e.append(k);
  return e;
}
const LOGITS = decodeLogits(D.last.encoding, D.last.logits, D.last.size, null);   // the recorded values, exact
const N = D.last.size;
const ORDER = logitOrder(LOGITS);                 // the order of p at any temperature > 0
const RANK = ranks(ORDER);

function configured(T, k, topP) {
  return D.filters.find((f) => f.temperature === T && f.top_k === k && f.top_p === topP);
}
let SHOWN = null;        // what the Next token panel shows: {T, p, kept (ids in rank order)}, null when invalid
function clearNext(why) {
  SHOWN = null;
  $("input-error").textContent = why;
  for (const id of ["kept-count", "kept-mass", "kept-source"]) $(id).textContent = "";
  $("candidates").tBodies[0].replaceChildren();
  clearSample();
}
function clearSample() {
  $("sampled-id").textContent = ""; $("sampled-text").textContent = "";
  delete $("sampled-id").dataset.seed;
  document.querySelectorAll("#candidates tr.picked").forEach((r) => r.classList.remove("picked"));
}
function percent(x) {
  return x >= 0.001 ? (100 * x).toFixed(1) + "%" : x > 0 ? (100 * x).toPrecision(2) + "%" : "0%";
}
function update() {
  const s = parseSetting($("temperature").value, $("top-k").value, $("top-p").value);
  if (s.error) { clearNext(s.error); updateEquivalence(); return; }
  const {T, k, topP} = s;
  $("input-error").textContent = "";
  clearSample();
  const p = distribution(LOGITS, T);
  const f = T > 0 ? configured(T, k, topP) : null;
  let keptMask, kept;
  if (T === 0) {
    kept = [greedy(LOGITS)]; keptMask = new Uint8Array(N); keptMask[kept[0]] = 1;
    $("kept-source").textContent = "(T = 0: greedy, the highest logit; top-k and top-p do not apply)";
  } else if (f) {
    kept = keptIds(f.kept, ORDER, N); keptMask = new Uint8Array(N); kept.forEach((i) => { keptMask[i] = 1; });
    $("kept-source").textContent = `(the set recorded by transformers' warpers for filter ${f.name}: filtered.parquet)`;
  } else {
    kept = keptFP64(p, k, topP, ORDER, LOGITS); keptMask = new Uint8Array(N); kept.forEach((i) => { keptMask[i] = 1; });
    $("kept-source").textContent = "(computed here in FP64: not a configured filter)";
  }
  let mass = 0;
  for (const i of ORDER) if (keptMask[i]) mass += p[i];
  SHOWN = {T, p, kept};
  $("kept-count").textContent = String(f ? f.count : kept.length);
  $("kept-mass").textContent = String(mass);
  updateEquivalence();
  const body = $("candidates").tBodies[0], top = p[ORDER[0]] || 1;
  body.replaceChildren(...D.last.top.map((id) => {
    const bar = el("div", {class: "bar", title: `p = ${p[id]}`}, el("span", {}));
    bar.firstChild.style.width = (100 * p[id] / top).toFixed(3) + "%";      // the top candidate spans the track
    return el("tr", {"data-token-id": String(id), "data-prob": String(p[id]), class: keptMask[id] ? "kept" : ""},
      el("td", {}, String(RANK[id])), el("td", {class: "tokcell"}, JSON.stringify(D.last.text[id] ?? "").slice(1, -1)),
      el("td", {class: "pct", title: `p = ${p[id]}`}, percent(p[id])), el("td", {class: "barcell"}, bar),
      el("td", {}, String(id)), el("td", {}, String(LOGITS[id])));
  }));
}
// "sample once": one draw from the shown distribution (kept set, FP64) by inverse CDF, u from SplitMix64(seed);
// the seed box then moves on by one, so the next click draws anew (docs/explorer.md repeats it in numpy).
function sampleOnce() {
  if (!SHOWN) return;
  const seed = parseSeed($("seed").value);
  if (seed === null) {
    clearSample();
    $("input-error").textContent = `seed = ${$("seed").value}: not allowed; a whole number in [0, 2^64)`;
    return;
  }
  $("input-error").textContent = "";
  const u = uniform(splitmix64(seed));
  const id = SHOWN.T === 0 ? SHOWN.kept[0] : inverseCdf(SHOWN.p, SHOWN.kept, u);
  clearSample();
  const out = $("sampled-id");
  out.textContent = String(id); out.dataset.seed = String(seed); out.dataset.u = String(u);
  $("sampled-text").textContent = `${JSON.stringify(D.last.text[id] ?? "")} (seed ${seed}, u = ${u.toFixed(6)})`;
  const row = document.querySelector(`#candidates tr[data-token-id="${id}"]`);
  if (row) row.classList.add("picked");
  $("seed").value = String(seed + 1n < 2n ** 64n ? seed + 1n : 0n);
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
// Attention: a layer chooser over every captured layer; for the chosen one, what the last position attends to, per
// head, under the tokens' own labels; below it that layer's full maps (row = query).
function attention() {
  const box = $("attention");
  const layers = Object.keys(D.attention);
  if (!layers.length) { box.append(el("p", {class: "note"}, "no attention weights captured")); return; }
  const pick = el("select", {id: "attention-layer"}, ...layers.map((l) => el("option", {value: l}, `layer ${l}`)));
  const focus = el("div", {id: "attention-focus"});
  box.append(el("label", {}, "layer ", pick), focus);
  const blocks = {};
  for (const layer of layers) {
    const a = D.attention[layer], w = floats(a.weights), n = a.n;
    const row = el("div", {class: "att-maps", "data-layer": layer},
      el("p", {class: "note"}, `layer ${layer}, every head (positions ${a.offset}..${a.offset + n - 1}; row = query)`));
    for (let h = 0; h < a.heads; h++) {
      const c = el("canvas", {class: "heat", width: String(n), height: String(n), title: `layer ${layer} head ${h}`});
      c.style.width = c.style.height = Math.max(96, 3 * n) + "px";
      heat(c, n, n, (x, y) => w[h * n * n + y * n + x]);
      row.append(el("span", {}, `head ${h} `), c);
    }
    blocks[layer] = {a, w, row};
    box.append(row);
  }
  const show = () => {
    const {a, w} = blocks[pick.value], n = a.n, q = n - 1;
    for (const [l, b] of Object.entries(blocks)) b.row.hidden = l !== pick.value;
    const label = (pos) => JSON.stringify(D.tokens.find((t) => t.position === pos)?.text ?? "").slice(1, -1);
    const grid = el("div", {class: "att-grid", id: "attention-last"});
    grid.style.gridTemplateColumns = `64px repeat(${n}, minmax(0, 1fr))`;
    grid.append(el("div", {}, ""), ...Array.from({length: n}, (_, k) =>
      el("div", {class: "att-label", title: `position ${a.offset + k}`}, label(a.offset + k))));
    for (let h = 0; h < a.heads; h++) {
      grid.append(el("div", {class: "att-head"}, `head ${h}`));
      for (let k = 0; k < n; k++) {
        const v = w[h * n * n + q * n + k];
        const cell = el("div", {class: "att-cell", title: `head ${h} → ${JSON.stringify(label(a.offset + k))}: ${v}`},
          v >= 0.1 ? `${Math.round(100 * v)}` : "");
        cell.style.background = `rgba(35,57,93,${Math.min(1, v)})`; cell.style.color = v > 0.35 ? "#fff" : "#111";
        grid.append(cell);
      }
    }
    focus.replaceChildren(el("p", {class: "note"}, `what position ${a.offset + q} (the last) attends to, ` +
      `in percent, per head of layer ${pick.value}`), grid);
  };
  pick.value = layers[layers.length - 1];
  pick.addEventListener("change", show);
  show();
}
function lens() {
  const box = $("lens"), L = D.lens;
  if (!L) { box.append(el("p", {class: "note"}, "no logit lens in this run")); return; }
  box.append(el("p", {class: "note"}, "layer x position: the top-1 piece after the model's own final norm and " +
    "LM head; colour = its probability (FP64); hover for the top 5 and the final token's rank"));
  const grid = el("div", {class: "grid", id: "lens-grid"});
  grid.style.gridTemplateColumns = `44px repeat(${L.positions.length}, minmax(0, 1fr))`;   // fits: no scrolling
  grid.append(el("div", {}, "layer"), ...L.positions.map((p) => el("div", {class: "cell"}, String(p))));
  for (let li = L.layers.length - 1; li >= 0; li--) {
    grid.append(el("div", {}, String(L.layers[li])));
    for (let pi = 0; pi < L.positions.length; pi++) {
      const c = L.cells[li][pi], v = c.p;
      const cell = el("div", {class: "cell", title: c.top5.map(([t, q]) => `${JSON.stringify(t)} ${q.toPrecision(4)}`)
        .join("\n") + `\nfinal token's rank: ${c.final_rank}`}, c.text);
      // white text from the middle of the scale on (contrast >= 4.5:1 either side)
      cell.style.background = `rgba(35,57,93,${0.08 + 0.9 * v})`; cell.style.color = v > 0.35 ? "#fff" : "#111";
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
    const t = el("table", {class: "step"}, el("tr", {}, el("th", {}, "step"), el("th", {}, "token id"), el("th", {}, "p"),
      el("th", {}, "text so far"), el("th", {}, "alternatives (text id p)")));
    b.steps.forEach((s, i) => {
      const leaves = greedy && b.branch !== "greedy" && greedy.steps[i] && greedy.steps[i].id !== s.id;
      t.append(el("tr", {class: leaves ? "leave" : ""}, el("td", {}, String(s.step)),
        el("td", {}, `${JSON.stringify(s.piece ?? "")} ${s.id}`),
        el("td", {}, s.prob.toPrecision(6)), el("td", {}, JSON.stringify(s.text)),
        el("td", {}, s.alts.map(([id, q, text]) => `${JSON.stringify(text ?? "")} ${id} ${(100 * q).toPrecision(3)}%`)
          .join(", "))));
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
function variantLogits(v) {            // exact: the encodings are lossless (explorer.variant_encoding)
  const ref = v.params && v.params.ref != null ? variant(EQ.variations.findIndex((o) => o.name === v.params.ref)).L
    : LOGITS;                          // "same" and a "rice" row against the record; "as" / "rice" against an earlier one
  return decodeLogits(v.encoding, v.logits, N, ref, v.params);
}
function variant(i) {
  if (!EQ_CACHE[i]) {
    const L = variantLogits(EQ.variations[i]);
    const order = L === LOGITS ? ORDER : logitOrder(L);
    const rank = ranks(order);
    EQ_CACHE[i] = {L, order, rank};
  }
  return EQ_CACHE[i];
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
  if (!EQ) {           // no empty shell: the panel says why in one line
    $("eq-variation").disabled = true; $("eq-top-p").disabled = true;
    for (const e of document.querySelectorAll("#panel-equivalence .controls, #eq-figures, #eq-candidates, #eq-row")) {
      e.hidden = true;
    }
    eqClear("the equivalence stage did not run for this prompt (equivalence.prompts)"); return;
  }
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
  if (T === 0) { eqClear("T = 0 (greedy): no distribution to compare; choose a temperature > 0"); return; }
  if (!(T > 0) || !(topP > 0 && topP <= 1)) { eqClear("(invalid setting)"); return; }
  if (v.encoding === "nan") { eqClear(`${v.name}: every logit is NaN at position ${EQ.position} (${v.dtype}): ` +
    "no distribution to compare"); return; }
  const V = variant(idx);
  const p = softmax64(LOGITS, T), q = softmax64(V.L, T), lp = logSoftmax64(LOGITS, T), lq = logSoftmax64(V.L, T);
  let kl = 0, maxd = 0, sumd = 0;
  for (let i = 0; i < N; i++) {
    if (p[i] > 0) kl += p[i] * (lp[i] - lq[i]);
    const d = Math.abs(LOGITS[i] - V.L[i]); if (!(d <= maxd)) maxd = d; sumd += d;
  }
  // at the row's own setting the sets are the row's (transformers' float32 warper, which breaks ties at the
  // boundary its own way); elsewhere the FP64 nucleus
  const rows = T === 1 && topP === 0.9 && v.kept;
  const kr = rows ? keptIds(v.kept.recorded, ORDER, N) : keptFP64(p, 0, topP, ORDER, LOGITS);
  const kv = rows ? keptIds(v.kept.variant, V.order, N) : keptFP64(q, 0, topP, V.order, V.L);
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
pages(); conditions(); tokens(); walk(); lens(); equivalenceSetup(); attention(); trajectories(); checks();
$("language").addEventListener("change", () => setLanguage($("language").value));
setLanguage(D.language === "zh" ? "zh" : "en");
for (const id of ["temperature", "top-k", "top-p"]) $(id).addEventListener("input", update);
$("temperature").addEventListener("input", () => {
  const t = Number($("temperature").value);
  if (t >= 0 && t <= 2) $("temperature-slider").value = String(t);
});
$("temperature-slider").addEventListener("input", () => {
  $("temperature").value = $("temperature-slider").value; update();
});
$("sample").addEventListener("click", sampleOnce);
$("seed").value = String(D.seed ?? 0);
$("model-line").textContent = D.conditions[0][1];
$("next-where").textContent = `after position ${D.last.position}, ` +
  JSON.stringify(D.tokens.find((t) => t.position === D.last.position)?.text ?? "");
update();
showPosition(D.last.position, document.querySelector(`.tok[data-position="${D.last.position}"]`));
