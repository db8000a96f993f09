"""Stage trajectories: sampled and greedy continuations, with and without the KV cache."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import registry, schema
from pipeline.model import loader, trajectories
from pipeline.store import logits_io, paths, provenance
from pipeline.store.artifacts import read_json, read_parquet, stage_main, stage_run

STAGE = "trajectories"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    model_cfg = schema.load_section(params, "model")
    cap = schema.load_section(params, "capture")
    sampling = schema.load_section(params, "sampling")
    device, dtype = loader.resolve_device(cap.device), loader.resolve_dtype(cap.dtype)
    with stage_run(STAGE, schema.subset(params, registry.PARAMS[STAGE])) as run:
        source = read_json(run.use(paths.SOURCE))
        run.use(paths.stage_dir("prepare_model"))
        ids = read_parquet(run.use(paths.TOKENS), columns=["token_id"])["token_id"].to_pylist()
        snapshot = loader.snapshot_dir(paths.stage_dir("prepare_model"), source)
        trajectories.check_room(len(ids), sampling.max_new_tokens, loader.max_positions(snapshot))
        model = loader.load_model(snapshot, dtype, device, cap.attn_implementation, model_cfg.trust_remote_code,
                                  spread=loader.spread(cap.device, snapshot, dtype))
        tokenizer = loader.load_tokenizer(snapshot)
        runs = trajectories.run_all(model, ids, sampling, loader.eos_ids(model))
        run.model = provenance.model_record(source)
        run.seeds["sample"] = sampling.seed
        run.facts = {**loader.device_record(model, device), "compute_dtype": cap.dtype, "prompt_len": len(ids)}
        run.write_parquet(paths.STEPS[1], trajectories.steps_table(runs, tokenizer, sampling.top_n),
                          compression="zstd")
        rows, keys = trajectories.step_logit_rows(runs)
        logits_io.write_logits(run.out(paths.STEP_LOGITS[1]), rows, run.parquet_metadata(),
                               extra_schema=trajectories.STEP_LOGITS_KEYS, extra_values=keys)
        summary = trajectories.summary(runs, tokenizer)
        run.write_json(paths.TRAJECTORIES[1], summary)
        run.write_json(paths.TRAJECTORIES_METRICS[1], trajectories.sweep_metrics(summary))


if __name__ == "__main__":
    stage_main(STAGE, main)
