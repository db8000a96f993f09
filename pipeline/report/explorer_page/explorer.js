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
  setUi($("input-error"), why.code, why.raw);
  for (const id of ["kept-count", "kept-mass", "kept-source"]) clearUi($(id));
  $("candidates").tBodies[0].replaceChildren();
  clearSample();
}
function clearSample() {
  $("sampled-id").textContent = ""; clearUi($("sampled-text"));
  delete $("sampled-id").dataset.seed;
  document.querySelectorAll("#candidates tr.picked").forEach((r) => r.classList.remove("picked"));
}
function percent(x) {
  return x >= 0.001 ? (100 * x).toFixed(1) + "%" : x > 0 ? (100 * x).toPrecision(2) + "%" : "0%";
}
function update() {
  const s = parseSetting($("temperature").value, $("top-k").value, $("top-p").value);
  if (s.error) { clearNext(s); updateEquivalence(); return; }
  const {T, k, topP} = s;
  clearUi($("input-error"));
  clearSample();
  const p = distribution(LOGITS, T);
  const f = T > 0 ? configured(T, k, topP) : null;
  let keptMask, kept;
  if (T === 0) {
    kept = [greedy(LOGITS)]; keptMask = new Uint8Array(N); keptMask[kept[0]] = 1;
    setUi($("kept-source"), "src-greedy");
  } else if (f) {
    kept = keptIds(f.kept, ORDER, N); keptMask = new Uint8Array(N); kept.forEach((i) => { keptMask[i] = 1; });
    setUi($("kept-source"), "src-warper", f.name, "filtered.parquet");
  } else {
    kept = keptFP64(p, k, topP, ORDER, LOGITS); keptMask = new Uint8Array(N); kept.forEach((i) => { keptMask[i] = 1; });
    setUi($("kept-source"), "src-fp64");
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
    const row = el("tr", {"data-token-id": String(id), "data-prob": String(p[id]), tabindex: "0",
                          class: (keptMask[id] ? "kept" : "") + (forcedBranch(id) ? " has-branch" : "") +
                            ($("what-if")?.dataset.tokenId === String(id) ? " wi-sel" : "")},
      el("td", {}, String(RANK[id])), el("td", {class: "tokcell", translate: "no"}, JSON.stringify(D.last.text[id] ?? "").slice(1, -1)),
      el("td", {class: "pct", title: `p = ${p[id]}`}, percent(p[id])), el("td", {class: "barcell"}, bar),
      el("td", {}, String(id)), el("td", {}, String(LOGITS[id])));
    row.addEventListener("click", () => whatIf(id, true));           // what if the model had picked it (step what-if)
    row.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); whatIf(id, true); } });
    return row;
  }));
}
// "sample once": one draw from the shown distribution (kept set, FP64) by inverse CDF, u from SplitMix64(seed);
// the seed box then moves on by one, so the next click draws anew (docs/explorer.md repeats it in numpy).
function sampleOnce() {
  if (!SHOWN) return;
  const seed = parseSeed($("seed").value);
  if (seed === null) {
    clearSample();
    setUi($("input-error"), "err-seed", $("seed").value);
    return;
  }
  clearUi($("input-error"));
  const u = uniform(splitmix64(seed));
  const id = SHOWN.T === 0 ? SHOWN.kept[0] : inverseCdf(SHOWN.p, SHOWN.kept, u);
  clearSample();
  const out = $("sampled-id");
  out.textContent = String(id); out.dataset.seed = String(seed); out.dataset.u = String(u);
  setUi($("sampled-text"), "drawn-how", JSON.stringify(D.last.text[id] ?? ""), String(seed), u.toFixed(6));
  const row = document.querySelector(`#candidates tr[data-token-id="${id}"]`);
  if (row) row.classList.add("picked");
  $("seed").value = String(seed + 1n < 2n ** 64n ? seed + 1n : 0n);
}
function pages() {
  const nav = $("pages");
  for (const [pid, file] of Object.entries(D.pages)) {
    nav.append(el("a", {href: file, class: pid === D.prompt_id ? "current" : "", translate: "no"}, pid));
  }
}
function conditions() {
  $("conditions").append(...D.conditions.map(([k, v]) => el("tr", {}, ui("th", `cond-${k}`),
    el("td", {translate: "no"}, v))));
}
function tokens() {
  if (D.chat) $("chat").append(ui("p", "chat", [], {class: "note"}),
    ...D.chat.map((m) => el("p", {translate: "no"}, el("b", {}, m.role + ": "), m.content)));
  const box = $("tokens");
  if (D.tokens.some((t) => t.p !== undefined)) $("tokens-shade").hidden = false;
  for (const t of D.tokens) {
    const cls = "tok" + (t.special ? " special" : "") + (t.alone ? "" : " split");
    const span = el("span", {class: cls, "data-position": String(t.position), translate: "no"},
      (t.alone ? "" : "\u26a0") + JSON.stringify(t.text).slice(1, -1), el("small", {}, " " + t.id));
    if (t.p !== undefined) {          // shaded by the probability the position before gave it (T = 1)
      span.style.background = probColor(t.p); span.dataset.p = String(t.p); span.dataset.source = "logits.parquet";
      tip(span, "tok-p", t.id, t.bytes, t.p, t.rank, t.position - 1);
    } else tip(span, "tok", t.id, t.bytes);
    span.addEventListener("click", () => showPosition(t.position, span));
    box.append(span);
  }
}
// green, darker the likelier: alpha from sqrt(p), so that 1% and 10% differ as much as 25% and 100% nearly do;
// dark text stays readable on the darkest (contrast > 6:1)
function probColor(p) {
  return `rgba(46,125,50,${(0.04 + 0.6 * Math.sqrt(Math.max(0, Math.min(1, p)))).toFixed(3)})`;
}
function showPosition(pos, span) {
  document.querySelectorAll(".tok.sel").forEach((s) => s.classList.remove("sel"));
  if (span) span.classList.add("sel");
  const row = D.positions.find((r) => r.position === pos);
  const out = $("position-top");
  if (!row) { out.replaceChildren(ui("p", "pos-none", [pos], {class: "note"})); return; }
  out.replaceChildren(ui("p", "pos-top", [pos]),
    el("table", {id: "position-candidates", translate: "no"}, ...row.top.map(([id, text, logit]) =>
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
  if (!layers.length) { box.append(ui("p", "att-none", [], {class: "note"})); return; }
  const pick = el("select", {id: "attention-layer"}, ...layers.map((l) => el("option", {value: l}, l)));
  const focus = el("div", {id: "attention-focus"});
  box.append(el("label", {}, ui("span", "layer"), " ", pick), focus);
  const blocks = {};
  for (const layer of layers) {
    const a = D.attention[layer], w = floats(a.weights), n = a.n;
    const row = el("div", {class: "att-maps", "data-layer": layer},
      ui("p", "att-maps", [layer, a.offset, a.offset + n - 1], {class: "note"}));
    for (let h = 0; h < a.heads; h++) {
      const c = tip(el("canvas", {class: "heat", width: String(n), height: String(n)}), "att-map", layer, h);
      c.style.width = c.style.height = Math.max(96, 3 * n) + "px";
      heat(c, n, n, (x, y) => w[h * n * n + y * n + x]);
      row.append(ui("span", "head-n", [h]), " ", c);
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
      tip(el("div", {class: "att-label", translate: "no"}, label(a.offset + k)), "att-pos", a.offset + k)));
    for (let h = 0; h < a.heads; h++) {
      grid.append(ui("div", "head-n", [h], {class: "att-head"}));
      for (let k = 0; k < n; k++) {
        const v = w[h * n * n + q * n + k];
        const cell = tip(el("div", {class: "att-cell"}, v >= 0.1 ? `${Math.round(100 * v)}` : ""), "att-cell", h,
          JSON.stringify(label(a.offset + k)), v);
        cell.style.background = `rgba(35,57,93,${Math.min(1, v)})`; cell.style.color = v > 0.35 ? "#fff" : "#111";
        grid.append(cell);
      }
    }
    focus.replaceChildren(ui("p", "att-last", [a.offset + q, pick.value], {class: "note"}), grid);
  };
  pick.value = layers[layers.length - 1];
  pick.addEventListener("change", show);
  show();
}
function lens() {
  const box = $("lens"), L = D.lens;
  if (!L) { box.append(ui("p", "lens-none", [], {class: "note"})); return; }
  box.append(ui("p", "lens-note", [], {class: "note"}));
  const grid = el("div", {class: "grid", id: "lens-grid"});
  grid.style.gridTemplateColumns = `44px repeat(${L.positions.length}, minmax(0, 1fr))`;   // fits: no scrolling
  grid.append(ui("div", "layer"), ...L.positions.map((p) => el("div", {class: "cell"}, String(p))));
  for (let li = L.layers.length - 1; li >= 0; li--) {
    grid.append(el("div", {}, String(L.layers[li])));
    for (let pi = 0; pi < L.positions.length; pi++) {
      const c = L.cells[li][pi], v = c.p;
      const cell = tip(el("div", {class: "cell", translate: "no"}, c.text), "lens-cell",
        c.top5.map(([t, q]) => `${JSON.stringify(t)} ${q.toPrecision(4)}`).join("\n"), c.final_rank);
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
  if (D.trajectories.length) box.append(ui("p", "traj-shade", [], {class: "note"}));
  for (const b of D.trajectories) {
    const twin = D.trajectories.find((o) => o.branch === b.branch && o.kv !== b.kv);
    const agree = twin ? b.steps.every((s, i) => twin.steps[i] && twin.steps[i].id === s.id) : null;
    // the branch's own name stays as recorded; the words around it follow the language
    const head = el("h3", {}, el("span", {translate: "no"}, b.branch), ...(b.kv ? [ui("span", "traj-kv")] : []),
      ...(b.forced ? [ui("span", "traj-forced", [b.forced.id, b.forced.rank, b.forced.step])] : []),
      ...(agree === null ? [] : [ui("span", agree ? "traj-agree" : "traj-differ")]));
    if (b.loop) head.append(" ", ui("span", "loop"));
    const t = el("table", {class: "step"}, el("tr", {}, ui("th", "th-step"), ui("th", "th-token"), el("th", {}, "p"),
      ui("th", "th-text"), ui("th", "th-alts")));
    b.steps.forEach((s, i) => {
      const leaves = greedy && b.branch !== "greedy" && greedy.steps[i] && greedy.steps[i].id !== s.id;
      t.append(el("tr", {class: leaves ? "leave" : "", translate: "no"}, el("td", {}, String(s.step)),
        el("td", {class: "picked-tok", style: `background:${probColor(s.prob)}`, "data-p": String(s.prob),
                  title: `p = ${s.prob}`}, `${JSON.stringify(s.piece ?? "")} ${s.id}`),
        el("td", {}, s.prob.toPrecision(6)), el("td", {}, JSON.stringify(s.text)),
        el("td", {}, s.alts.map(([id, q, text]) => `${JSON.stringify(text ?? "")} ${id} ${(100 * q).toPrecision(3)}%`)
          .join(", "))));
    });
    box.append(head, t);
  }
}
function checks() {
  if (!D.checks) { $("checks").append(el("tr", {}, ui("td", "checks-none"))); return; }
  if (!D.checks.length) { $("checks-summary").append(ui("p", "checks-outside")); return; }
  const failed = D.checks.filter((c) => c.verdict !== "pass");
  const errors = failed.filter((c) => c.severity === "error").length;
  $("checks-summary").append(ui("p", "checks-summary",
    [D.checks.length - failed.length, D.checks.length, errors, failed.length - errors]));
  $("checks").append(...D.checks.map((c) => el("tr", {translate: "no"}, el("td", {class: c.verdict}, c.verdict),
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
function storedRow(v) {            // the row's figures: names and numbers; the words around them in TEXT
  const r = v.row;
  setUi($("eq-row"), "eq-row", "equivalence.parquet", v.compared, r.n_positions, g(r.kl_mean), g(r.kl_max),
    g(r.kl_last), `${r.kept_recorded} → ${r.kept_variant}`, g(r.kept_jaccard),
    r.top1_changed.length ? r.top1_changed.join(", ") : "—", g(r.max_abs_diff), g(r.mean_abs_diff),
    r.bit_identical ? "✓" : "✗", r.first_differing_tensor || "—", r.note || "");
}
function eqClear(key, ...args) {
  for (const id of ["eq-kl", "eq-top1", "eq-kept-recorded", "eq-kept-variant", "eq-jaccard", "eq-max-diff",
                    "eq-mean-diff"]) $(id).textContent = "";
  clearUi($("eq-kept-source"));
  $("eq-candidates").tBodies[0].replaceChildren();
  setUi($("eq-status"), key, ...args);
}
function equivalenceSetup() {
  if (!EQ) {           // no empty shell: the panel says why in one line
    $("eq-variation").disabled = true; $("eq-top-p").disabled = true;
    for (const e of document.querySelectorAll("#panel-equivalence .controls, #eq-figures, #eq-candidates, #eq-row")) {
      e.hidden = true;
    }
    eqClear("eq-none", "equivalence.prompts"); return;
  }
  $("eq-variation").append(...EQ.variations.map((v, i) =>
    el("option", {value: v.name, "data-index": String(i)}, v.name + (v.shown ? "" : " ✗"))));
  const first = EQ.variations.findIndex((v) => v.shown);
  if (first >= 0) $("eq-variation").selectedIndex = first;
  $("eq-variation").addEventListener("change", updateEquivalence);
  $("eq-top-p").addEventListener("input", updateEquivalence);
}
function updateEquivalence() {
  if (!EQ) return;
  const T = Number($("temperature").value), topP = Number($("eq-top-p").value);
  setUi($("eq-temperature"), "eq-temp-note", `T = ${T}`);
  const idx = EQ.variations.findIndex((v) => v.name === $("eq-variation").value), v = EQ.variations[idx];
  if (!v) { eqClear("eq-unchosen"); return; }
  storedRow(v);
  if (!v.shown) { eqClear("eq-not-shown", v.name, v.why); return; }
  if (T === 0) { eqClear("eq-greedy"); return; }
  if (!(T > 0) || !(topP > 0 && topP <= 1)) { eqClear("eq-invalid"); return; }
  if (v.encoding === "nan") { eqClear("eq-nan", v.name, EQ.position, v.dtype); return; }
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
  setUi($("eq-kept-source"), rows ? "eq-src-row" : "eq-src-fp64");
  const inR = new Uint8Array(N), inV = new Uint8Array(N);
  kr.forEach((i) => { inR[i] = 1; }); kv.forEach((i) => { inV[i] = 1; });
  let both = 0; for (const i of kv) both += inR[i];
  const jaccard = kr.length + kv.length - both ? both / (kr.length + kv.length - both) : 1;
  const a = ORDER[0], b = V.order[0];
  setUi($("eq-status"), "eq-status", v.name, v.dtype, v.encoding, EQ.position);
  $("eq-kl").textContent = String(kl);
  const top1 = $("eq-top1");
  if (a === b) setUi(top1, "eq-same", a); else setUi(top1, "eq-changed", a, b);
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
                     class: a !== b && (id === a || id === b) ? "flip" : "", translate: "no"},
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
setUi($("next-where"), "next-where", D.last.position,
  JSON.stringify(D.tokens.find((t) => t.position === D.last.position)?.text ?? ""));
update();
showPosition(D.last.position, document.querySelector(`.tok[data-position="${D.last.position}"]`));
