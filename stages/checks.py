"""Stage checks: re-verify every recorded number -> checks.parquet + metrics.json (DVC metrics).

Exit status 1 when an `error` check fails, after the results are written; `report` checks
are numerical findings and never fail the run.

After a run whose logits are not finite, DVC stops at the probs stage (it refuses NaN/Inf),
so this stage does not run there; `python -m stages.checks` then records what can still be
checked: `logits_finite` fails naming the positions, and each missing stage is one failed
`<stage>_outputs` check (see `pipeline.checks.suite.load`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.checks import stage, verdicts
from pipeline.config import registry, schema
from pipeline.store import paths, provenance
from pipeline.store.artifacts import stage_main, stage_run

STAGE = "checks"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    stage.sections(params)                             # a bad name fails before any work
    with stage_run(STAGE, schema.subset(params, registry.PARAMS[STAGE])) as run:
        results, source, facts = stage.compute(params, run.use)
        run.model = provenance.model_record(source)
        run.facts = {**facts, **verdicts.summary(results)}
        run.write_parquet(paths.CHECKS[1], verdicts.to_table(results))
        run.write_json(paths.METRICS[1], verdicts.metrics(results))
    print(stage.summary_text(results))
    if failed := verdicts.failed_errors(results):   # after the commit: the results stay, the run fails
        print(f"nexttoken {STAGE}: error checks failed: {', '.join(failed)} "
              f"(see {paths.artifact(paths.CHECKS).as_posix()})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    stage_main(STAGE, main)
