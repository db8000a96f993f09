"""The checks stage's whole computation, shared by `python -m stages.checks`, `nexttoken audit` and `verify`.

`compute` loads the stored artifacts (through `use`, which records each input), the stored
model and tokenizer, and runs every check; it writes nothing. `record` writes the results
into a `StageRun` (the stage, and `nexttoken verify` re-running a past run); the audit
compares them with the stored verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline.checks import reference, suite, verdicts
from pipeline.config import schema
from pipeline.model import loader
from pipeline.store import paths, provenance
from pipeline.store.artifacts import StageRun, read_json

SECTIONS = ("model", "prompt", "capture", "probs", "sampling", "checks")


def sections(params: dict, root: Path | str = ".") -> tuple[dict, list]:
    """The typed config sections and the applicable reference figures: a bad value fails here,
    before any work."""
    cfg = {name: schema.load_section(params, name, root) for name in SECTIONS}
    m = cfg["model"]
    return cfg, reference.applicable(m.reference_figures, m.tokenizer.family, cfg["prompt"].text)


def compute(params: dict, use: Callable[..., Path], root: Path | str = ".") \
        -> tuple[list[verdicts.Check], dict, dict]:
    """Every check on the run in `root` -> (results, source.json, facts), written nowhere.

    `use(item, prompt_id=None)` resolves an input item (StageRun.use records it; `nexttoken audit`
    passes `paths.lookup` to re-run a past run's checks with these same calls). Every prompt of the
    run (its tokenize partitions) is checked in turn; one model load.
    """
    cfg, references = sections(params, root)
    cap, model_cfg = cfg["capture"], cfg["model"]
    device, dtype = loader.resolve_device(cap.device), loader.resolve_dtype(cap.dtype)
    if cfg["prompt"].file is not None:
        use(Path(cfg["prompt"].file))                  # its sha256 goes into the manifest, as tokenize's
    source = read_json(use(paths.SOURCE))
    snapshot = loader.snapshot_dir(use(paths.stage_dir("prepare_model")), source)
    model = loader.load_model(snapshot, dtype, device, cap.attn_implementation, model_cfg.trust_remote_code,
                              spread=loader.spread(cap.device, snapshot, dtype))
    tokenizer = loader.load_tokenizer(snapshot, model_cfg.trust_remote_code)
    results, missing, prompt_ids = [], [], paths.run_prompt_ids(root)
    if not prompt_ids:
        use(paths.dataset(paths.TOKENS))               # missing: one line naming it
    for pid in prompt_ids:                             # the model loads once for the set
        stored = suite.load(use, root, pid)
        mine = suite.run_all(stored, model, tokenizer, cfg, device, loader.eos_ids(model), snapshot / "tokenizer.json")
        results += mine + reference.run(stored, model, tokenizer, cfg, mine, references)
        missing += [s for s in stored.missing if s not in missing]
    return results, source, {**loader.device_record(model, device), "missing_stages": missing}


def record(stage: StageRun, params: dict) -> list[verdicts.Check]:
    """Run every check on the run in stage.root and write checks.parquet + metrics.json into `stage`."""
    results, source, facts = compute(params, stage.use, stage.root)
    stage.model = provenance.model_record(source)
    stage.facts = {**facts, **verdicts.summary(results)}
    stage.write_parquet(paths.CHECKS[1], verdicts.to_table(results))
    stage.write_json(paths.METRICS[1], verdicts.metrics(results))
    return results


def summary_text(results: list[verdicts.Check]) -> str:
    """The counts, then one line per failing check (what the stage prints)."""
    s = verdicts.summary(results)
    return (f"{s['checks']} checks: {s['passed']} pass, {s['failed_error']} error and "
            f"{s['failed_report']} report checks fail"
            + "".join(f"\n  {c.verdict} ({c.severity}) {c.name}: {c.measured:g} > {c.tolerance:g}  {c.detail}"
                      for c in results if not c.passed))
