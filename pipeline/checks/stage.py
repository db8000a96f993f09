"""The checks stage's whole computation, shared by `python -m stages.checks`, `nexttoken audit` and `verify`.

`compute` loads the stored artifacts (through `use`, which records each input), the stored
model and tokenizer (`Checker`), and runs every check; it writes nothing. The stage's recording
(`pipeline.record.checks`: the same `Checker` per prompt, here or on Ray workers, and the results
written into the run) is the stage's and `nexttoken verify`'s; the audit compares `compute`'s
results with the stored verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path

from pipeline.checks import lens, reference, suite, verdicts
from pipeline.config import prompt_set, schema
from pipeline.model import loader
from pipeline.store import paths
from pipeline.store.artifacts import read_json

SECTIONS = ("model", "prompt", "capture", "probs", "sampling", "checks")


def sections(params: dict, root: Path | str = ".") -> tuple[dict, prompt_set.PromptSet, dict[str, list]]:
    """The typed config sections, the run's prompts and the reference figures per prompt: a bad value
    fails here, before any work. `params`: the checks stage's validated config (the keys it declared,
    pipeline/store/graph.py), or a whole params.yaml (audit, verify)."""
    cfg = {name: schema.load_part(params, name, root) for name in SECTIONS}
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
           if p.text == reference.reference_prompt(m.reference_figures)] or [min(prompts.ids)]
    return {pid: figures if pid == own[0] else [] for pid, figures in which.items()}


def checked_prompts(setting: str | int, prompt_ids: list[str], figures: dict[str, list]) -> list[str]:
    """The prompts of the run the per-prompt checks run on (`checks.prompts`), in the run's order
    (`prompt_set.fixed_sample`): the prompt the reference figures are compared on (`references`) comes first."""
    return prompt_set.fixed_sample(setting, prompt_ids, [p for p in prompt_ids if figures.get(p)])


def compute(params: dict, use: Callable[..., Path], root: Path | str = ".",
            timed: Callable[[str | None], AbstractContextManager] = lambda prompt_id: nullcontext()) \
        -> tuple[list[verdicts.Check], dict, dict]:
    """Every check on the run in `root` -> (results, source.json, facts), written nowhere, in this process.

    `use(item, prompt_id=None)` resolves an input item (StageRun.use records it; `nexttoken audit`
    passes `paths.lookup` to re-run a past run's checks with these same calls). Every prompt of the
    run (its tokenize partitions) that `checked_prompts` picks is checked in turn, inside
    `timed(prompt_id)` (StageRun.timed); one model load.
    """
    source, prompt_ids = prepare(params, use, root)
    checker = Checker(params, str(Path(root).resolve()), source)
    done = []
    for pid in prompt_ids:
        with timed(pid):
            done.append(checker.run(use, pid))
    return finish(done, source, root)


def prepare(params: dict, use: Callable[..., Path], root: Path | str) -> tuple[dict, list[str]]:
    """The set-level inputs recorded and the sections validated (a bad value fails here, before any load)
    -> source.json, the prompt ids the checks run on."""
    cfg, _, figures = sections(params, root)
    for given in (cfg["prompt"].file, cfg["prompt"].set):
        if given is not None:
            use(Path(given))                           # its sha256 goes into the manifest, as tokenize's
    source = read_json(use(paths.SOURCE))
    use(paths.stage_dir("prepare_model"))
    prompt_ids = paths.run_prompt_ids(root)
    if not prompt_ids:
        use(paths.dataset(paths.TOKENS))               # missing: one line naming it
    checked = checked_prompts(cfg["checks"].prompts, prompt_ids, figures)
    return source, checked


def finish(done: list[tuple[list[verdicts.Check], list[str], dict]], source: dict, root: Path | str = ".") \
        -> tuple[list[verdicts.Check], dict, dict]:
    results, missing = [], []
    for checks, gone, _ in done:
        results += checks
        missing += [s for s in gone if s not in missing]
    device = done[0][2] if done else {}
    return results, source, {**device, "missing_stages": missing,
                             "prompts_checked": len(done), "prompts": len(paths.run_prompt_ids(root))}


class Checker:
    """One run's checks, prompt by prompt (`run` -> (its checks, the stages it found missing, the device
    record)): the sections, the model and the tokenizer load once, here; nothing is written."""

    def __init__(self, params: dict, root: str, source: dict):
        cfg, prompts, figures = sections(params, root)
        cap, model_cfg = cfg["capture"], cfg["model"]
        self.root, self._cfg, self._prompts, self._figures = root, cfg, prompts, figures
        self._device = loader.resolve_device(cap.device)
        self._snapshot = loader.snapshot_dir(paths.stage_dir("prepare_model", root), source)
        self._model = loader.load_captured(self._snapshot, cap, model_cfg.trust_remote_code)
        self._tokenizer = loader.load_tokenizer(self._snapshot, model_cfg.trust_remote_code)

    def run(self, use: Callable[..., Path], pid: str) -> tuple[list[verdicts.Check], list[str], dict]:
        """One prompt's checks; `use(item, prompt_id)` gives (and records) each input it reads."""
        cfg, model, tokenizer = self._cfg, self._model, self._tokenizer
        stored, here = suite.load(use, self.root, pid), {**cfg, "prompt": _record(self._prompts, pid)}
        mine = suite.run_all(stored, model, tokenizer, here, self._device, loader.eos_ids(model),
                             self._snapshot / "tokenizer.json")
        mine += lens.run(stored, model, self._snapshot, cfg["capture"].dtype)
        mine += reference.run(stored, model, tokenizer, here, mine, self._figures[here["prompt"].id])
        where = loader.device_record(model, self._device)
        return [replace(c, prompt_id=pid) for c in mine], list(stored.missing), where



def _record(prompts: prompt_set.PromptSet, prompt_id: str) -> prompt_set.PromptRecord:
    """The configured prompt a partition holds: a run of one prompt holds that one; in a set, the
    record with that id."""
    return prompts.prompts[0] if len(prompts.prompts) == 1 else prompts.get(prompt_id)


def summary_text(results: list[verdicts.Check]) -> str:
    """The counts, then one line per failing check (what the stage prints)."""
    s, n = verdicts.summary(results), len({c.prompt_id for c in results})
    return (f"{s['checks']} checks" + (f" over {n} prompts" if n > 1 else "") + f": {s['passed']} pass, "
            f"{s['failed_error']} error and {s['failed_report']} report checks fail"
            + "".join(f"\n  {c.verdict} ({c.severity}) {c.name}" + (f" [{c.prompt_id}]" if n > 1 else "")
                      + f": {c.measured:g} > {c.tolerance:g}  {c.detail}" for c in results if not c.passed))
