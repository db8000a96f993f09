"""The checks on the logit lens (lens.parquet, lens_summary.parquet) against two other derivations.

- `lens_final_layer_exact` (error): the lens at layer L (the last block's output) is the model's
  own logits, so its top-k ids and logits must equal the captured logits' top-k bit for bit
  (ids ranked here by numpy: logit descending, ties by lower id); also every (layer, position)
  is there once, with ranks 1..k.
- `lens_final_layer_kl` (error): KL(final || layer L) in lens_summary.parquet is 0.
- `lens_numpy_top1` and `lens_numpy_recompute` (error): on a few layers and positions (layers
  0, ~L/3, ~2L/3, L; the first, middle and last captured positions) numpy recomputes the lens in
  FP64 from the stored residual and the snapshot's weights read from its safetensors files (the
  final norm's formula written out, `ModuleNames.norm_formula`, with eps from config.json, or the
  norm module's own where config.json names none; the head matmul; logits_scaling; logit_scale;
  softcap), sharing no code with the stage (the loaded model only says which of the snapshot's
  tensors is which, `SnapshotWeights.key_of`: a checkpoint may name them otherwise).
  The stage computes in the compute dtype, so the two differ by its rounding; the tolerance is a bound on that, per
  logit v (u: the dtype's unit roundoff, 2^-8 bf16, 2^-11 fp16, 2^-24 fp32; h the normed row):
      B_v = 2 * [(4u + H * 2^-24) * sum_j |h_j W_vj| / s + (1 + [s] + [c]) * u * |z_v| + 3u * |cap(z_v)| * [cap]]
  (norm output rounded twice and both weights rounded to the dtype: 4u on each term of the dot
  product; float32 accumulation; the matmul output, the division by s, the product by c and the three softcap ops
  each rounded once; a factor 2 for second-order terms). A stored logit must lie within B_v of
  numpy's; a stored ln p within 2 max_v B_v (the log-sum-exp moves by at most max B); KL(final ||
  layer) and the final top-1's ln p likewise; the entropy within 2 max B (1 + H) (a relative error e
  in each p moves H by at most e (1 + H)). `lens_numpy_recompute` reports the worst of these
  |difference| / bound (tolerance 1). `lens_numpy_top1` counts sampled points whose stored top-1
  is not numpy's top-1 to within B (two ids closer than their bounds are a tie in this dtype).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from pipeline.checks.rederive import softmax64
from pipeline.checks.verdicts import Check
from pipeline.model.capture import act_name, decoder_layers, family, text_config
from pipeline.store import safetensors_io
from pipeline.store.artifacts import read_parquet

UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
CHUNK_ROWS = 8192        # LM-head rows widened to FP64 at a time (gemma3_270m's head whole would be 1.3 GB)


def sampled(num_layers: int, positions: list[int]) -> tuple[list[int], list[int]]:
    """The layers (0, ~L/3, ~2L/3, L) and positions (first, middle, last) numpy recomputes."""
    layers = sorted({round(i * num_layers / 3) for i in range(4)})
    return layers, sorted({positions[0], positions[len(positions) // 2], positions[-1]})


def _ranked_top(row: np.ndarray, k: int) -> np.ndarray:
    z = row.astype(np.float64)
    return np.lexsort((np.arange(z.size), -z))[:k]


# ---------------------------------------------------------------- (a) and (b)
def final_layer(lens_path: Path, logits: torch.Tensor, positions: list[int], num_layers: int) -> Check:
    """lens.parquet at layer L vs the captured logits' top-k (ids and logits, bit for bit)."""
    t = read_parquet(lens_path, columns=["layer", "position", "rank", "token_id", "logit"]).to_pandas()
    bad, worst, where = [], 0.0, ""
    groups = t.groupby(["layer", "position"], sort=True)
    want_keys = {(layer, p) for layer in range(num_layers + 1) for p in positions}
    if set(groups.groups) != want_keys:
        bad.append(f"(layer, position) pairs {len(groups.groups)}, expected {len(want_keys)} "
                   f"(layers 0..{num_layers} x {len(positions)} positions)")
    sizes = groups.size()
    k = int(sizes.max()) if len(sizes) else 0
    bad += [f"{int((sizes != k).sum())} (layer, position) pairs without {k} rows"] if (sizes != k).any() else []
    for (layer, p), g in groups:
        if list(g["rank"]) != list(range(1, len(g) + 1)):
            bad.append(f"layer {layer} position {p}: ranks not 1..{len(g)}")
        if layer != num_layers or p not in positions:
            continue
        row = logits[0, positions.index(p)].float().numpy()
        ids = _ranked_top(row, len(g))
        got_ids, got = g["token_id"].to_numpy(), g["logit"].to_numpy()
        differ = int((got_ids != ids).sum()) + int((got != row[ids]).sum())
        if differ:
            bad.append(f"position {p}: {differ} cells differ")
        d = float(np.abs(got.astype(np.float64) - row[got_ids.clip(0, row.size - 1)]).max(initial=0.0))
        if d > worst:
            worst, where = d, f"position {p}"
    detail = "; ".join(bad[:3]) + (f"; max |logit diff| {worst:g} at {where}" if worst else "")
    return Check("lens_final_layer_exact", "lens.parquet at layer L (the last block's output through the final norm "
                 "and LM head) vs the captured logits' top-k by numpy (ids and logits, bit for bit; every (layer, "
                 "position) once, ranks 1..k) (cells and pairs differing)", len(bad), 0, "error",
                 detail or f"{len(positions)} positions x top-{k}")


def final_layer_kl(summary_path: Path, positions: list[int], num_layers: int) -> Check:
    s = read_parquet(summary_path, columns=["layer", "position", "kl_final"]).to_pandas()
    last = s[s.layer == num_layers]
    kl = np.abs(last["kl_final"].to_numpy(np.float64))
    measured = math.inf if sorted(last.position) != sorted(positions) or np.isnan(kl).any() else \
        float(kl.max(initial=0.0))
    return Check("lens_final_layer_kl", "lens_summary.parquet KL(final || layer L) vs 0, every position (nats)",
                 measured, 0, "error", f"{len(last)} positions at layer {num_layers}")


# ---------------------------------------------------------------- (c) numpy in FP64
class SnapshotWeights:
    """The snapshot's tensors by name, read from its safetensors files without torch (floats exact in FP64)."""

    def __init__(self, snapshot: Path):
        self.where = {}
        for f in sorted(Path(snapshot).glob("*.safetensors")):
            for name, t in safetensors_io.header(f)[0].items():
                self.where[name] = (f, t)

    def has(self, name: str) -> bool:
        return name in self.where

    def key_of(self, preferred: str, param: torch.Tensor) -> str | None:
        """The snapshot's name of a loaded parameter: `preferred` (its module path) when that holds it, else
        the tensor of the same shape whose values, rounded to the parameter's dtype, are its own (a checkpoint
        may name it otherwise: GPT-NeoX's head is `embed_out`; a tied head is the input embeddings)."""
        want = param.detach().cpu()
        want = want[0] if want.ndim > 1 else want

        def same(name: str) -> bool:
            f, t = self.where[name]
            if tuple(t.shape) != tuple(param.shape):
                return False
            with open(f, "rb") as fh:
                fh.seek(t.start)
                n = t.row_bytes if len(t.shape) > 1 else t.end - t.start
                raw = np.frombuffer(fh.read(n), safetensors_io.STORED[t.dtype])
            return torch.equal(torch.from_numpy(safetensors_io.widen(raw, t.dtype).copy()).to(want.dtype), want)
        if preferred in self.where and same(preferred):
            return preferred
        return next((name for name in sorted(self.where) if same(name)), None)

    def read(self, name: str) -> np.ndarray:
        f, _ = self.where[name]
        return safetensors_io.read(f, name).astype(np.float64)

    def row_chunks(self, name: str):
        """(first row, FP64 rows [n, H]) of a 2-D tensor, CHUNK_ROWS at a time."""
        f, t = self.where[name]
        with open(f, "rb") as fh:
            for start in range(0, t.shape[0], CHUNK_ROWS):
                n = min(CHUNK_ROWS, t.shape[0] - start)
                fh.seek(t.start + start * t.row_bytes)
                raw = np.frombuffer(fh.read(n * t.row_bytes), safetensors_io.STORED[t.dtype])
                yield start, safetensors_io.widen(raw, t.dtype).reshape(n, t.shape[1]).astype(np.float64)


def normed64(x: np.ndarray, formula: str, eps: float, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """The final norm written out in FP64 on rows x [n, H]."""
    if formula == "layer":
        mu = x.mean(-1, keepdims=True)
        y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w
        return y + b if b is not None else y
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    if formula == "rms_plus_one":
        return y * (1.0 + w)
    if formula == "rms":
        return y * w
    raise ValueError(f"unknown norm formula {formula!r}")


def numpy_logits(h: np.ndarray, weights: SnapshotWeights, key: str, bias: np.ndarray | None, scaling: float | None,
                 cap: float | None, scale: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z before the softcap, z after it, sum_j |h_j W_vj|) in FP64 for rows h [n, H]: each [n, V]."""
    zs, ss = [], []
    for _, w in weights.row_chunks(key):
        zs.append(h @ w.T)
        ss.append(np.abs(h) @ np.abs(w).T)
    z, s = np.concatenate(zs, axis=1), np.concatenate(ss, axis=1)
    if bias is not None:
        z, s = z + bias, s + np.abs(bias)
    if scaling is not None:
        z, s = z / scaling, s / scaling
    if scale is not None:       # Cohere: logits * logit_scale
        z, s = z * scale, s * abs(scale)
    return z, (np.tanh(z / cap) * cap if cap is not None else z), s


def _config(snapshot: Path) -> dict:
    cfg = json.loads((Path(snapshot) / "config.json").read_text(encoding="utf-8"))
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


def final_norm_eps(cfg: dict, names) -> float | None:
    """config.json's `names.norm_eps`, else (a decoder outside the family table) the final norm module's own eps;
    a key present with null (Cohere 2 MoE's rms_norm_eps beside its layer_norm_eps) counts as absent."""
    return cfg[names.norm_eps] if cfg.get(names.norm_eps) is not None else names.norm_eps_value


def _head(model, snapshot: Path, cfg: dict) -> tuple[dict, str]:
    """The final norm's and the head's FP64 tensors from the snapshot, the eps, scaling and cap; or a problem."""
    names, weights = family(model), SnapshotWeights(snapshot)
    norm, head = model.get_submodule(names.final_norm), model.get_submodule(names.lm_head)
    found = {what: weights.key_of(f"{path}.{what.split('.')[1]}", p) for what, path, p in (
        ("norm.weight", names.final_norm, norm.weight), ("norm.bias", names.final_norm, getattr(norm, "bias", None)),
        ("head.weight", names.lm_head, head.weight), ("head.bias", names.lm_head, getattr(head, "bias", None)))
        if p is not None}
    # eps: config.json's, else (a decoder outside the family table) the final norm module's own
    eps = final_norm_eps(cfg, names)
    problem = next((f"the snapshot holds no tensor equal to the model's {k}" for k, v in found.items() if v is None),
                   "" if eps is not None else f"config.json has no {names.norm_eps} (the final norm's eps)")
    if problem:
        return {}, problem
    return {"weights": weights, "key": found["head.weight"], "eps": eps, "w": weights.read(found["norm.weight"]),
            "b": weights.read(found["norm.bias"]) if "norm.bias" in found else None,
            "bias": weights.read(found["head.bias"]) if "head.bias" in found else None,
            # the head's arithmetic off the model's own config object, as the model and capture read it (MiniCPM3's
            # logits_scaling is a property of its config class, not in config.json)
            "scaling": float(getattr(text_config(model), names.logits_scaling)) if names.logits_scaling else None,
            "scale": float(getattr(model, names.logit_scale)) if names.logit_scale else None,
            "cap": getattr(text_config(model), names.final_softcap) if names.final_softcap else None}, ""


# ln of the smallest positive float64: a stored FP64 probability of 0 is right when numpy's ln p is below it
_LN_TINIEST = math.log(math.ulp(0.0))


def _ln_diff(stored: np.ndarray, ln_ref: np.ndarray) -> np.ndarray:
    """|ln stored - ln_ref|, where a stored 0 (exp underflowed: a far layer, a big vocabulary) counts as exact
    when numpy's ln p underflows too, and as infinitely off when it does not."""
    stored = np.asarray(stored, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        diff = np.abs(np.log(stored) - ln_ref)
    return np.where(stored > 0, diff, np.where(ln_ref < _LN_TINIEST, 0.0, math.inf))


def _log_softmax64(row: np.ndarray) -> np.ndarray:
    """ln softmax(row) in float64: x - max - ln(sum exp(x - max)), finite wherever the logit is."""
    x = row.astype(np.float64)
    shifted = x - x[np.isfinite(x)].max()
    return shifted - math.log(math.fsum(np.exp(shifted).tolist()))


def _ratios(rows, one, z: np.ndarray, bound: np.ndarray, final_row: np.ndarray) -> dict[str, float]:
    """One sampled point: each stored figure's |difference| from numpy's over its bound (see the module doc)."""
    ids, row_bound = rows["token_id"].to_numpy(), float(bound.max())
    p64, pf = softmax64(z, 1.0), softmax64(final_row, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        # ln p as a log-softmax, not ln of p: far layers put ids below float64's range (p = 0, ln p finite),
        # and KL(final || layer) of such an id is finite, as the lens stage computes it
        ln_p64, ln_pf = _log_softmax64(z), _log_softmax64(final_row)
        entropy = -float(np.sum(np.where(p64 > 0, p64 * ln_p64, 0.0)))
        kl = float(np.sum(np.where(pf > 0, pf * (ln_pf - ln_p64), 0.0)))
        f = int(one["final_top1_id"])
        ratios = {
            "logit": np.abs(rows["logit"].to_numpy(np.float64) - z[ids]) / bound[ids],
            "ln prob": _ln_diff(rows["prob"].to_numpy(np.float64), ln_p64[ids]) / (2 * row_bound),
            "final top-1 ln prob": _ln_diff(np.array([one["final_top1_prob"]]), ln_p64[[f]]) / (2 * row_bound),
            "KL(final || layer)": abs(one["kl_final"] - kl) / (2 * row_bound),
            "entropy": abs(one["entropy"] - entropy) / (2 * row_bound * (1 + entropy)),
        }
    return {k: float(np.nan_to_num(np.max(v), nan=math.inf)) for k, v in ratios.items()}


def numpy_recompute(lens_path: Path, summary_path: Path, tensors: dict, model, snapshot: Path,
                    positions: list[int], dtype: str) -> list[Check]:
    """lens.parquet / lens_summary.parquet on the sampled layers and positions vs numpy FP64."""
    names, num_layers = family(model), len(decoder_layers(model))
    layers, where = sampled(num_layers, positions)
    pts, u = f"layers {layers} x positions {where}", UNIT_ROUNDOFF[dtype]
    what = (f"lens.parquet top-1 vs numpy FP64 ({names.norm_formula} norm from the snapshot's weights, eps from "
            "config.json, head matmul, scaling, softcap) on the sampled points, equal to within the dtype's bound B "
            "(points differing)",
            f"lens.parquet logits and ln p, lens_summary.parquet entropy, KL and final top-1 ln p vs numpy FP64 from "
            f"the stored residual on {pts}: worst |difference| / its bound (B_v = 2[(4u + H 2^-24) sum|h W_v| + "
            f"(1..2)u|z_v| + 3u|cap(z_v)|], u = {u:g} for {dtype})")
    h, problem = _head(model, snapshot, _config(snapshot))
    if problem:
        return [Check("lens_numpy_top1", what[0], math.nan, 0, "error", problem),
                Check("lens_numpy_recompute", what[1], math.nan, 1, "error", problem)]
    resid = [act_name("resid_pre", 0)] + [act_name("resid_post", i) for i in range(num_layers)]
    points = [(layer, p) for layer in layers for p in where]
    x = np.stack([tensors[resid[layer]][0, p].float().numpy().astype(np.float64) for layer, p in points])
    z_in, z, s = numpy_logits(normed64(x, names.norm_formula, h["eps"], h["w"], h["b"]), h["weights"], h["key"],
                              h["bias"], h["scaling"], h["cap"], h["scale"])
    bound = 2 * ((4 * u + h["w"].shape[0] * 2.0**-24) * s
                 + (1 + (h["scaling"] is not None) + (h["scale"] is not None)) * u * np.abs(z_in)
                 + (3 * u * np.abs(z) if h["cap"] is not None else 0.0))
    lens = read_parquet(lens_path).to_pandas().set_index(["layer", "position"]).sort_index()
    summary = read_parquet(summary_path).to_pandas().set_index(["layer", "position"]).sort_index()
    final, wrong_top1, worst = tensors[act_name("logits")][0], [], (0.0, "")
    for i, (layer, p) in enumerate(points):
        if (layer, p) not in lens.index or (layer, p) not in summary.index:
            wrong_top1.append(f"layer {layer} position {p}: missing")
            worst = (math.inf, f"layer {layer} position {p} missing")
            continue
        rows, one = lens.loc[[(layer, p)]], summary.loc[(layer, p)]
        top, best = int(rows["token_id"].to_numpy()[np.argmin(rows["rank"].to_numpy())]), int(np.argmax(z[i]))
        if z[i, best] - z[i, top] > bound[i, best] + bound[i, top]:
            wrong_top1.append(f"layer {layer} position {p}: {top} vs numpy {best}")
        for name, r in _ratios(rows, one, z[i], bound[i], final[positions.index(p)].float().numpy()).items():
            if r > worst[0] or not worst[1]:
                worst = (r, f"{name} at layer {layer} position {p} (bound 2 max B = {2 * bound[i].max():.3g})")
    return [Check("lens_numpy_top1", what[0], len(wrong_top1), 0, "error", "; ".join(wrong_top1[:3]) or pts),
            Check("lens_numpy_recompute", what[1], worst[0], 1.0, "error", worst[1])]


def run(stored, model, snapshot: Path, dtype: str) -> list[Check]:
    """Every lens check on one prompt (`stored`: suite.Stored with its lens paths); none for a run
    where the lens stage did not run (no lens folder)."""
    if stored.lens is None:
        return []
    tensors, positions = stored.tensors, stored.logit_positions
    num_layers = len(decoder_layers(model))
    return [final_layer(stored.lens, tensors[act_name("logits")], positions, num_layers),
            final_layer_kl(stored.lens_summary, positions, num_layers),
            *numpy_recompute(stored.lens, stored.lens_summary, tensors, model, snapshot, positions, dtype)]
