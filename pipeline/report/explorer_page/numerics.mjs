// The explorer's numerics: small pure functions, no DOM. The page inlines this file ahead of explorer.js in one
// module script element; tests/js/numerics.test.mjs tests them under Node against fixtures made by the Python
// reference (tests/unit/test_explorer_js.py). Every probability is a JavaScript number: IEEE float64.

// base64 -> bytes (the page's embedded arrays)
export function bytesOf(b64) {
  const bin = atob(b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return bytes;
}
// little-endian float32 array, base64 (explorer.b64_floats)
export function floats(b64) {
  return new Float32Array(bytesOf(b64).buffer);
}
// a bit per id, little bit order (explorer.b64_bits) -> 0/1 per id
export function bits(b64, n) {
  const bytes = bytesOf(b64), out = new Uint8Array(n);
  for (let i = 0; i < n; i++) out[i] = (bytes[i >> 3] >> (i & 7)) & 1;
  return out;
}
// IEEE half -> number
export function half(x) {
  const s = x & 0x8000 ? -1 : 1, e = (x >> 10) & 0x1f, f = x & 0x3ff;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}
// float32 bits <-> the ordinal explorer.ordinals gives them (JS numbers: exact far beyond 2^32)
function ordinal(u) {
  if (u < 0x80000000) return u;
  return u === 0x80000000 ? -(2 ** 31) : -(u - 0x80000000);
}
function fromOrdinal(o) {
  return o >= 0 ? o : o === -(2 ** 31) ? 0x80000000 : 0x80000000 - o;
}
export const RICE_QMAX = 24, RICE_ESCAPE = 34;       // explorer.RICE_QMAX, RICE_ESCAPE
// A row coded as its difference from `ref` (explorer.rice): per id, the unary quotient (ones, then a zero) and k
// bits, or RICE_QMAX ones and the zigzag value in RICE_ESCAPE bits; d = zigzag^-1 * 2^shift added to ref's ordinal.
export function unrice(b64, ref, k, shift) {
  const bytes = bytesOf(b64), n = ref.length, out = new Float32Array(n), ob = new Uint32Array(out.buffer);
  const rb = new Uint32Array(ref.buffer, ref.byteOffset, n), scale = 2 ** shift;
  let pos = 0;
  const bit = () => { const b = (bytes[pos >> 3] >> (7 - (pos & 7))) & 1; pos++; return b; };
  for (let i = 0; i < n; i++) {
    let q = 0, z = 0;
    while (q < RICE_QMAX && bit()) q++;
    if (q < RICE_QMAX) { for (let j = 0; j < k; j++) z = 2 * z + bit(); z += q * 2 ** k; }
    else for (let j = 0; j < RICE_ESCAPE; j++) z = 2 * z + bit();
    ob[i] = fromOrdinal(ordinal(rb[i]) + (z % 2 === 0 ? z / 2 : -(z + 1) / 2) * scale);
  }
  return out;
}
// A logits row from its encoding (explorer.variant_encoding): every encoding is lossless. `same`: the record's row
// ("same"), the row an "as" or "rice" encoding refers to.
export function decodeLogits(encoding, b64, n, same, params = {}) {
  if (encoding === "same" || encoding === "as") return same;
  if (encoding === "nan") return new Float32Array(n).fill(NaN);
  if (encoding === "rice") return unrice(b64, same, params.k, params.shift);
  const bytes = bytesOf(b64);
  if (encoding === "f4") return new Float32Array(bytes.buffer);
  const h = new Uint16Array(bytes.buffer), out = new Float32Array(h.length);
  if (encoding === "bf16") {
    const u = new Uint32Array(out.buffer);
    for (let i = 0; i < h.length; i++) u[i] = h[i] << 16;
  } else if (encoding === "f16") {
    for (let i = 0; i < h.length; i++) out[i] = half(h[i]);
  } else throw new Error(`unknown encoding ${encoding}`);
  return out;
}
// A kept set (explorer.kept_set) as its ids in `order`: {top: n} (the first n of order), {ids}, or {bits}.
export function keptIds(kept, order, n) {
  if (kept.top !== undefined) return order.slice(0, kept.top);
  if (kept.ids) { const m = new Uint8Array(n); kept.ids.forEach((i) => { m[i] = 1; }); return order.filter((i) => m[i]); }
  const m = bits(kept.bits, n);
  return order.filter((i) => m[i]);
}
// Ids by descending logit, equal logits by lower id (the project's rank rule; the order of p at any T > 0).
export function logitOrder(L) {
  return Array.from({length: L.length}, (_, i) => i).sort((a, b) => (L[b] - L[a]) || (a - b));
}
// rank (1-based) of each id in `order`
export function ranks(order) {
  const rank = new Int32Array(order.length);
  order.forEach((id, r) => { rank[id] = r + 1; });
  return rank;
}
// softmax(L / T) in float64 over the full output size: x = l / T, p = exp(x - max) / sum (summed in id order).
export function softmax64(L, T) {
  const n = L.length, p = new Float64Array(n);
  let m = -Infinity;
  for (let i = 0; i < n; i++) { const x = L[i] / T; p[i] = x; if (x > m) m = x; }
  let s = 0;
  for (let i = 0; i < n; i++) { const e = Math.exp(p[i] - m); p[i] = e; s += e; }
  for (let i = 0; i < n; i++) p[i] = p[i] / s;
  return p;
}
// log softmax(L / T) in float64: x - max - log(sum exp(x - max)), for the KL
export function logSoftmax64(L, T) {
  const n = L.length, out = new Float64Array(n);
  let m = -Infinity;
  for (let i = 0; i < n; i++) { const x = L[i] / T; out[i] = x; if (x > m) m = x; }
  let s = 0;
  for (let i = 0; i < n; i++) s += Math.exp(out[i] - m);
  const c = m + Math.log(s);
  for (let i = 0; i < n; i++) out[i] = out[i] - c;
  return out;
}
// The FP64 nucleus: top-k (ids tied with the k-th kept), then the smallest prefix (by p, ties by lower id) of
// the top-k-renormalised distribution whose mass reaches top_p. `order`: logitOrder(L).
export function keptFP64(p, k, topP, order, L) {
  let ids = order;
  if (k > 0 && k < order.length) { const kth = L[order[k - 1]]; ids = order.filter((i) => L[i] >= kth); }
  if (topP >= 1) return ids;
  let z = 0; for (const i of ids) z += p[i];
  const out = []; let c = 0;
  for (const i of ids) { out.push(i); c += p[i] / z; if (c >= topP) break; }
  return out;
}
// T = 0: greedy, the argmax of the raw logits (the lowest id among equal maxima, as torch.argmax).
export function greedy(L) {
  let best = 0;
  for (let i = 1; i < L.length; i++) if (L[i] > L[best]) best = i;
  return best;
}
// SplitMix64 (Steele, Lea, Flood 2014): the page's generator. state += 0x9E3779B97F4A7C15, then two
// xor-shift-multiply rounds; returns the next 64-bit output as a BigInt. Python: docs/explorer.md.
export function splitmix64(seed) {
  let state = BigInt.asUintN(64, BigInt(seed));
  return () => {
    state = BigInt.asUintN(64, state + 0x9E3779B97F4A7C15n);
    let z = state;
    z = BigInt.asUintN(64, (z ^ (z >> 30n)) * 0xBF58476D1CE4E5B9n);
    z = BigInt.asUintN(64, (z ^ (z >> 27n)) * 0x94D049BB133111EBn);
    return z ^ (z >> 31n);
  };
}
// a uniform in [0, 1) from one 64-bit output: its top 53 bits / 2^53
export function uniform(next) {
  return Number(next() >> 11n) / 2 ** 53;
}
// Inverse CDF over the kept ids in their rank order: z = their p summed in that order, the pick is the first id
// whose running sum exceeds u * z (the last kept id if rounding leaves none).
export function inverseCdf(p, kept, u) {
  let z = 0; for (const i of kept) z += p[i];
  const target = u * z;
  let c = 0;
  for (const i of kept) { c += p[i]; if (c > target) return i; }
  return kept[kept.length - 1];
}
// The Next token panel's three inputs, as typed: {T, k, topP}, or {error} naming the bad value and what is allowed.
export function parseSetting(rawT, rawK, rawP) {
  const num = (s) => (String(s).trim() === "" ? NaN : Number(s));
  const T = num(rawT), k = num(rawK), topP = num(rawP);
  // {error, code, raw}: the English line, and the key of its text in walk.js's TEXT with the value as typed
  if (!(Number.isFinite(T) && T >= 0)) {
    return {error: `temperature = ${rawT}: not allowed; a number >= 0 (0 = greedy)`, code: "err-temperature", raw: rawT};
  }
  if (!(Number.isInteger(k) && k >= 0)) {
    return {error: `top-k = ${rawK}: not allowed; a whole number >= 0 (0 = off)`, code: "err-top-k", raw: rawK};
  }
  if (!(topP > 0 && topP <= 1)) {
    return {error: `top-p = ${rawP}: not allowed; a number in (0, 1] (1 = off)`, code: "err-top-p", raw: rawP};
  }
  return {T, k, topP};
}
// A seed as typed: a BigInt in [0, 2^64), or null
export function parseSeed(raw) {
  const s = String(raw).trim();
  if (!/^[0-9]+$/.test(s)) return null;
  const v = BigInt(s);
  return v < 2n ** 64n ? v : null;
}
// The next-token distribution the page shows at temperature T over logits L: softmax64 for T > 0; for T = 0
// (greedy) all the mass on the argmax.
export function distribution(L, T) {
  if (T > 0) return softmax64(L, T);
  const p = new Float64Array(L.length);
  p[greedy(L)] = 1;
  return p;
}
