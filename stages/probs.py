"""Stage probs: FP64 probability tables, filtered sets, their summary, per-prompt metrics, from logits.parquet."""

from __future__ import annotations

from pipeline.store import graph
from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "probs"


def work(cfg: graph.StageConfig) -> None:
    probs_cfg, sampling = cfg.section("probs"), cfg.section("sampling")
    from pipeline.numerics import probs
    from pipeline.record import probs as recording
    probs.filters(probs_cfg, sampling)                  # a bad value fails before any work
    with stage_run(STAGE, cfg.recorded) as run:
        recording.record(run, probs_cfg, sampling, cfg.executor())


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
