"""The checks stage's recording: every check on the run (`pipeline.checks.stage`), per prompt here or on Ray
workers, -> checks.parquet + metrics.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.checks import verdicts
from pipeline.checks.stage import Checker, finish, prepare
from pipeline.executor.work import LoadsInSetup
from pipeline.store import paths, provenance
from pipeline.store.artifacts import StageRun


def record(stage: StageRun, params: dict, executor=None) -> list[verdicts.Check]:
    """Run every check on the run in stage.root and write checks.parquet + metrics.json into `stage`; the
    per-prompt checks run here or on Ray workers (`executor`, `pipeline.executor`)."""
    from pipeline.executor import run as ex
    source, prompt_ids = prepare(params, stage.use, stage.root)
    work = ChecksWork(params, str(Path(stage.root).resolve()), source)
    stage.model = provenance.model_record(source)
    done = ex.run_prompts(stage, work, prompt_ids, executor or ex.SERIAL) if prompt_ids else []
    results, source, facts = finish(done, source, stage.root)
    stage.facts = {**facts, **verdicts.summary(results)}
    stage.write_parquet(paths.CHECKS[1], verdicts.to_table(results))
    stage.write_json(paths.METRICS[1], verdicts.metrics(results))
    return results


@dataclass
class ChecksWork(LoadsInSetup):
    """One prompt's checks (`pipeline.executor.PromptWork`) -> (its checks, the stages it found missing, the
    device record). The model and tokenizer load in `setup` (`Checker`); nothing is written per prompt."""
    params: dict
    root: str
    source: dict
    stage: str = "checks"

    def setup(self) -> None:
        self._checker = Checker(self.params, self.root, self.source)

    def run(self, out, pid: str) -> tuple[list[verdicts.Check], list[str], dict]:
        return self._checker.run(out.use, pid)
