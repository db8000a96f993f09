"""Stage probs: FP64 probability tables, filtered sets, their summary, per-prompt metrics, from logits.parquet."""

from __future__ import annotations

from pathlib import Path

from pipeline import kernels
from pipeline.config import schema
from pipeline.store import graph, paths
from pipeline.store.artifacts import stage_main, stage_run

STAGE = "probs"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    probs_cfg, sampling = schema.load_section(params, "probs"), schema.load_section(params, "sampling")
    kernels.pin(schema.load_section(params, "capture").kernels)   # the FP64 softmax runs ATen's kernels
    from pipeline.numerics import probs
    probs.filters(probs_cfg, sampling)                  # a bad value fails before any work
    with stage_run(STAGE, schema.subset(params, graph.PARAMS[STAGE])) as run:
        probs.record(run, probs_cfg, sampling, schema.load_section(params, "executor"))


if __name__ == "__main__":
    stage_main(STAGE, main)
