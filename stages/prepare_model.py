"""Stage prepare_model: a model snapshot that loads offline, plus source.json."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import schema
from pipeline.store import graph, paths
from pipeline.store.artifacts import stage_main, stage_run

STAGE = "prepare_model"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    model = schema.load_section(params, "model")
    from pipeline.model import snapshot
    with stage_run(STAGE, schema.subset(params, graph.PARAMS[STAGE])) as run:
        record = snapshot.prepare(model.source, run.staging, trust_remote_code=model.trust_remote_code,
                                progress=True)
        record = {"name": model.name, "trust_remote_code": model.trust_remote_code, **record}
        run.model = record
        if model.source.seed is not None:
            run.seeds["init"] = model.source.seed
        run.write_json(paths.SOURCE[1], record)


if __name__ == "__main__":
    stage_main(STAGE, main)
