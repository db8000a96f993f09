"""The forward pass: validate, load, capture one pass, and its facts.

The stage's recording (reading the tokens through the run's ledger, writing the capture) is
`pipeline.record.forward`; this module computes on values and writes the capture file it is given.

One forward pass and no more, refused before the model loads when its estimated peak memory
exceeds what the device has free (`pipeline.model.memory`). That the capture is transparent
(its logits equal a hook-free forward's bit for bit) and that the pass repeats exactly is
established by the checks stage (`capture_transparent`, `repeat_deterministic`), which runs
a plain forward itself against the stored capture (a second one only when they differ);
running it here as well only doubled the cost.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config.schema import CaptureConfig
from pipeline.errors import UserError
from pipeline.model import capture, loader, memory
from pipeline.store import provenance
from pipeline.store.artifacts import read_json


@dataclass(frozen=True)
class ForwardPlan:
    snapshot: Path
    device: torch.device
    dtype: torch.dtype
    capture: CaptureConfig
    spec: capture.CaptureSpec
    num_layers: int
    model_record: dict
    spread: bool = False      # over every visible GPU (`loader.spread`)


def plan(cap: CaptureConfig, prepared_dir: Path) -> ForwardPlan:
    """Resolve device, dtype and layers from the config and the model's config.json only."""
    device = loader.resolve_device(cap.device)
    dtype = loader.resolve_dtype(cap.dtype)
    source = read_json(prepared_dir / "source.json")
    snapshot = loader.snapshot_dir(prepared_dir, source)
    num_layers = loader.num_layers(snapshot)
    spec = capture.CaptureSpec(attention_layers=cap.attention_layers, positions=cap.positions)
    spec.resolve_layers(num_layers)          # raises naming an out-of-range layer
    record = provenance.model_record(source)
    spread = loader.spread(cap.device, snapshot, dtype)
    return ForwardPlan(snapshot, device, dtype, cap, spec, num_layers, record, spread)


@dataclass(frozen=True)
class ForwardResult:
    tensors: dict[str, torch.Tensor]
    facts: dict


def check_tokens(ids: list[int], tokenizer_len: int) -> None:
    """`tokenizer_len`: as the tokenize stage recorded it (tokenize.json), not a second tokenizer load."""
    if not ids:
        raise UserError("tokens.parquet holds no tokens: re-run the tokenize stage")
    if isinstance(tokenizer_len, bool) or not isinstance(tokenizer_len, int):
        raise UserError(f"tokenize.json records tokenizer_len={tokenizer_len!r}: re-run the tokenize stage")


def load(p: ForwardPlan, longest: int, trust_remote_code: bool):
    """The model, once for every prompt: refused first when the longest prompt's pass would not fit."""
    memory.guard(memory.estimate(p.snapshot, p.dtype, longest, p.spec, trust_remote_code), p.device, p.spread)
    return loader.load_model(p.snapshot, p.dtype, str(p.device), p.capture.attn_implementation,
                             trust_remote_code, spread=p.spread)


def run(p: ForwardPlan, ids: list[int], tokenizer_len: int, trust_remote_code: bool, model=None) -> ForwardResult:
    """One captured pass over one prompt's ids, on `model` (loaded here when not given)."""
    check_tokens(ids, tokenizer_len)
    model = model if model is not None else load(p, len(ids), trust_remote_code)
    input_ids = torch.tensor([ids], dtype=torch.long)
    tensors = capture.run_capture(model, input_ids, p.spec)
    where = loader.device_record(model, p.device)
    facts = {
        **capture.model_facts(model, tokenizer_len),
        "device": where["device"],
        "compute_dtype": str(p.dtype).removeprefix("torch."),
        "positions": p.spec.positions,
        "attention_layers": list(p.spec.resolve_layers(p.num_layers)),
        "n_positions": len(ids),
        "logit_positions": logit_positions(p.spec.positions, len(ids)),
        "input_ids": ids,
        "names": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                  for name, t in tensors.items()},
        "gpu_name": where["gpu_name"],
    }
    if p.spread:
        facts["device_map"] = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    return ForwardResult({**tensors, "input_ids": input_ids}, facts)


PARTITION_ONLY = ("input_ids", "names")


def manifest_facts(facts: dict) -> dict:
    """A prompt's facts as the manifest records them: all but its input ids and every captured tensor's shape
    and dtype (`PARTITION_ONLY`), which its facts.json holds and every reader takes from there. In the manifest
    they were 4.9 KB per prompt: 49 MB for 10,000 prompts, which each later stage parsed to check its inputs."""
    return {k: v for k, v in facts.items() if k not in PARTITION_ONLY}


def logit_positions(positions: str, n: int) -> list[int]:
    return list(range(n)) if positions == "all" else [n - 1]


def save_capture(result: ForwardResult, path: Path) -> None:
    """capture.safetensors, streamed: safetensors writes the header, then each tensor's bytes
    straight from its storage (no second copy of the capture in memory); then the header's
    metadata is put in canonical order in place (`canonical_header`: same length, so the
    tensor bytes stay where they are)."""
    from safetensors.torch import save_file
    meta = {"format": "nexttoken-capture", "names": json.dumps(list(result.tensors))}
    # in the staging folder: a half-written file never reaches artifacts/
    save_file({k: v.contiguous() for k, v in result.tensors.items()}, str(path), metadata=meta)
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = canonical_header(f.read(n))
        if len(header) != 8 + n:     # never seen: the same JSON in another key order has the same length
            raise RuntimeError(f"{path}: the canonical safetensors header is {len(header) - 8} bytes, not {n}")
        f.seek(0)
        f.write(header)


def canonical_header(text: bytes) -> bytes:
    """The 8-byte length and the safetensors header JSON with its metadata keys sorted, padded
    with spaces so the tensor data stays 8-byte aligned.

    safetensors writes `__metadata__` from a Rust HashMap, whose order changes from one
    process to the next: the same capture would get different bytes (and sha256) per run.
    """
    header = json.loads(text)
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    out = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    out += b" " * (-(8 + len(out)) % 8)
    return struct.pack("<Q", len(out)) + out
