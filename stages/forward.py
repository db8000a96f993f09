"""Stage forward: one captured forward pass -> capture.safetensors + facts.json."""

from __future__ import annotations

from pathlib import Path

from pipeline import kernels
from pipeline.config import schema
from pipeline.store import graph, paths
from pipeline.store.artifacts import stage_main, stage_run

STAGE = "forward"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    model_cfg = schema.load_section(params, "model")
    cap = schema.load_section(params, "capture")
    kernels.pin(cap.kernels)          # before torch loads: the model code is imported below
    from pipeline.model import forward
    plan = forward.plan(cap, paths.stage_dir("prepare_model"))   # every check before any load or write
    with stage_run(STAGE, schema.subset(params, graph.PARAMS[STAGE])) as run:
        forward.record(run, plan, model_cfg.trust_remote_code, schema.load_section(params, "executor"))


if __name__ == "__main__":
    stage_main(STAGE, main)
