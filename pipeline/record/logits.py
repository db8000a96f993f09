"""The logits stage's recording: per prompt, the captured logits in long format (logits.parquet in its partition),
one row at a time.

It reads capture.safetensors without torch or the tokenizer (`pipeline.model.capture_file`; the vocabulary table
is the tokenize stage's vocab.parquet), so the stage holds one row of [T, V] at any prompt length. It computes
nothing (bf16 -> float32 is exact), so the stage pins no kernels.
"""

from __future__ import annotations

from pipeline.model.capture_file import CapturedLogits
from pipeline.store import logits_io, paths, provenance
from pipeline.store.artifacts import StageRun, read_json


def record(stage: StageRun) -> None:
    """Per prompt, the captured logits in long format (logits.parquet in its partition)."""
    source = read_json(stage.use(paths.SOURCE))
    stage.model = provenance.model_record(source)
    for pid in stage.prompt_ids(paths.CAPTURE):
        with stage.timed(pid):
            facts = read_json(stage.use(paths.FORWARD_FACTS, pid))
            logits = CapturedLogits.open(stage.use(paths.CAPTURE, pid), facts)   # [1, T or 1, V], checked vs facts
            stage.facts = logits.parquet_facts()
            logits_io.write_logits(stage.out(paths.LOGITS[1], pid), logits.rows(), stage.parquet_metadata(),
                                   total=logits.n_rows)
