"""Stage forward: one captured forward pass -> capture.safetensors + facts.json."""

from __future__ import annotations

from pipeline.store import graph, paths
from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "forward"


def work(cfg: graph.StageConfig) -> None:
    from pipeline.model import forward
    from pipeline.record import forward as recording
    plan = forward.plan(cfg.section("capture"), paths.stage_dir("prepare_model"))   # every check before any load
    with stage_run(STAGE, cfg.recorded) as run:
        recording.record(run, plan, cfg.section("model").trust_remote_code, cfg.executor())


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
