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

from pipeline.store import graph, paths
from pipeline.store.artifacts import entry, stage_main, stage_run, stale_report_note

STAGE = "checks"


def work(cfg: graph.StageConfig) -> None:
    from pipeline.checks import stage, verdicts
    from pipeline.record import checks
    stage.sections(cfg.recorded)                       # a bad name fails before any work
    with stage_run(STAGE, cfg.recorded) as run:
        results = checks.record(run, cfg.recorded, cfg.executor())
    print(stage.summary_text(results))
    if failed := verdicts.failed_line(results):   # after the commit: the results stay, the run fails
        print(f"nexttoken {STAGE}: error checks failed: {failed} "
              f"(see {paths.artifact(paths.CHECKS).as_posix()}){stale_report_note()}", file=sys.stderr)
        sys.exit(1)


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
