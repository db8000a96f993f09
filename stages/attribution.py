"""Stage attribution: why this token, at each chosen prompt's last position -> logit_parts.parquet,
inputs.parquet (per prompt) + checks.parquet.

Exit status 1 when an `error` check fails (the parts do not add up to the logit, or the hooked pass is not
the recorded one), after the results are written; `report` checks (IG completeness, a family the split
does not apply to) never fail it.
"""

from __future__ import annotations

import sys

from pipeline.store import graph, paths
from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "attribution"


def work(cfg: graph.StageConfig) -> None:
    cap = cfg.section("capture")
    from pipeline.checks import attribution as checks
    from pipeline.checks import verdicts
    from pipeline.model import loader
    from pipeline.record import attribution as recording
    loader.resolve_device(cap.device)                   # a missing GPU fails before any work
    with stage_run(STAGE, cfg.recorded) as run:
        done = recording.record(run, cfg.section("model"), cap, cfg.section("attribution"),
                                cfg.section("report").prompt_id)
        results = recording.record_checks(run, done)
        run.facts = {**run.facts, **verdicts.summary(results)}
    print(checks.summary_text(results))
    if failed := verdicts.failed_line(results):   # after the commit: the results stay, the run fails
        print(f"nexttoken {STAGE}: error checks failed: {failed} "
              f"(see {paths.artifact(paths.ATTRIBUTION_CHECKS).as_posix()})", file=sys.stderr)
        sys.exit(1)


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
