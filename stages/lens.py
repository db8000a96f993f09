"""Stage lens: the logit lens of every layer at every captured position -> lens.parquet + lens_summary.parquet."""

from __future__ import annotations

from pipeline.store import graph
from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "lens"


def work(cfg: graph.StageConfig) -> None:
    cap = cfg.section("capture")
    from pipeline.model import loader
    from pipeline.record import lens
    loader.resolve_device(cap.device)                   # a missing GPU fails before any work
    with stage_run(STAGE, cfg.recorded) as run:
        lens.record(run, cfg.section("model"), cap, cfg.section("lens"), cfg.executor())


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
