"""The checks stage's whole computation, shared by `python -m stages.checks`, `nexttoken audit` and `verify`.

`compute` loads the stored artifacts (through `use`, which records each input), the stored
model and tokenizer, and runs every check; it writes nothing. `record` writes the results
into a `StageRun` (the stage, and `nexttoken verify` re-running a past run); the audit
compares them with the stored verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path

from pipeline.checks import lens, reference, suite, verdicts
from pipeline.config import prompt_set, schema
from pipeline.model import loader
from pipeline.store import paths, provenance
from pipeline.store.artifacts import StageRun, read_json

SECTIONS = ("model", "prompt", "capture", "probs", "sampling", "checks")


def sections(params: dict, root: Path | str = ".") -> tuple[dict, prompt_set.PromptSet, dict[str, list]]:
    """The typed config sections, the run's prompts and the reference figures per prompt: a bad value
    fails here, before any work."""
    cfg = {name: schema.load_section(params, name, root) for name in SECTIONS}
    prompts = prompt_set.for_config(cfg["prompt"], root)
    return cfg, prompts, references(cfg, prompts)


def references(cfg: dict, prompts: prompt_set.PromptSet) -> dict[str, list]:
    """prompt id -> the reference figures to compare there. A reference's prompt-dependent figures
    apply to a prompt with its exact text; the others would be the same comparison once per prompt,
    so they run once: with the reference's own prompt when the set holds it, else the run's first
    prompt (ids sorted, the run's order)."""
    m = cfg["model"]
    which = {p.id: reference.applicable(m.reference_figures, m.tokenizer.family, p.text) for p in prompts.prompts}
    if len(prompts.prompts) == 1 or not m.reference_figures:
        return which
    own = [p.id for p in prompts.prompts
           if p.text == reference.load_reference(m.reference_figures)["prompt"]] or [min(prompts.ids)]
    return {pid: figures if pid == own[0] else [] for pid, figures in which.items()}


def compute(params: dict, use: Callable[..., Path], root: Path | str = ".",
            timed: Callable[[str | None], AbstractContextManager] = lambda prompt_id: nullcontext()) \
        -> tuple[list[verdicts.Check], dict, dict]:
    """Every check on the run in `root` -> (results, source.json, facts), written nowhere.

    `use(item, prompt_id=None)` resolves an input item (StageRun.use records it; `nexttoken audit`
    passes `paths.lookup` to re-run a past run's checks with these same calls). Every prompt of the
    run (its tokenize partitions) is checked in turn, inside `timed(prompt_id)` (StageRun.timed); one
    model load.
    """
    cfg, prompts, figures = sections(params, root)
    cap, model_cfg = cfg["capture"], cfg["model"]
    device, dtype = loader.resolve_device(cap.device), loader.resolve_dtype(cap.dtype)
    for given in (cfg["prompt"].file, cfg["prompt"].set):
        if given is not None:
            use(Path(given))                           # its sha256 goes into the manifest, as tokenize's
    source = read_json(use(paths.SOURCE))
    snapshot = loader.snapshot_dir(use(paths.stage_dir("prepare_model")), source)
    model = loader.load_model(snapshot, dtype, device, cap.attn_implementation, model_cfg.trust_remote_code,
                              spread=loader.spread(cap.device, snapshot, dtype))
    tokenizer = loader.load_tokenizer(snapshot, model_cfg.trust_remote_code)
    results, missing, prompt_ids = [], [], paths.run_prompt_ids(root)
    if not prompt_ids:
        use(paths.dataset(paths.TOKENS))               # missing: one line naming it
    for pid in prompt_ids:                             # the model loads once for the set
        with timed(pid):
            stored, here = suite.load(use, root, pid), {**cfg, "prompt": _record(prompts, pid)}
            mine = suite.run_all(stored, model, tokenizer, here, device, loader.eos_ids(model),
                                 snapshot / "tokenizer.json")
            mine += lens.run(stored, model, snapshot, cap.dtype)
            mine += reference.run(stored, model, tokenizer, here, mine, figures[here["prompt"].id])
        results += [replace(c, prompt_id=pid) for c in mine]
        missing += [s for s in stored.missing if s not in missing]
    return results, source, {**loader.device_record(model, device), "missing_stages": missing}


def _record(prompts: prompt_set.PromptSet, prompt_id: str) -> prompt_set.PromptRecord:
    """The configured prompt a partition holds: a run of one prompt holds that one; in a set, the
    record with that id."""
    return prompts.prompts[0] if len(prompts.prompts) == 1 else prompts.get(prompt_id)


def record(stage: StageRun, params: dict) -> list[verdicts.Check]:
    """Run every check on the run in stage.root and write checks.parquet + metrics.json into `stage`."""
    results, source, facts = compute(params, stage.use, stage.root, stage.timed)
    stage.model = provenance.model_record(source)
    stage.facts = {**facts, **verdicts.summary(results)}
    stage.write_parquet(paths.CHECKS[1], verdicts.to_table(results))
    stage.write_json(paths.METRICS[1], verdicts.metrics(results))
    return results


def summary_text(results: list[verdicts.Check]) -> str:
    """The counts, then one line per failing check (what the stage prints)."""
    s, n = verdicts.summary(results), len({c.prompt_id for c in results})
    return (f"{s['checks']} checks" + (f" over {n} prompts" if n > 1 else "") + f": {s['passed']} pass, "
            f"{s['failed_error']} error and {s['failed_report']} report checks fail"
            + "".join(f"\n  {c.verdict} ({c.severity}) {c.name}" + (f" [{c.prompt_id}]" if n > 1 else "")
                      + f": {c.measured:g} > {c.tolerance:g}  {c.detail}" for c in results if not c.passed))
