"""Stage logits: the captured logits in long format (logits.parquet), one row at a time.

Reads capture.safetensors without torch or the tokenizer (the vocabulary table is the
tokenize stage's vocab.parquet): the stage holds one row of [T, V] at any prompt length.
"""

from __future__ import annotations

from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "logits"


def work(cfg: None) -> None:
    from pipeline.record import logits
    with stage_run(STAGE, {}) as run:
        run.with_torch = False        # no torch here: the manifest records no kernel path
        logits.record(run)


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
