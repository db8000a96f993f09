"""Stage logits: the captured logits in long format (logits.parquet) and the vocabulary."""

from __future__ import annotations

from pipeline.model import forward, loader, tokenization
from pipeline.store import logits_io, paths, provenance
from pipeline.store.artifacts import read_json, stage_main, stage_run

STAGE = "logits"


def main() -> None:
    with stage_run(STAGE, {}) as run:
        source = read_json(run.use(paths.SOURCE))
        prepared = paths.stage_dir("prepare_model")
        for f in loader.tokenizer_files(prepared, source):          # what the tokenizer reads: recorded
            run.use(f)
        facts = read_json(run.use(paths.FORWARD_FACTS))
        logits = forward.load_logits(run.use(paths.CAPTURE), facts)  # [T or 1, V], computed dtype
        run.model = provenance.model_record(source)
        run.facts = forward.logits_facts(facts, logits)
        logits_io.write_logits(run.out(paths.LOGITS[1]), forward.logit_rows(facts, logits),
                               run.parquet_metadata(), total=logits.shape[0])
        tokenizer = loader.load_tokenizer(loader.snapshot_dir(prepared, source))
        run.write_parquet(paths.VOCAB[1], tokenization.vocab_table(tokenizer, range(facts["output_size"])))


if __name__ == "__main__":
    stage_main(STAGE, main)
