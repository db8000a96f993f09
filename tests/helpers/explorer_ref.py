"""The explorer's numerics in Python / numpy, as docs/explorer.md states them: the reference that the page's
JavaScript (pipeline/report/explorer_page/numerics.mjs) must equal, in the browser tests and the JS unit tests."""

from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1


def splitmix64(seed: int):
    """SplitMix64: the page's "sample once" generator; each call of the result gives the next 64-bit output."""
    state = seed & MASK

    def next_u64() -> int:
        nonlocal state
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)
    return next_u64


def uniform(seed: int) -> float:
    """The first draw's u in [0, 1): the top 53 bits of SplitMix64(seed)'s first output / 2^53."""
    return (splitmix64(seed)() >> 11) / 2.0 ** 53


def logit_order(logits: np.ndarray) -> np.ndarray:
    """Ids by descending logit, equal logits by lower id."""
    return np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))


def softmax64(logits: np.ndarray, t: float) -> np.ndarray:
    x = logits.astype(np.float64) / t
    e = np.exp(x - x.max())
    return e / e.sum()


def nucleus(p: np.ndarray, logits: np.ndarray, k: int, top_p: float) -> np.ndarray:
    """The FP64 kept set in rank order: top-k (ties kept), then the smallest prefix by p (ties lower id) of the
    renormalised top-k whose cumulative mass reaches top_p. k = 0 or k >= the size: top-k off."""
    order = np.lexsort((np.arange(p.size), -p))
    if 0 < k < p.size:
        order = order[logits[order] >= logits[order[k - 1]]]
    q = p[order] / p[order].sum()
    n = int(np.searchsorted(np.cumsum(q), top_p) + 1) if top_p < 1 else order.size
    return order[:min(n, order.size)]


def inverse_cdf(p: np.ndarray, kept: np.ndarray, u: float) -> int:
    """The kept ids in rank order, their probabilities summed left to right (np.cumsum, as the page does):
    the first id whose running sum exceeds u times the total; the last kept id if rounding leaves none."""
    c = np.cumsum(p[kept])
    hit = np.flatnonzero(c > u * c[-1])
    return int(kept[hit[0]] if hit.size else kept[-1])


def sample_once(logits: np.ndarray, t: float, k: int, top_p: float, seed: int) -> int:
    """The page's "sample once" at a setting it computes itself (not a configured filter)."""
    if t == 0:
        return int(np.argmax(logits))
    p = softmax64(logits, t)
    return inverse_cdf(p, nucleus(p, logits, k, top_p), uniform(seed))


def decode_logits(encoding: str, data: str | None, params: dict, ref: np.ndarray) -> np.ndarray:
    """A row the page embeds (explorer.variant_encoding / logits_encoding), decoded bit by bit the way
    docs/explorer.md states it, independently of the encoder: `ref` is the record ("same") or the row params["ref"]
    names ("as", "rice")."""
    import base64

    if encoding in ("same", "as"):
        return ref
    if encoding == "nan":
        return np.full(ref.size, np.nan, dtype=np.float32)
    raw = base64.b64decode(data)
    if encoding == "bf16":
        return (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4")
    if encoding in ("f16", "f4"):
        return np.frombuffer(raw, {"f16": "<f2", "f4": "<f4"}[encoding]).astype(np.float32)
    assert encoding == "rice", encoding
    bits, pos, k, qmax, escape = np.unpackbits(np.frombuffer(raw, np.uint8)).tolist(), 0, params["k"], 24, 34
    out = np.empty(ref.size, dtype="<u4")
    for i, r in enumerate(np.ascontiguousarray(ref, dtype="<f4").view("<u4").tolist()):
        q = 0
        while q < qmax and bits[pos]:
            q, pos = q + 1, pos + 1
        width, pos = (k, pos + 1) if q < qmax else (escape, pos)
        z = int("".join(map(str, bits[pos:pos + width])) or "0", 2) + (q << k if q < qmax else 0)
        pos += width
        d = (z >> 1 if z % 2 == 0 else -((z + 1) >> 1)) << params["shift"]
        o = (r if r < 1 << 31 else -(1 << 31) if r == 1 << 31 else -(r - (1 << 31))) + d
        out[i] = o if o >= 0 else 1 << 31 if o == -(1 << 31) else (1 << 31) - o
    return out.view("<f4")
