"""The forward stage's work: validate, load, capture one pass, and record its facts.

`record` is the stage's whole body, given its `StageRun`: run by `python -m stages.forward`
and, in one process, by `nexttoken verify`. The logits stage reads the capture back here too.

One forward pass and no more, refused before the model loads when its estimated peak memory
exceeds what the device has free (`pipeline.model.memory`). That the capture is transparent
(its logits equal a hook-free forward's bit for bit) and that the pass repeats exactly is
established by the checks stage (`capture_transparent`, `repeat_deterministic`), which runs
those plain forwards itself against the stored capture; running them here as well only
doubled the cost.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config.schema import CaptureConfig
from pipeline.errors import UserError
from pipeline.model import capture, loader, memory
from pipeline.store import paths, provenance
from pipeline.store.artifacts import StageRun, read_json, read_parquet


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


def run(p: ForwardPlan, ids: list[int], trust_remote_code: bool) -> ForwardResult:
    if not ids:
        raise UserError("tokens.parquet holds no tokens: re-run the tokenize stage")
    memory.guard(memory.estimate(p.snapshot, p.dtype, len(ids), p.spec, trust_remote_code), p.device, p.spread)
    model = loader.load_model(p.snapshot, p.dtype, str(p.device), p.capture.attn_implementation,
                              trust_remote_code, spread=p.spread)
    tokenizer_len = len(loader.load_tokenizer(p.snapshot))
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


def record(stage: StageRun, p: ForwardPlan, trust_remote_code: bool) -> None:
    """The forward stage: one captured pass over the stored tokens -> capture.safetensors + facts.json."""
    stage.use(paths.stage_dir("prepare_model"))
    ids = read_parquet(stage.use(paths.TOKENS), columns=["token_id"])["token_id"].to_pylist()
    result = run(p, ids, trust_remote_code=trust_remote_code)
    stage.model = {**p.model_record, "trust_remote_code": trust_remote_code}
    stage.facts = result.facts
    save_capture(result, stage.out(paths.CAPTURE[1]))
    stage.write_json(paths.FORWARD_FACTS[1], result.facts)


def logit_positions(positions: str, n: int) -> list[int]:
    return list(range(n)) if positions == "all" else [n - 1]


def save_capture(result: ForwardResult, path: Path) -> None:
    from safetensors.torch import save
    meta = {"format": "nexttoken-capture", "names": json.dumps(list(result.tensors))}
    data = memoryview(save({k: v.contiguous() for k, v in result.tensors.items()}, metadata=meta))
    header, body = _canonical_header(data)
    with open(path, "wb") as f:   # in the staging folder: a half-written file never reaches artifacts/
        f.write(header)
        f.write(body)


def _canonical_header(data: memoryview) -> tuple[bytes, memoryview]:
    """The safetensors header with its metadata keys sorted, and the tensor bytes after it.

    safetensors writes `__metadata__` from a Rust HashMap, whose order changes from one
    process to the next: the same capture would get different bytes (and sha256) per run.
    """
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(bytes(data[8:8 + n]))
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 8)          # tensor data stays 8-byte aligned
    return struct.pack("<Q", len(text)) + text, data[8 + n:]


def load_logits(path: Path, facts: dict) -> torch.Tensor:
    """The stored logits as [rows, V] in their computed dtype (rows = logit_positions).

    The capture must belong with facts.json: same input ids, same logits shape.
    """
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            logits, input_ids = f.get_tensor(capture.act_name("logits")), f.get_tensor("input_ids")
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    recorded = (facts.get("names") or {}).get(capture.act_name("logits"), {}).get("shape")
    if input_ids[0].tolist() != facts.get("input_ids") or list(logits.shape) != recorded:
        raise UserError(f"{path} and {Path(path).with_name('facts.json')} come from different runs (input ids "
                        f"or logits shape {list(logits.shape)} != {recorded} differ): re-run `dvc repro`")
    return logits[0]


def logit_rows(facts: dict, logits: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    positions = facts["logit_positions"]
    if len(positions) != logits.shape[0]:
        raise UserError(f"capture.safetensors has {logits.shape[0]} logit rows but facts.json lists "
                        f"{len(positions)} positions: the forward artifacts come from different runs")
    for i, pos in enumerate(positions):
        yield pos, logits[i]


def logits_facts(facts: dict, logits: torch.Tensor) -> dict:
    """Key facts carried in logits.parquet's schema metadata."""
    import hashlib
    raw = logits.contiguous().view(torch.uint8) if logits.dtype != torch.float32 else logits.contiguous()
    return {"dtype": facts["compute_dtype"], "device": facts["device"], "output_size": facts["output_size"],
            "n_positions": facts["n_positions"], "tokenizer_len": facts["tokenizer_len"],
            "positions": facts["logit_positions"],
            "logits_content_sha256": hashlib.sha256(raw.numpy()).hexdigest()}   # hashes the buffer: no copy
