"""Stage trajectories: sampled and greedy continuations, with and without the KV cache."""

from __future__ import annotations

from pathlib import Path

from pipeline import kernels
from pipeline.config import schema
from pipeline.store import graph, paths
from pipeline.store.artifacts import stage_main, stage_run

STAGE = "trajectories"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    model_cfg = schema.load_section(params, "model")
    cap = schema.load_section(params, "capture")
    sampling = schema.load_section(params, "sampling")
    kernels.pin(cap.kernels)          # before torch loads: the model code is imported below
    from pipeline.model import loader, trajectories
    loader.resolve_device(cap.device)                   # a missing GPU fails before any work
    with stage_run(STAGE, schema.subset(params, graph.PARAMS[STAGE])) as run:
        trajectories.record(run, model_cfg, cap, sampling, schema.load_section(params, "executor"))


if __name__ == "__main__":
    stage_main(STAGE, main)
