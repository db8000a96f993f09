"""Stage checks: re-verify every recorded number -> checks.parquet + metrics.json (DVC metrics).

Exit status 1 when an `error` check fails, after the results are written; `report` checks
are numerical findings and never fail the run.

After a run whose logits are not finite, DVC stops at the probs stage (it refuses NaN/Inf),
so this stage does not run there; `python -m stages.checks` then records what can still be
checked: `logits_finite` fails naming the positions, and each missing stage is one failed
`<stage>_outputs` check (see `pipeline.checks.load`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from pipeline import checks, config, models, paths, reference_figures, verdicts
from pipeline.artifacts import read_json, stage_main, stage_run

STAGE = "checks"
PARAMS = ("model.name", "model.trust_remote_code", "model.tokenizer", "model.reference_figures", "prompt",
          "capture.dtype", "capture.device", "capture.attn_implementation", "probs", "sampling", "checks")
SECTIONS = ("model", "prompt", "capture", "probs", "sampling", "checks")


def sections(params: dict, root: Path | str = ".") -> tuple[dict, list]:
    """The typed config sections and the applicable reference figures: a bad value fails here,
    before any work."""
    cfg = {name: config.load_section(params, name, root) for name in SECTIONS}
    m = cfg["model"]
    return cfg, reference_figures.applicable(m.reference_figures, m.tokenizer.family, cfg["prompt"].text)


def compute(params: dict, use: Callable[[tuple[str, str]], Path], root: Path | str = ".") \
        -> tuple[list[verdicts.Check], dict, dict]:
    """Every check on the run in `root` -> (results, source.json, facts), written nowhere.

    `use` resolves an input item (StageRun.use records it; `nexttoken audit` passes a plain
    path lookup to re-run a past run's checks with these same calls).
    """
    cfg, references = sections(params, root)
    cap, model_cfg = cfg["capture"], cfg["model"]
    device, dtype = models.resolve_device(cap.device), models.resolve_dtype(cap.dtype)
    if cfg["prompt"].file is not None:
        use(Path(cfg["prompt"].file))                  # its sha256 goes into the manifest, as tokenize's
    source = read_json(use(paths.SOURCE))
    snapshot = models.snapshot_dir(use(paths.stage_dir("prepare_model")), source)
    stored = checks.load(use, root)
    model = models.load_model(snapshot, dtype, device, cap.attn_implementation, model_cfg.trust_remote_code)
    tokenizer = models.load_tokenizer(snapshot, model_cfg.trust_remote_code)
    results = checks.run_all(stored, model, tokenizer, cfg, device, models.eos_ids(model))
    results += reference_figures.run(stored, model, tokenizer, cfg, results, references)
    return results, source, {"device": str(device), "missing_stages": list(stored.missing)}


def main() -> None:
    params = config.read_params(Path(paths.PARAMS))
    sections(params)                                   # a bad name fails before any work
    with stage_run(STAGE, config.subset(params, PARAMS)) as run:
        results, source, facts = compute(params, run.use)
        summary = verdicts.metrics(results)["summary"]
        run.model = {k: source.get(k) for k in ("name", "kind", "revision")}
        run.facts = {**facts, **summary}
        run.write_parquet(paths.CHECKS[1], verdicts.to_table(results))
        run.write_json(paths.METRICS[1], verdicts.metrics(results))
    failed = verdicts.failed_errors(results)
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
