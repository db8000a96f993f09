"""The forward pass of one prompt re-run under one variation, beside the recorded capture.

Each function returns a `Variant`: the logits at the recorded positions ([P, V], the variant's own
dtype), the first captured tensor that differs from the record where one can be said, and what the
pass ran with (device, dtype, attention, threads, kernel path) for the manifest.

- `sdpa`: the model with attention_implementation="sdpa". run_capture needs eager, so the first
  differing tensor is looked for in the residual stream (HF hidden_states: blocks.i.resid_pre and,
  last, final_norm_out). Not applicable to a family transformers has no sdpa path for (Gemma 2).
- `batch_2`, `batch_8`: the prompt first in a batch of n with LEFT padding beside fixed filler
  prompts, attention mask and position ids as `generate` builds them; its rows taken back out.
  Residual stream as for sdpa. The LM head sees only the prompt's row at the recorded positions
  (`lm_head_rows`): the fillers' logits are never compared, [n, W, V] would be n records' worth of
  memory, and the head's matrix product then has the record's shape (a GEMM of other rows can round
  differently, which would be the head's shape, not the batch, showing).
- `float32`, `float16`: the model loaded in that dtype; a full capture, each tensor rounded to the
  recorded dtype before it is compared (a cast alone is not a difference).
- `threads_1`: a full capture with torch.set_num_threads(1), the configured count restored after.
- `kernels`: the other `capture.kernels` mode, in a subprocess (`pipeline.equivalence.worker`):
  the pin acts only before torch loads.

Every pass computes logits only at the recorded positions (`logits_to_keep=1` with
`capture.positions=last`, as the forward stage's did). A variation that cannot apply to this model
or machine returns a Variant without logits whose note starts "not applicable:" and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline import kernels
from pipeline.config.schema import VARIATIONS  # noqa: F401 (re-exported)
from pipeline.equivalence import worker
from pipeline.model import capture, loader
from pipeline.numerics import compare, divergence


@dataclass(frozen=True)
class Recorded:
    """What the forward stage recorded for one prompt."""

    ids: list[int]
    positions: list[int]                 # the prompt positions the logits rows belong to
    tensors: dict[str, torch.Tensor]     # the capture (logits [1, P, V] among them)
    order: list[str]                     # capture names in forward order

    @property
    def logits(self) -> torch.Tensor:
        return self.tensors[capture.act_name("logits")][0]


@dataclass(frozen=True)
class Setup:
    """How the record was made (the configured forward pass)."""

    snapshot: Path
    dtype: torch.dtype
    device: torch.device
    attn: str
    spec: capture.CaptureSpec
    kernels: str
    trust_remote_code: bool


@dataclass(frozen=True)
class Variant:
    logits: torch.Tensor | None          # [P, V]; None: not run here (see note)
    first_differing_tensor: str | None
    note: str
    ran_with: dict = field(default_factory=dict)


NOT_APPLICABLE = "not applicable: "


def not_applicable(why: str, **ran) -> Variant:
    return Variant(None, None, NOT_APPLICABLE + why, ran)


def keep(positions: str) -> int:
    """HF's logits_to_keep for capture.positions: 1 (the last row only) or 0 (every row)."""
    return 1 if positions == "last" else 0


def ran_with(s: Setup, **changes) -> dict:
    base = {"device": str(s.device), "dtype": str(s.dtype).removeprefix("torch."), "attention": s.attn,
            "threads": torch.get_num_threads(), "kernels": s.kernels}
    return {**base, **changes}


class _Rounded(Mapping):
    """The tensors, each rounded to its dtype in `dtypes` when read: one rounded copy alive at a time (all at once
    they would be another capture's worth of memory)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]):
        self.tensors, self.dtypes = tensors, dtypes

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        return t.to(self.dtypes[name]) if name in self.dtypes and t.is_floating_point() else t

    def __contains__(self, name) -> bool:        # Mapping's would round the tensor to answer
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _first(rec: Recorded, tensors: dict[str, torch.Tensor], cast: bool) -> tuple[str | None, str]:
    """The first captured tensor (forward order) whose values differ; cast: rounded to the recorded dtype first."""
    names = [n for n in rec.order if n != "input_ids"]
    mine = _Rounded({n: tensors[n] for n in names if n in tensors},
                    {n: rec.tensors[n].dtype for n in names} if cast else {})
    d = divergence.first_diverging_tensor({n: rec.tensors[n] for n in names}, mine, names, len(rec.ids))
    how = "after rounding to the recorded dtype" if cast else "bit for bit"
    if d is None:
        return None, f"all {len(names)} captured tensors equal ({how})"
    return d.name, f"{d.differing} of {d.total} captured tensors differ ({how})"


def _captured(rec: Recorded, model, s: Setup, cast: bool) -> tuple[torch.Tensor, str | None, str]:
    tensors = capture.run_capture(model, torch.tensor([rec.ids]), s.spec)
    name, note = _first(rec, tensors, cast)
    return tensors[capture.act_name("logits")][0], name, note


def dtype_variant(rec: Recorded, s: Setup, dtype: torch.dtype) -> Variant:
    label = str(dtype).removeprefix("torch.")
    model = loader.load_model(s.snapshot, dtype, s.device, s.attn, s.trust_remote_code)
    try:
        logits, name, note = _captured(rec, model, s, cast=True)
    except (RuntimeError, NotImplementedError) as e:      # an op with no kernel for this dtype on this device
        if "not implemented for" not in str(e) and not isinstance(e, NotImplementedError):
            raise
        first = str(e).strip().splitlines()[0]
        return not_applicable(f"no {label} support for this model on {s.device}: {first}", dtype=label)
    return Variant(logits, name, note, ran_with(s, dtype=label))


def threads_variant(rec: Recorded, s: Setup, model, threads: int = 1) -> Variant:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits, name, note = _captured(rec, model, s, cast=False)
    finally:
        torch.set_num_threads(before)
    return Variant(logits, name, note + f"; configured threads {before}", ran_with(s, threads=threads))


def residual(rec: Recorded, hidden: tuple[torch.Tensor, ...]) -> tuple[str | None, str]:
    """The first residual-stream tensor that differs: hidden[i] = blocks.i.resid_pre, hidden[-1] = final_norm_out
    (HF's last hidden state is after the final norm), each [T, H] of the prompt's rows."""
    names = [capture.act_name("resid_pre", i) for i in range(len(hidden) - 1)] + [capture.act_name("final_norm_out")]
    for name, h in zip(names, hidden):
        if not compare.same_bits(rec.tensors[name][0], h):
            return name, f"residual stream only ({len(names)} tensors; run_capture needs eager, one sequence)"
    return None, f"residual stream equal bit for bit ({len(names)} tensors)"


def _plain(model, input_ids, positions: str, mask=None, position_ids=None):
    with torch.no_grad():
        to = (lambda t: None if t is None else t.to(model.device))
        return model(input_ids=to(input_ids), attention_mask=to(mask), position_ids=to(position_ids),
                     use_cache=False, output_hidden_states=True, logits_to_keep=keep(positions))


@contextmanager
def lm_head_rows(model, width: int):
    """While inside: the LM head (its module path from the family table) sees only batch row 0's last
    `width` positions (the prompt's, past its left padding); logits_to_keep has cut the rows already
    with positions=last."""
    head = model.get_submodule(capture.family(model).lm_head)
    handle = head.register_forward_pre_hook(lambda _, args: (args[0][:1, -width:], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def sdpa_variant(rec: Recorded, s: Setup, model) -> Variant:
    """model: the stage's own (eager) model, whose class says whether transformers has an sdpa path for it."""
    if not getattr(type(model), "_supports_sdpa", False):
        return not_applicable(f"this family ({type(model).__name__}) has no sdpa attention in transformers "
                              f"{transformers_version()}", attention="sdpa")
    model = loader.load_model(s.snapshot, s.dtype, s.device, "sdpa", s.trust_remote_code)
    out = _plain(model, torch.tensor([rec.ids]), s.spec.positions)
    name, note = residual(rec, tuple(h[0].cpu() for h in out.hidden_states))
    return Variant(out.logits[0].cpu(), name, note, ran_with(s, attention="sdpa"))


def transformers_version() -> str:
    import transformers
    return transformers.__version__


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and position ids of a LEFT-padded batch, the position ids as `generate`
    derives them from the mask (cumsum - 1, pads at 1)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return ids, mask, position_ids


def batch_variant(rec: Recorded, s: Setup, model, fillers: list[list[int]], n: int, pad_id: int) -> Variant:
    """The prompt as row 0 of a batch of n (fillers cycled for the other rows); its rows taken back out."""
    rows = [rec.ids] + [fillers[i % len(fillers)] for i in range(n - 1)]
    ids, mask, position_ids = left_padded(rows, pad_id)
    with lm_head_rows(model, len(rec.ids)):
        out = _plain(model, ids, s.spec.positions, mask, position_ids)
    pad = ids.shape[1] - len(rec.ids)
    name, note = residual(rec, tuple(h[0, pad:].cpu() for h in out.hidden_states))
    note += f"; left padding {pad} on the prompt's row, batch width {ids.shape[1]}"
    return Variant(out.logits[0].cpu(), name, note, ran_with(s, batch=n, padding="left"))


def other_kernels(mode: str) -> str:
    return "native" if mode == "portable" else "portable"


def kernels_variant(rec: Recorded, s: Setup) -> Variant:
    """The capture re-run in a fresh process pinned to the other kernel mode."""
    mode = other_kernels(s.kernels)
    env = dict(os.environ)
    if mode == "native":       # what this process's portable pin set must not reach the child
        env = {k: v for k, v in env.items() if kernels.PORTABLE_ENV.get(k) != v}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "capture.safetensors"
        job = {"snapshot": str(s.snapshot), "ids": rec.ids, "dtype": str(s.dtype).removeprefix("torch."),
               "device": str(s.device), "attn": s.attn, "attention_layers": list(s.spec.attention_layers),
               "positions": s.spec.positions, "kernels": mode, "trust_remote_code": s.trust_remote_code,
               "out": str(out)}
        proc = subprocess.run([sys.executable, "-m", worker.__name__, json.dumps(job)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            if proc.returncode != 2:        # 2: the pin refused (no second kernel path here)
                return Variant(None, None, f"not run: the capture.kernels={mode} subprocess failed: {reason}",
                               {"kernels": mode})
            return not_applicable(f"no second kernel path here: capture.kernels={mode} cannot run: {reason}",
                                  kernels=mode)
        from safetensors.torch import load_file
        tensors, facts = load_file(str(out)), json.loads(proc.stdout.strip().splitlines()[-1])
    name, note = _first(rec, tensors, cast=False)
    return Variant(tensors[capture.act_name("logits")][0], name, note + " (in a subprocess)",
                   ran_with(s, kernels=mode, threads=facts["threads"], kernel_path=facts["kernel_path"]))
