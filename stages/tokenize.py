"""Stage tokenize: tokens.parquet (one row per prompt position) and the round trip."""

from __future__ import annotations

from pathlib import Path

from pipeline import config, models, paths, tokenization
from pipeline.artifacts import read_json, stage_main, stage_run

STAGE = "tokenize"
PARAMS = ("model.name", "model.tokenizer", "prompt")


def main() -> None:
    params = config.read_params(Path(paths.PARAMS))
    model_cfg = config.load_section(params, "model")
    prompt = config.load_section(params, "prompt")
    with stage_run(STAGE, config.subset(params, PARAMS)) as run:
        source = read_json(run.use(paths.SOURCE))
        if prompt.file is not None:
            run.use(Path(prompt.file))          # its sha256 goes into the manifest
        prepared = paths.stage_dir("prepare_model")
        for f in models.tokenizer_files(prepared, source):          # what the tokenizer reads: recorded
            run.use(f)
        snapshot = models.snapshot_dir(prepared, source)
        tokenizer = models.load_tokenizer(snapshot)
        tok = tokenization.tokenize_prompt(tokenizer, prompt.text, model_cfg.tokenizer.add_special_tokens,
                                           max_positions=models.max_positions(snapshot))
        expected = prompt.expected_ids_for(model_cfg.tokenizer.family)
        summary = {**tok.summary, "tokenizer_family": model_cfg.tokenizer.family,
                   "expected_token_ids": expected,
                   "expected_token_ids_match": None if expected is None else expected == tok.ids}
        run.model = {k: source.get(k) for k in ("name", "kind", "revision")}
        run.facts = {"n_tokens": len(tok.ids), "round_trip_ok": tok.summary["round_trip_ok"]}
        run.write_parquet(paths.TOKENS[1], tok.table)
        run.write_json(paths.TOKENIZE_SUMMARY[1], summary)


if __name__ == "__main__":
    stage_main(STAGE, main)
