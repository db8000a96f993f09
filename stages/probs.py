"""Stage probs: FP64 probability tables, filtered sets and their summary, from logits.parquet."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import registry, schema
from pipeline.numerics import probs
from pipeline.store import paths
from pipeline.store.artifacts import stage_main, stage_run

STAGE = "probs"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    probs_cfg, sampling = schema.load_section(params, "probs"), schema.load_section(params, "sampling")
    probs.filters(probs_cfg, sampling)                  # a bad value fails before any work
    with stage_run(STAGE, schema.subset(params, registry.PARAMS[STAGE])) as run:
        outputs, facts = probs.build(run.use(paths.LOGITS), run.use(paths.VOCAB), probs_cfg, sampling)
        run.model = facts["model"]
        run.facts = {k: facts[k] for k in ("positions", "temperatures", "logits_content_sha256")}
        run.write_parquet(paths.TABLE[1], outputs[paths.TABLE], compression="zstd",
                          row_group_size=facts["rows_per_position"])      # one row group per position
        run.write_parquet(paths.FILTERED[1], outputs[paths.FILTERED], compression="zstd")
        run.write_json(paths.PROBS_SUMMARY[1], outputs[paths.PROBS_SUMMARY])
        run.write_json(paths.PROBS_METRICS[1], outputs[paths.PROBS_METRICS])


if __name__ == "__main__":
    stage_main(STAGE, main)
