"""The logits stage's work: the captured logits as logits.parquet (long format) and the vocabulary.

`record` is the stage's whole body, given its `StageRun`: run by `python -m stages.logits` and,
in one process, by `nexttoken verify`. It computes nothing (bf16 -> float32 is exact), so the
stage pins no kernels.
"""

from __future__ import annotations

from pipeline.model import forward, loader, tokenization
from pipeline.store import logits_io, paths, provenance
from pipeline.store.artifacts import StageRun, read_json


def record(stage: StageRun) -> None:
    """The logits stage: the captured logits in long format (logits.parquet) and the vocabulary."""
    source = read_json(stage.use(paths.SOURCE))
    prepared = paths.stage_dir("prepare_model", stage.root)
    for f in loader.tokenizer_files(prepared, source):          # what the tokenizer reads: recorded
        stage.use(f)
    facts = read_json(stage.use(paths.FORWARD_FACTS))
    logits = forward.load_logits(stage.use(paths.CAPTURE), facts)        # [T or 1, V], computed dtype
    stage.model = provenance.model_record(source)
    stage.facts = forward.logits_facts(facts, logits)
    logits_io.write_logits(stage.out(paths.LOGITS[1]), forward.logit_rows(facts, logits), stage.parquet_metadata(),
                           total=logits.shape[0])
    tokenizer = loader.load_tokenizer(loader.snapshot_dir(prepared, source))
    stage.write_parquet(paths.VOCAB[1], tokenization.vocab_table(tokenizer, range(facts["output_size"])))
