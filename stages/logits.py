"""Stage logits: the captured logits in long format (logits.parquet), one row at a time.

Reads capture.safetensors without torch or the tokenizer (the vocabulary table is the
tokenize stage's vocab.parquet): the stage holds one row of [T, V] at any prompt length.
"""

from __future__ import annotations

from pipeline.model.capture_file import CapturedLogits
from pipeline.store import logits_io, paths, provenance
from pipeline.store.artifacts import read_json, stage_main, stage_run

STAGE = "logits"


def main() -> None:
    with stage_run(STAGE, {}) as run:
        source = read_json(run.use(paths.SOURCE))
        facts = read_json(run.use(paths.FORWARD_FACTS))
        logits = CapturedLogits.open(run.use(paths.CAPTURE), facts)      # [1, T or 1, V], checked against facts
        run.model = provenance.model_record(source)
        run.facts = logits.parquet_facts()
        logits_io.write_logits(run.out(paths.LOGITS[1]), logits.rows(), run.parquet_metadata(), total=logits.n_rows)


if __name__ == "__main__":
    stage_main(STAGE, main)
