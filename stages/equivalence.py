"""Stage equivalence: the recorded forward pass re-run under each variation -> equivalence.parquet + checks.parquet.

Exit status 1 when an `error` check fails (a variation expected exact here is not, or a row its
own recomputation does not reproduce), after the results are written; `report` checks never fail it.
"""

from __future__ import annotations

import sys

from pipeline.store import graph, paths
from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "equivalence"


def work(cfg: graph.StageConfig) -> None:
    cap, eq = cfg.section("capture"), cfg.section("equivalence")
    from pipeline.checks import equivalence as checks
    from pipeline.checks import verdicts
    from pipeline.record import equivalence as recording
    with stage_run(STAGE, cfg.recorded) as run:
        m = recording.record(run, cap, eq, cfg.section("report").prompt_id, cfg.section("model").trust_remote_code)
        results = recording.record_checks(run, m, eq)
        run.facts = {**m.facts(), **verdicts.summary(results)}      # after the tables (see Matrix.facts)
    print(checks.summary_text(results))
    if failed := verdicts.failed_line(results):   # after the commit: the results stay, the run fails
        print(f"nexttoken {STAGE}: error checks failed: {failed} "
              f"(see {paths.artifact(paths.EQUIVALENCE_CHECKS).as_posix()})", file=sys.stderr)
        sys.exit(1)


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
