"""Stage prepare_model: a model snapshot that loads offline, plus source.json."""

from __future__ import annotations

from pipeline.store import graph, paths
from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "prepare_model"


def work(cfg: graph.StageConfig) -> None:
    model = cfg.section("model")
    from pipeline.model import sources
    with stage_run(STAGE, cfg.recorded) as run:
        record = sources.prepare(model.source, run.staging, trust_remote_code=model.trust_remote_code,
                                 progress=True)
        record = {"name": model.name, "trust_remote_code": model.trust_remote_code, **record}
        run.model = record
        if record["seed"] is not None:        # a seeded toy's init
            run.seeds["init"] = record["seed"]
        run.write_json(paths.SOURCE[1], record)


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
