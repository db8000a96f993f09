"""Stage equivalence: the recorded forward pass re-run under each variation -> equivalence.parquet + checks.parquet.

Exit status 1 when an `error` check fails (a variation expected exact here is not, or a row its
own recomputation does not reproduce), after the results are written; `report` checks never fail it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline import kernels
from pipeline.config import schema
from pipeline.store import graph, paths
from pipeline.store.artifacts import stage_main, stage_run

STAGE = "equivalence"


def main() -> None:
    params = schema.read_params(Path(paths.PARAMS))
    model_cfg = schema.load_section(params, "model")
    cap = schema.load_section(params, "capture")
    cfg = schema.load_section(params, "equivalence")
    report_prompt = schema.load_section(params, "report").prompt_id
    kernels.pin(cap.kernels)          # before torch loads: the model code is imported below
    from pipeline.checks import equivalence as checks
    from pipeline.checks import verdicts
    from pipeline.equivalence import matrix
    with stage_run(STAGE, schema.subset(params, graph.PARAMS[STAGE])) as run:
        m = matrix.record(run, cap, cfg, report_prompt, model_cfg.trust_remote_code)
        results = checks.record(run, m, cfg)
        run.facts = {**m.facts(), **verdicts.summary(results)}      # after the tables (see Matrix.facts)
    print(checks.summary_text(results))
    if failed := verdicts.failed_line(results):   # after the commit: the results stay, the run fails
        print(f"nexttoken {STAGE}: error checks failed: {failed} "
              f"(see {paths.artifact(paths.EQUIVALENCE_CHECKS).as_posix()})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    stage_main(STAGE, main)
