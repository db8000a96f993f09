"""The probs stage's recording: per prompt (here, or on Ray workers with `executor.kind=ray`), its tables
from its logits.parquet (`pipeline.numerics.probs.build`) into its partition; then the set's
prompt_metrics.parquet and metrics.json."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from pipeline.config.schema import ProbsConfig, SamplingConfig
from pipeline.numerics.probs import (
    DERIVABLE,
    DERIVED_NOTE,
    build,
    derived_note,
    filters,
    metrics_schema,
    run_metrics,
    set_table,
    table_mode,
)
from pipeline.store import paths
from pipeline.store.artifacts import StageRun, Writer


def record(stage: StageRun, probs_cfg: ProbsConfig, sampling_cfg: SamplingConfig, executor=None) -> None:
    """The probs stage's whole body (python -m stages.probs; `nexttoken verify` in one process), per prompt
    (on Ray workers with `executor.kind=ray`: `pipeline.executor`)."""
    from pipeline.executor import run as ex
    stage.use(paths.VOCAB)
    pids = stage.prompt_ids(paths.LOGITS)
    table = table_mode(probs_cfg, len(pids))          # stored or derived (probs.table)
    done = ex.run_prompts(stage, ProbsWork(probs_cfg, sampling_cfg, table), pids, executor or ex.SERIAL)
    if table == "derived":          # DVC's outs name both folders: each holds a note instead of partitions
        for item in DERIVABLE:
            stage.write_json(f"{paths.dataset(item).name}/{DERIVED_NOTE}", derived_note(item))
    rows, figures = [r for prompt_rows, _ in done for r in prompt_rows], [f for _, f in done]
    # set-level: the last prompt's sweep figures, then the set's aggregates over every prompt's figures
    stage.write_json(paths.PROBS_METRICS[1], run_metrics(figures))
    schema = metrics_schema(filters(probs_cfg, sampling_cfg))
    stage.write_parquet(paths.PROBS_PROMPT_METRICS[1], set_table(rows, schema), compression="zstd")   # one row group


@dataclass
class ProbsWork:
    """One prompt's tables (`pipeline.executor.PromptWork`) -> (its prompt_metrics rows, its sweep figures). The rows
    travel as Python dicts: 10,000 three-row Arrow tables held 136 MB of the stage's RSS until the set's was built."""
    probs_cfg: ProbsConfig
    sampling_cfg: SamplingConfig
    table: str                      # `table_mode`: stored or derived
    stage: str = "probs"

    def setup(self) -> None:
        pass

    def run(self, out, pid: str) -> tuple[pa.Table, dict]:
        outputs, facts = build(out.use(paths.LOGITS, pid), out.use(paths.VOCAB), self.probs_cfg, self.sampling_cfg,
                               out.use(paths.TOKENIZE_SUMMARY, pid), self.table)
        out.model = facts["model"]
        out.facts = {k: facts[k] for k in ("positions", "temperatures", "logits_content_sha256", "table")}
        write_table(out, outputs, pid, facts["rows_per_position"])      # table.parquet, filtered.parquet
        out.write_json(paths.PROBS_SUMMARY[1], outputs[paths.PROBS_SUMMARY], prompt_id=pid)
        return outputs[paths.PROBS_PROMPT_METRICS].to_pylist(), outputs[paths.PROBS_METRICS]


def write_table(stage: Writer, outputs: dict, prompt_id: str, rows_per_position: int) -> None:
    """table.parquet (one row group per position) and filtered.parquet into the prompt's partition, where
    `build` made them (`probs.table` stored); derived ones are not written."""
    if paths.TABLE in outputs:
        stage.write_parquet(paths.TABLE[1], outputs[paths.TABLE], prompt_id=prompt_id, compression="zstd",
                            row_group_size=rows_per_position)
    if paths.FILTERED in outputs:
        stage.write_parquet(paths.FILTERED[1], outputs[paths.FILTERED], prompt_id=prompt_id, compression="zstd")
