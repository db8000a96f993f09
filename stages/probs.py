"""Stage probs: FP64 probability tables, filtered sets and their summary, from logits.parquet."""

from __future__ import annotations

from pathlib import Path

from pipeline import config, paths, probs
from pipeline.artifacts import stage_main, stage_run

STAGE = "probs"
PARAMS = ("probs", "sampling.temperature", "sampling.top_k", "sampling.top_p")


def main() -> None:
    params = config.read_params(Path(paths.PARAMS))
    probs_cfg, sampling = config.load_section(params, "probs"), config.load_section(params, "sampling")
    probs.filters(probs_cfg, sampling)                  # a bad value fails before any work
    with stage_run(STAGE, config.subset(params, PARAMS)) as run:
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
