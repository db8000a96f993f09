"""Stage forward: one captured forward pass -> capture.safetensors + facts.json."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import registry, schema
from pipeline.model import forward
from pipeline.store import paths
from pipeline.store.artifacts import read_json, read_parquet, stage_main, stage_run

STAGE = "forward"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    model_cfg = schema.load_section(params, "model")
    cap = schema.load_section(params, "capture")
    plan = forward.plan(cap, paths.stage_dir("prepare_model"))   # every check before any load or write
    with stage_run(STAGE, schema.subset(params, registry.PARAMS[STAGE])) as run:
        run.use(paths.stage_dir("prepare_model"))
        ids = read_parquet(run.use(paths.TOKENS), columns=["token_id"])["token_id"].to_pylist()
        tokenizer_len = read_json(run.use(paths.TOKENIZE_SUMMARY))["tokenizer_len"]
        result = forward.run(plan, ids, tokenizer_len, trust_remote_code=model_cfg.trust_remote_code)
        run.model = {**plan.model_record, "trust_remote_code": model_cfg.trust_remote_code}
        run.facts = result.facts
        forward.save_capture(result, run.out(paths.CAPTURE[1]))
        run.write_json(paths.FORWARD_FACTS[1], result.facts)


if __name__ == "__main__":
    stage_main(STAGE, main)
