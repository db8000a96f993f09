"""Where two runs' numbers part: the kernel path, the first diverging captured tensor, the top-1 ids.

Functions over records, tensors and logits (never over run folders), shared by `nexttoken
diff` and `nexttoken verify`, and reusable per prompt. torch is imported inside the
functions: `verify` imports this module before it pins the kernels, which must happen before
torch loads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pipeline import kernels


# ---------------------------------------------------------------- kernel path
def recorded_kernels(manifests: dict[str, dict]) -> dict | None:
    """A run's kernel path: the forward stage's record (every number derives from its pass),
    else the first stage's that has one; None when no stage of the run computed with torch."""
    ordered = ([manifests["forward"]] if "forward" in manifests else []) + list(manifests.values())
    return next((m["kernels"] for m in ordered if m.get("kernels")), None)


def kernel_difference_line(then: dict | None, now: dict | None, labels: tuple[str, str] = ("A", "B")) -> str:
    """One line: the kernel path is the same, or which fields differ (value in the first -> in the second)."""
    if then is None or now is None:
        missing = " and ".join(lab for lab, r in zip(labels, (then, now)) if r is None)
        return f"kernel path: not recorded in {missing} (no stage there computed with torch)"
    diffs = kernels.differences(then, now)
    if not diffs:
        return f"kernel path: same ({kernels.summary(then)})"
    return (f"kernel path: {len(diffs)} field(s) differ ({labels[0]} -> {labels[1]}): "
            + "; ".join(kernels.describe_difference(*d) for d in diffs))


def prompt_kernel_lines(manifests: dict[str, dict], now: dict | None) -> list[str]:
    """Per stage that ran its prompts on Ray (a cluster may mix CPUs): the prompts whose recorded CPU kernels
    (`kernels.cpu_key`) are not `now`'s, grouped by kernels and node, one line each; none when all match."""
    here = kernels.cpu_key(now)
    out = []
    for stage, manifest in manifests.items():
        prompts = ((manifest.get("executor") or {}).get("prompts")) or {}
        groups: dict[tuple[str, str], list[str]] = {}
        for pid, where in sorted(prompts.items()):
            key = kernels.cpu_key(where)
            if key is not None and here is not None and key != here:
                groups.setdefault((key, str(where.get("node"))), []).append(pid)
        for (key, node), pids in groups.items():
            shown = ", ".join(pids[:5]) + (f" and {len(pids) - 5} more" if len(pids) > 5 else "")
            out.append(f"kernel path per prompt: {stage} computed {len(pids)} prompt(s) on node {node} with CPU "
                       f"kernels {key}, here {here} (their bits may differ): {shown}")
    return out


# ---------------------------------------------------------------- capture
@dataclass(frozen=True)
class Divergence:
    """The first captured tensor (in forward order) whose bits differ between two captures."""

    name: str
    max_abs: float | None             # None: not comparable (absent, or another shape / dtype)
    index: tuple[int, ...] | None     # where |Δ| is largest
    position: int | None              # the prompt position of that index, when a dimension is the prompt's
    detail: str = ""
    differing: int = 0                # how many tensors differ
    total: int = 0


def capture_order(path: Path) -> list[str]:
    """The tensor names of a capture file in the order they were captured (forward order)."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        names = json.loads((f.metadata() or {}).get("names", "[]"))
        return [n for n in names if n in set(f.keys())] or sorted(f.keys())


def first_diverging_tensor(a: dict, b: dict, order: list[str], n_positions: int | None) -> Divergence | None:
    """None when every tensor of a and b is bit-identical; else the first that differs in `order`."""
    names = [n for n in order if n in a or n in b] + sorted((set(a) | set(b)) - set(order))
    first, differing = None, 0
    for name in names:
        x, y = a.get(name), b.get(name)
        if x is not None and y is not None and _same_bits(x, y):
            continue
        differing += 1
        first = first or _divergence(name, x, y, n_positions)
    return None if first is None else replace(first, differing=differing, total=len(names))


def _same_bits(x, y) -> bool:
    import torch
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bytes(x), _bytes(y))


def _bytes(t):
    """[*t.shape, itemsize]: each element's bytes (bit-exact comparison: NaN == NaN, -0.0 != 0.0)."""
    import torch
    return t.contiguous().view(-1).view(torch.uint8).reshape(*t.shape, t.element_size())


def _divergence(name: str, x, y, n_positions: int | None) -> Divergence:
    import torch
    if x is None or y is None:
        return Divergence(name, None, None, None, f"only in {'B' if x is None else 'A'}")
    if x.shape != y.shape or x.dtype != y.dtype:
        return Divergence(name, None, None, None, f"{x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}")
    xd, yd = x.double(), y.double()
    d = (xd - yd).abs()
    both_nan = torch.isnan(xd) & torch.isnan(yd)
    d = torch.where(both_nan, 0.0, torch.where(torch.isnan(d), math.inf, d))   # NaN on one side only: inf
    if float(d.max()) == 0:           # equal values, other bits: look for the first element whose bits differ
        d = (_bytes(x) != _bytes(y)).any(-1).double()
        detail = " (values equal, bits differ: signed zero or NaN payload)"
    else:
        detail = ""
    index = tuple(int(i) for i in np.unravel_index(int(d.argmax()), tuple(d.shape)))
    dims = [i for i in range(1, d.dim()) if d.shape[i] == n_positions]
    return Divergence(name, 0.0 if detail else float(d.max()), index, index[dims[0]] if dims else None,
                      f"{x.dtype} {list(x.shape)}".replace("torch.", "") + detail)


def divergence_line(d: Divergence | None, total: int, labels: tuple[str, str] = ("A", "B")) -> str:
    if d is None:
        return f"capture: all {total} tensors bit-identical"
    if d.max_abs is None:
        return (f"capture: first diverging tensor (forward order) {d.name}: not comparable ({d.detail}); "
                f"{d.differing} of {d.total} tensors differ")
    where = f"position {d.position}, index {list(d.index)}" if d.position is not None else f"index {list(d.index)}"
    return (f"capture: first diverging tensor (forward order) {d.name}: max |Δ| {d.max_abs:.6g} at {where} "
            f"of {d.detail}; {d.differing} of {d.total} tensors differ ({labels[0]} -> {labels[1]})")




def top1_line(a, b, positions: list[int], labels: tuple[str, str] = ("A", "B")) -> str:
    """Top-1 id per position of two [rows, V] logits (rows = `positions`): where they differ."""
    if tuple(a.shape) != tuple(b.shape):
        return f"top-1 id: not comparable (logits {list(a.shape)} vs {list(b.shape)})"
    ia, ib = a.float().argmax(-1).tolist(), b.float().argmax(-1).tolist()
    changed = [(p, x, y) for p, x, y in zip(positions, ia, ib) if x != y]
    if not changed:
        return f"top-1 id: same at all {len(positions)} positions"
    shown = ", ".join(f"position {p}: {x} -> {y}" for p, x, y in changed[:5])
    return (f"top-1 id: differs at {len(changed)} of {len(positions)} positions ({labels[0]} -> {labels[1]}): "
            f"{shown}{' ...' if len(changed) > 5 else ''}")
