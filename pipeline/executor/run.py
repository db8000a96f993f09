"""`run_prompts`: a stage's per-prompt work over the run's prompts, here (`serial`) or on Ray
(`pipeline.executor.cluster`); see the package's docstring for the whole mechanism."""


from __future__ import annotations

import platform
from collections.abc import Sequence
from typing import Any

from pipeline.config.schema import ExecutorConfig
from pipeline.executor.work import PromptWork, release_memory
from pipeline.store.artifacts import StageRun

SERIAL = ExecutorConfig()          # `nexttoken verify` and `audit` re-run a stage's work here, serially


def run_prompts(stage: StageRun, work: PromptWork, prompt_ids: Sequence[str], cfg: ExecutorConfig) -> list[Any]:
    """Every prompt's `work.run`, in the run's order -> their values in that order. `cfg`: the
    executor section (`schema.ExecutorConfig`)."""
    if cfg.kind == "serial":
        stage.executor = {"kind": "serial", "node": platform.node()}
        work.setup()
        values = []
        for pid in prompt_ids:
            with stage.timed(pid):
                values.append(work.run(stage, pid))
            release_memory()
        return values
    from pipeline.executor import cluster  # ray is imported only here
    return cluster.run_prompts(stage, work, list(prompt_ids), cfg)
