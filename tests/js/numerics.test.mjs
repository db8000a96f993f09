// Unit tests of the explorer's numerics (pipeline/report/explorer_page/numerics.mjs) under Node's test runner,
// against fixtures the Python reference made (tests/unit/test_explorer_js.py writes them and runs this file with
// NEXTTOKEN_JS_FIXTURES=<file>). Each check takes the functions it tests as arguments, so the last tests can hand
// it mutants (a float32 softmax, a nucleus keeping one id too many, ...) and see it fail.
import assert from "node:assert/strict";
import {readFileSync} from "node:fs";
import {test} from "node:test";
import * as real from "../../pipeline/report/explorer_page/numerics.mjs";

const FX = JSON.parse(readFileSync(process.env.NEXTTOKEN_JS_FIXTURES, "utf8"));
const RTOL = 1e-12;      // numpy sums pairwise, the page left to right: a few ulps apart, never more

function close(got, want, what) {
  const err = Math.abs(got - want);
  assert.ok(err <= RTOL * Math.abs(want), `${what}: ${got} vs ${want}`);
}
const logitsOf = (c) => new Float32Array(c.logits);

function checkSoftmax(f) {
  for (const c of FX.softmax) {
    const p = f.softmax64(logitsOf(c), c.T);
    assert.equal(p.length, c.p.length);
    c.p.forEach((want, i) => close(p[i], want, `${c.name} T=${c.T} id ${i}`));
  }
}
function checkNucleus(f) {
  for (const c of FX.nucleus) {
    const L = logitsOf(c), p = f.softmax64(L, c.T), order = f.logitOrder(L);
    assert.deepEqual(f.keptFP64(p, c.k, c.top_p, order, L), c.kept, `${c.name} k=${c.k} top_p=${c.top_p}`);
  }
}
function checkGreedy(f) {
  for (const c of FX.greedy) assert.equal(f.greedy(logitsOf(c)), c.id, c.name);
}
function checkSampling(f) {
  for (const c of FX.splitmix) {
    const next = f.splitmix64(BigInt(c.seed));
    assert.deepEqual([next(), next(), next()].map(String), c.outputs, `seed ${c.seed}`);
    assert.equal(f.uniform(f.splitmix64(BigInt(c.seed))), c.u, `u of seed ${c.seed}`);
  }
  for (const c of FX.sample) {
    const L = logitsOf(c), p = f.softmax64(L, c.T), kept = f.keptFP64(p, c.k, c.top_p, f.logitOrder(L), L);
    assert.equal(f.inverseCdf(p, kept, c.u), c.id, `${c.name} u=${c.u}`);
  }
}
const REC = new Float32Array(FX.decode[0].values);     // the record a "rice" row is coded against
function checkDecoding(f) {
  for (const c of FX.decode) {
    const got = c.encoding === "floats" ? f.floats(c.b64) : c.encoding === "bits" ? f.bits(c.b64, c.n)
      : c.encoding === "rice" ? f.unrice(c.b64, REC, c.params.k, c.params.shift)
      : f.decodeLogits(c.encoding, c.b64, c.n, REC, c.params);
    assert.deepEqual(Array.from(got, (x) => (Number.isNaN(x) ? "NaN" : x)), c.values, c.name);
  }
}
function checkSettings(f) {
  for (const c of FX.settings) {
    const got = f.parseSetting(...c.raw);
    assert.equal(Boolean(got.error), c.error, `${c.raw}`);
    if (!c.error) assert.deepEqual([got.T, got.k, got.topP], c.raw.map(Number));
  }
}
const CHECKS = {checkSoftmax, checkNucleus, checkGreedy, checkSampling, checkDecoding, checkSettings};

for (const [name, check] of Object.entries(CHECKS)) test(name, () => check(real));

// Mutants: one function replaced by a plausible wrong one; its check must fail.
const f32 = Math.fround;
const MUTANTS = {
  "float32 softmax": ["checkSoftmax", {softmax64(L, T) {
    const p = new Float32Array(L.length); let m = -Infinity, s = 0;
    for (let i = 0; i < L.length; i++) { p[i] = f32(L[i] / T); if (p[i] > m) m = p[i]; }
    for (let i = 0; i < L.length; i++) { p[i] = f32(Math.exp(p[i] - m)); s = f32(s + p[i]); }
    return Float64Array.from(p, (x) => f32(x / s));
  }}],
  "softmax without the temperature": ["checkSoftmax", {softmax64: (L) => real.softmax64(L, 1)}],
  "nucleus keeping one id too many": ["checkNucleus", {keptFP64(p, k, topP, order, L) {
    const kept = real.keptFP64(p, k, topP, order, L);
    const next = order.find((i) => !kept.includes(i) && (k === 0 || L[i] >= L[order[k - 1]]));
    return next === undefined ? kept : [...kept, next];
  }}],
  "nucleus stopping only above top_p (> for >=)": ["checkNucleus", {keptFP64(p, k, topP, order, L) {
    let ids = order;
    if (k > 0 && k < order.length) { const kth = L[order[k - 1]]; ids = order.filter((i) => L[i] >= kth); }
    if (topP >= 1) return ids;
    let z = 0; for (const i of ids) z += p[i];
    const out = []; let c = 0;
    for (const i of ids) { out.push(i); c += p[i] / z; if (c > topP) break; }
    return out;
  }}],
  "top-k without its ties": ["checkNucleus", {keptFP64(p, k, topP, order, L) {
    return real.keptFP64(p, 0, topP, k > 0 ? order.slice(0, k) : order, L);
  }}],
  "greedy picking the last of equal maxima": ["checkGreedy", {greedy(L) {
    let best = 0; for (let i = 1; i < L.length; i++) if (L[i] >= L[best]) best = i; return best;
  }}],
  "u from the low bits": ["checkSampling", {uniform: (next) => Number(next() & ((1n << 53n) - 1n)) / 2 ** 53}],
  "inverse CDF taking the id before": ["checkSampling", {inverseCdf(p, kept, u) {
    const id = real.inverseCdf(p, kept, u), at = kept.indexOf(id); return at > 0 ? kept[at - 1] : kept[1];
  }}],
  "bf16 read as the low half": ["checkDecoding", {decodeLogits(enc, b64, n, same) {
    if (enc !== "bf16") return real.decodeLogits(enc, b64, n, same);
    const h = new Uint16Array(real.bytesOf(b64).buffer), out = new Float32Array(h.length), u = new Uint32Array(out.buffer);
    for (let i = 0; i < h.length; i++) u[i] = h[i];
    return out;
  }}],
  "Rice difference with its sign swapped": ["checkDecoding", {unrice(b64, ref, k, shift) {
    const out = real.unrice(b64, ref, k, shift);
    return out.map((x, i) => ref[i] - (x - ref[i]));
  }}],
  "bits read big-endian": ["checkDecoding", {bits(b64, n) {
    const bytes = real.bytesOf(b64), out = new Uint8Array(n);
    for (let i = 0; i < n; i++) out[i] = (bytes[i >> 3] >> (7 - (i & 7))) & 1;
    return out;
  }}],
  "top-p 1.5 accepted": ["checkSettings", {parseSetting: (t, k, p) => ({T: Number(t), k: Number(k), topP: Number(p)})}],
};
for (const [name, [check, replaced]] of Object.entries(MUTANTS)) {
  test(`mutant fails: ${name}`, () => assert.throws(() => CHECKS[check]({...real, ...replaced}), assert.AssertionError));
}
