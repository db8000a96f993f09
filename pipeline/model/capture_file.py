"""The forward stage's capture.safetensors as the logits stage reads it: no torch, one row at a time.

`CapturedLogits` checks the file against facts.json beside it (same input ids, the recorded
logits shape, one row per recorded position), then hands out the logits row by row as
float32 (the exact bf16 / fp16 values) and the sha256 of their stored bytes, streamed: at
any prompt length the stage holds one row of [T, V], not the matrix.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import UserError
from pipeline.model.names import act_name
from pipeline.store import safetensors_io

LOGITS = act_name("logits")


@dataclass(frozen=True)
class CapturedLogits:
    path: Path
    facts: dict               # forward/facts.json
    tensor: safetensors_io.Tensor

    @classmethod
    def open(cls, path: Path, facts: dict) -> CapturedLogits:
        """The capture's logits [1, rows, V], refused when the file and facts.json are not one run's."""
        tensors, _ = safetensors_io.header(path)
        for name in (LOGITS, "input_ids"):
            if name not in tensors:
                raise UserError(f"{path} has no tensor {name!r}: re-run the forward stage")
        logits, ids = tensors[LOGITS], safetensors_io.read(path, "input_ids")
        recorded = (facts.get("names") or {}).get(LOGITS, {}).get("shape")
        if ids.ndim != 2 or ids[0].tolist() != facts.get("input_ids") or list(logits.shape) != recorded:
            raise UserError(f"{path} and {Path(path).with_name('facts.json')} come from different runs (input ids "
                            f"or logits shape {list(logits.shape)} != {recorded} differ): re-run `dvc repro`")
        if len(facts.get("logit_positions") or []) != logits.shape[1]:
            raise UserError(f"{Path(path).name} has {logits.shape[1]} logit rows but facts.json lists "
                            f"{len(facts.get('logit_positions') or [])} positions: the forward artifacts come "
                            "from different runs")
        return cls(Path(path), facts, logits)

    @property
    def n_rows(self) -> int:
        return self.tensor.shape[1]

    def rows(self) -> Iterator[tuple[int, np.ndarray]]:
        """(prompt position, float32 logits row [V]) in file order."""
        yield from zip(self.facts["logit_positions"], safetensors_io.rows(self.path, LOGITS))

    def parquet_facts(self) -> dict:
        """Key facts carried in logits.parquet's schema metadata."""
        f = self.facts
        return {"dtype": f["compute_dtype"], "device": f["device"], "output_size": f["output_size"],
                "n_positions": f["n_positions"], "tokenizer_len": f["tokenizer_len"],
                "positions": f["logit_positions"],
                "logits_content_sha256": safetensors_io.sha256(self.path, LOGITS)}   # the stored bytes
