"""Stage probs: FP64 probability tables, filtered sets and their summary, from logits.parquet."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from pipeline import config, logits_io, paths, probs
from pipeline.artifacts import parquet_facts, read_parquet, stage_main, stage_run

STAGE = "probs"
PARAMS = ("probs", "sampling.temperature", "sampling.top_k", "sampling.top_p")


def main() -> None:
    params = config.read_params(Path(paths.PARAMS))
    probs_cfg = config.load_section(params, "probs")
    sampling = config.load_section(params, "sampling")
    named = probs.filters(probs_cfg, sampling)
    with stage_run(STAGE, config.subset(params, PARAMS)) as run:
        logits_path = run.use(paths.LOGITS)
        facts = parquet_facts(logits_path)
        positions = probs.resolve_positions(probs_cfg.positions, facts["n_positions"], facts["positions"])
        vocab_t = read_parquet(run.use(paths.VOCAB), columns=["token_id", "text"])
        vocab = dict(zip(vocab_t["token_id"].to_pylist(), vocab_t["text"].to_pylist()))
        tables, filtered, summary = [], {n: [] for n in probs.FILTERED_SCHEMA.names}, \
            {"temperatures": [], "filters": []}
        for pos in positions:
            row = logits_io.read_position(logits_path, pos)
            probs.check_finite(pos, row)
            table, by_t = probs.position_table(pos, row, probs_cfg.temperatures)
            tables.append(table)
            summary["temperatures"] += probs.temperature_summary(
                pos, row, by_t, probs_cfg.top_n, probs_cfg.fp32_sum_tolerance, probs_cfg.fp64_sum_tolerance, vocab)
            for flt in named:
                rows, entry = probs.filtered_rows(pos, row, flt)
                for k, v in rows.items():
                    filtered[k] += v
                summary["filters"].append(entry)
        run.model = facts.get("model")
        run.facts = {"positions": positions, "temperatures": list(probs_cfg.temperatures),
                     "logits_content_sha256": facts.get("logits_content_sha256")}
        run.write_parquet(paths.TABLE[1], pa.concat_tables(tables), compression="zstd",
                          row_group_size=len(vocab))
        run.write_parquet(paths.FILTERED[1], pa.table(filtered, schema=probs.FILTERED_SCHEMA), compression="zstd")
        run.write_json(paths.PROBS_SUMMARY[1], {"positions": positions, **summary})
        last = positions[-1]
        sampling_filter = next(f for f in summary["filters"] if f["position"] == last and f["filter"] == "sampling")
        run.write_json(paths.PROBS_METRICS[1], probs.sweep_metrics(
            last, logits_io.read_position(logits_path, last), sampling_filter, summary["temperatures"]))


if __name__ == "__main__":
    stage_main(STAGE, main)
