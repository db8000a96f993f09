"""Stage forward: one captured forward pass -> capture.safetensors + facts.json."""

from __future__ import annotations

from pathlib import Path

from pipeline import config, forward, paths
from pipeline.artifacts import read_parquet, stage_main, stage_run

STAGE = "forward"
PARAMS = ("model.name", "model.trust_remote_code", "capture")


def main() -> None:
    params = config.read_params(Path(paths.PARAMS))
    model_cfg = config.load_section(params, "model")
    cap = config.load_section(params, "capture")
    plan = forward.plan(cap, paths.stage_dir("prepare_model"))   # every check before any load or write
    with stage_run(STAGE, config.subset(params, PARAMS)) as run:
        run.use(paths.stage_dir("prepare_model"))
        ids = read_parquet(run.use(paths.TOKENS), columns=["token_id"])["token_id"].to_pylist()
        result = forward.run(plan, ids, trust_remote_code=model_cfg.trust_remote_code)
        run.model = {**plan.model_record, "trust_remote_code": model_cfg.trust_remote_code}
        run.facts = result.facts
        forward.save_capture(result, run.out(paths.CAPTURE[1]))
        run.write_json(paths.FORWARD_FACTS[1], result.facts)


if __name__ == "__main__":
    stage_main(STAGE, main)
