"""Stage prepare_model: a model snapshot that loads offline, plus source.json."""

from __future__ import annotations

from pathlib import Path

from pipeline import config, models, paths
from pipeline.artifacts import stage_main, stage_run

STAGE = "prepare_model"
PARAMS = ("model.name", "model.source", "model.trust_remote_code")


def main() -> None:
    params = config.read_params(Path(paths.PARAMS))
    model = config.load_section(params, "model")
    source = models.ModelSource(**params["model"]["source"])
    with stage_run(STAGE, config.subset(params, PARAMS)) as run:
        record = models.prepare(source, run.staging, trust_remote_code=model.trust_remote_code,
                                progress=True)
        record = {"name": model.name, "trust_remote_code": model.trust_remote_code, **record}
        run.model = record
        if source.seed is not None:
            run.seeds["init"] = source.seed
        run.write_json(paths.SOURCE[1], record)


if __name__ == "__main__":
    stage_main(STAGE, main)
