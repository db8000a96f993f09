"""Stage tokenize: per prompt of the run's set, tokens.parquet (one row per position) and the round trip
(tokenize.json), each in its prompt's partition; vocab.parquet once for the run."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import prompt_set
from pipeline.store import graph, paths, provenance
from pipeline.store.artifacts import entry, read_json, stage_main, stage_run

STAGE = "tokenize"


def work(cfg: graph.StageConfig) -> None:
    model_cfg = cfg.section("model")
    prompt = cfg.section("prompt")
    from pipeline.model import loader, tokenization
    with stage_run(STAGE, cfg.recorded) as run:
        source = read_json(run.use(paths.SOURCE))
        for given in (prompt.file, prompt.set):
            if given is not None:
                run.use(Path(given))            # its sha256 goes into the manifest
        prepared = paths.stage_dir("prepare_model")
        for f in loader.tokenizer_files(prepared, source):          # what the tokenizer reads: recorded
            run.use(f)
        snapshot = loader.snapshot_dir(prepared, source)
        tokenizer = loader.load_tokenizer(snapshot)                 # once for every prompt of the set
        run.model = provenance.model_record(source)
        # a single prompt is a set of one; the run's order is its ids sorted, as its partitions are listed
        for record in sorted(prompt_set.for_config(prompt).prompts, key=lambda r: r.id):
            with run.timed(record.id):
                where = prompt_set.where(prompt, record)
                text, add = tokenization.prompt_for(tokenizer, record, model_cfg.tokenizer.add_special_tokens, where)
                tok = tokenization.tokenize_prompt(tokenizer, text, add, loader.max_positions(snapshot), where,
                                                   chat=record.chat)
                expected = record.expected_ids_for(model_cfg.tokenizer.family)
                chat = {"chat": record.chat, "messages": tokenization.chat_messages(record) if record.chat else None}
                summary = {**tok.summary, **chat, "prompt_name": prompt.name, "prompt_id": record.id,
                           "tokenizer_family": model_cfg.tokenizer.family, "expected_token_ids": expected,
                           "expected_token_ids_match": None if expected is None else expected == tok.ids}
                run.facts = {"n_tokens": len(tok.ids), "round_trip_ok": tok.summary["round_trip_ok"]}
                run.write_parquet(paths.TOKENS[1], tok.table, prompt_id=record.id)
                run.write_json(paths.TOKENIZE_SUMMARY[1], summary, prompt_id=record.id)
        # every id of the model's output, built here once: later stages read it instead of a tokenizer
        run.write_parquet(paths.VOCAB[1], tokenization.vocab_table(tokenizer, range(loader.output_size(snapshot))))


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
