"""Stage checks: re-verify every recorded number -> checks.parquet + metrics.json (DVC metrics).

Exit status 1 when an `error` check fails, after the results are written; `report` checks
are numerical findings and never fail the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline import checks, config, models, paths, reference_figures
from pipeline.artifacts import read_json, stage_main, stage_run

STAGE = "checks"
PARAMS = ("model.name", "model.trust_remote_code", "model.tokenizer", "model.reference_figures", "prompt",
          "capture.dtype", "capture.device", "capture.attn_implementation", "probs", "sampling", "checks")


def main() -> None:
    params = config.read_params(Path(paths.PARAMS))
    cfg = {name: config.load_section(params, name)
           for name in ("model", "prompt", "capture", "probs", "sampling", "checks")}
    cap, model_cfg = cfg["capture"], cfg["model"]
    device, dtype = models.resolve_device(cap.device), models.resolve_dtype(cap.dtype)
    references = reference_figures.applicable(model_cfg.reference_figures, model_cfg.tokenizer.family,
                                              cfg["prompt"].text)             # a bad name fails before any work
    with stage_run(STAGE, config.subset(params, PARAMS)) as run:
        source = read_json(run.use(paths.SOURCE))
        snapshot = models.snapshot_dir(run.use(paths.stage_dir("prepare_model")), source)
        stored = checks.load(run.use)
        model = models.load_model(snapshot, dtype, device, cap.attn_implementation, model_cfg.trust_remote_code)
        tokenizer = models.load_tokenizer(snapshot, model_cfg.trust_remote_code)
        results = checks.run_all(stored, model, tokenizer, cfg, device, models.eos_ids(model))
        results += reference_figures.run(stored, model, tokenizer, cfg, results, references)
        summary = checks.metrics(results)["summary"]
        run.model = {k: source.get(k) for k in ("name", "kind", "revision")}
        run.facts = {"device": str(device), **summary}
        run.write_parquet(paths.CHECKS[1], checks.to_table(results))
        run.write_json(paths.METRICS[1], checks.metrics(results))
    failed = checks.failed_errors(results)
    print(f"{summary['checks']} checks: {summary['passed']} pass, {summary['failed_error']} error and "
          f"{summary['failed_report']} report checks fail"
          + "".join(f"\n  {c.verdict} ({c.severity}) {c.name}: {c.measured:g} > {c.tolerance:g}  {c.detail}"
                    for c in results if not c.passed))
    if failed:   # after the commit: the results stay, the run fails
        print(f"nexttoken {STAGE}: error checks failed: {', '.join(failed)} "
              f"(see {paths.artifact(paths.CHECKS).as_posix()})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    stage_main(STAGE, main)
