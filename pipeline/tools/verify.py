"""`nexttoken verify [--rev REV] [--stages ...]`: re-run a past run on this machine and compare bit for bit.

The run (the workspace, a commit or an experiment) is read as `nexttoken audit --rev` reads
it (`pipeline.tools.revisions`: git + the local DVC cache, nothing checked out). Its
forward, logits, probs, trajectories, lens and checks stages run again, from its recorded config
and its model snapshot, in a temporary folder: each stage's own recording (`record` of
`pipeline.record.forward`, `.logits`, `.probs`, `.trajectories`, `.lens`, `.checks`), in this
process, with one model load, under the run's
`capture.kernels` (pinned before torch loads). Nothing in the workspace or the DVC cache
changes.

One line per artifact, `identical` or `differs`; when anything differs, one line each: the
kernel path then vs now, the first diverging captured tensor in forward order (max |Δ| and
where), the top-1 id per position, the kept counts per filter, the first trajectory step
whose chosen id differs (both candidates and their probabilities), the checks whose result
changed. Exit 0 when every artifact is bit-identical, 1 when anything differs, 2 on bad input.
A run of another `format_version` is refused in one line (`revisions.load_manifests`): its files are
laid out as other code laid them out, so that code verifies it (check out the commit that made it).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline import kernels, progress
from pipeline.checks import verdicts
from pipeline.config import schema
from pipeline.errors import UserError, bad_value
from pipeline.numerics.divergence import (
    capture_order,
    divergence_line,
    first_diverging_tensor,
    kernel_difference_line,
    prompt_kernel_lines,
    recorded_kernels,
    top1_line,
)
from pipeline.store import paths, provenance
from pipeline.store.artifacts import (
    read_json,
    read_manifest,
    read_parquet,
    read_safetensors,
    stage_run,
    tables_stored,
)
from pipeline.tools import revisions
from pipeline.tools.rundiff import kept_lines_from, runs_from_table, table_difference, trajectory_lines_from

RERUN = ("forward", "logits", "probs", "trajectories", "lens", "checks")      # in dvc.yaml's order
READS = {"forward": (), "logits": ("forward",), "probs": ("logits",), "trajectories": (), "lens": ("forward",),
         "checks": ("forward", "logits", "probs", "trajectories", "lens")}     # which re-run stages each one reads
LABELS = ("then", "now")


@dataclass
class Verification:
    label: str
    lines: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.differing


def cli(args) -> int:
    """The lines on stdout; 0 identical, 1 when anything differs."""
    progress.quiet_off_terminal()
    result = verify(Path.cwd(), args.rev, args.stages)
    print("\n".join(result.lines))
    return 0 if result.identical else 1


def selected(stages: list[str] | None) -> list[str]:
    """The stages to re-run, in order: the named ones and any between them (so each re-run stage
    reads what this machine computed); all of RERUN by default."""
    chosen = set(stages or RERUN)
    for s in chosen:
        if s not in RERUN:
            raise bad_value("--stages", s, "stages that compute: " + ", ".join(RERUN))

    def upstream(s: str) -> set[str]:
        return {u for r in READS[s] for u in {r} | upstream(r)}
    chosen |= {m for m in RERUN if any(m in upstream(s) for s in chosen) and upstream(m) & chosen}
    return [s for s in RERUN if s in chosen]


def verify(repo: Path, rev: str | None = None, stages: list[str] | None = None) -> Verification:
    wanted = selected(stages)
    revision = revisions.resolve(repo, rev or revisions.WORKSPACE)
    with revisions.open_run(repo, revision) as root:
        return verify_folder(root, str(revision), wanted)


def verify_folder(root: Path, label: str, wanted: list[str]) -> Verification:
    """Re-run `wanted` for the run laid out in `root` and compare; bad input before any work."""
    manifests = revisions.load_manifests(root)
    params = schema.read_params(root / paths.PARAMS)
    cap = schema.load_section(params, "capture", root)
    _snapshot(root, manifests)
    rerun = [s for s in wanted if s in manifests]
    if not rerun:
        raise UserError(f"{label} has none of the stages to re-run ({', '.join(wanted)}): run `dvc repro` first")
    kernels.pin(cap.kernels)          # before torch loads: the stage code below imports it
    result = Verification(label, [f"verify {label}: re-running {', '.join(rerun)} here "
                                  f"(capture.kernels={cap.kernels})"])
    with tempfile.TemporaryDirectory(prefix="nexttoken-verify-") as tmp:
        here = Path(tmp)
        _mirror(root, here, rerun)
        _rerun(here, params, {s: manifests[s].get("config") or {} for s in rerun})
        now = revisions.load_manifests(here)
        result.lines.append(kernel_difference_line(recorded_kernels(manifests), recorded_kernels(now), LABELS))
        result.lines += prompt_kernel_lines(manifests, recorded_kernels(now))
        for stage in rerun:
            for name, same in _compare_files(root, here, stage):
                result.lines.append(f"{'identical' if same else 'differs  '} {stage}/{name}")
                if not same:
                    result.differing.append(f"{stage}/{name}")
        if result.differing:
            result.lines += explain(root, here, {d.split("/")[0] for d in result.differing})
    verdict = "IDENTICAL: every re-run artifact is bit-identical" if result.identical else \
        f"DIFFERS: {len(result.differing)} artifact(s) differ"
    result.lines.append(f"verdict: {verdict}")
    return result


def _snapshot(root: Path, manifests: dict[str, dict]) -> None:
    """The run's model snapshot must be here: verify re-runs from it, never re-prepares it."""
    source_file = paths.artifact(paths.SOURCE, root)
    if "prepare_model" not in manifests or not source_file.exists():
        raise UserError(f"the run's model snapshot is missing ({paths.artifact(paths.SOURCE).as_posix()}): "
                        "restore it with `dvc pull` or `dvc repro prepare_model`")
    source = read_json(source_file)
    where = Path(source["snapshot_dir"]) if source.get("snapshot_dir") else source_file.parent
    if not any(where.glob("*.safetensors")):
        raise UserError(f"the run's model snapshot {where} holds no weights (*.safetensors): "
                        "restore it with `dvc pull` or `dvc repro prepare_model`")


def _mirror(root: Path, here: Path, rerun: list[str]) -> None:
    """`here` laid out like the run: its params and prompts, its other stage folders as links."""
    (here / paths.PARAMS).write_bytes((root / paths.PARAMS).read_bytes())
    if (root / schema.PROMPT_DIR).is_dir():
        (here / schema.PROMPT_DIR).symlink_to((root / schema.PROMPT_DIR).resolve(), target_is_directory=True)
    for stage in paths.STAGES:
        stored = paths.stage_dir(stage, root)
        if stage not in rerun and stored.is_dir():
            link = paths.stage_dir(stage, here)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(stored.resolve(), target_is_directory=True)


def _rerun(here: Path, params: dict, configs: dict[str, dict]) -> None:
    """Each stage's own function, in order, writing its folder under `here` (one model load)."""
    from pipeline.model import loader
    from pipeline.model.forward import plan
    from pipeline.record import checks, forward, lens, logits, probs, trajectories

    def section(name: str):
        return schema.load_section(params, name, here)
    body = {
        "forward": lambda run: forward.record(run, plan(section("capture"), paths.stage_dir(
            "prepare_model", here)), section("model").trust_remote_code),
        "logits": logits.record,
        "probs": lambda run: probs.record(run, section("probs"), section("sampling")),
        "trajectories": lambda run: trajectories.record(run, section("model"), section("capture"),
                                                        section("sampling")),
        "lens": lambda run: lens.record(run, section("model"), section("capture"), section("lens")),
        "checks": lambda run: checks.record(run, params),
    }
    with loader.shared_loads():
        for stage in progress.bar(list(configs), len(configs), "verify", "stage"):
            with stage_run(stage, configs[stage], here) as run:     # the config the run recorded
                body[stage](run)


def _compare_files(root: Path, here: Path, stage: str) -> list[tuple[str, bool]]:
    """(file name, bit-identical) for every output the stage's manifest lists, stored or re-made
    (what DVC adds beside them, such as a .gitignore, is not the stage's). Both runs are of one
    format_version, so a file only one of them holds is a difference."""
    def files(r: Path) -> dict[str, Path]:
        outputs = read_manifest(stage, r)["outputs"]
        return {Path(o["path"]).relative_to(paths.stage_dir(stage)).as_posix(): r / o["path"] for o in outputs}

    def compare(name: str) -> bool:
        if name not in stored or name not in made or not stored[name].is_file():
            return False
        return _content(stored[name]) == _content(made[name])
    stored, made = files(root), files(here)
    return [(name, compare(name)) for name in sorted(set(stored) | set(made))]


def _content(path: Path) -> str:
    """What identical means: the tensors / table content (metadata aside), else the bytes."""
    return provenance.logical_hash(path) or provenance.sha256_file(path)


# ---------------------------------------------------------------- explaining a difference
def explain(root: Path, here: Path, differing: set[str]) -> list[str]:
    """One line per finding in the stages whose artifacts differ, in the pipeline's order, per prompt."""
    out: list[str] = []
    for pid in paths.run_prompt_ids(root):
        out += [f"prompt {pid}:"] if len(paths.run_prompt_ids(root)) > 1 else []
        if differing & {"forward", "logits"}:
            out += capture_lines(root, here, pid)
        if "probs" in differing:
            out += probs_lines(root, here, pid)
        if "trajectories" in differing:
            out += table_lines(root, here, (paths.STEPS, paths.STEP_LOGITS), pid)
            out += trajectory_lines_from(*(runs_from_table(read_parquet(paths.partition(paths.STEPS, pid, r)))
                                           for r in (root, here)), LABELS)
    if "checks" in differing:
        out += checks_lines(root, here)
    return out


def capture_lines(root: Path, here: Path, pid: str) -> list[str]:
    """The first diverging captured tensor, then the top-1 id per position of the logits."""
    stored, made = (read_safetensors(paths.partition(paths.CAPTURE, pid, r)) for r in (root, here))
    facts = read_json(paths.partition(paths.FORWARD_FACTS, pid, root))
    order = capture_order(paths.partition(paths.CAPTURE, pid, root))
    d = first_diverging_tensor(stored, made, order, facts.get("n_positions"))
    lines = [divergence_line(d, len(stored), LABELS)]
    if "logits" in stored and "logits" in made:
        lines.append(top1_line(stored["logits"][0], made["logits"][0], facts.get("logit_positions") or [], LABELS))
    return lines


def table_lines(root: Path, here: Path, items: tuple[tuple[str, str], ...], pid: str) -> list[str]:
    """Per table that differs, its first differing value (then vs now)."""
    out = []
    for item in items:
        files = [paths.lookup(r)(item, pid) for r in (root, here)]
        derived = [item in (paths.TABLE, paths.FILTERED) and not _table_stored(r) or
                   item == paths.STEP_LOGITS and not _step_logits_stored(r, pid) for r in (root, here)]
        if missing := [label for label, f, d in zip(LABELS, files, derived) if not d and not f.is_file()]:
            out.append(f"{item[0]} {item[1]}: not there {' and '.join(missing)}")
            continue
        if item == paths.STEP_LOGITS and any(derived):      # not stored: the rows' recorded sha256 tell
            diff = step_hashes_difference(*(read_json(paths.partition(paths.TRAJECTORIES, pid, r))
                                            for r in (root, here)))
        elif item == paths.STEP_LOGITS:
            diff = step_logits_difference(*files)
        else:
            diff = table_difference(*(_table(r, item, pid, d) for r, d in zip((root, here), derived)))
        if diff:
            out.append(f"{item[0]} {item[1]}: " + diff.replace("stored", "then").replace("re-derived", "now"))
    return out


def _step_logits_stored(root: Path, pid: str) -> bool:
    from pipeline.model.trajectories import step_logits_stored
    return step_logits_stored(paths.partition(paths.STEPS, pid, root))


def step_hashes_difference(a: dict, b: dict) -> str | None:
    """The first step whose logits row's recorded sha256 (trajectories.json, `logits_io.row_sha256`) differs
    between two runs, where a run did not store the rows (`sampling.step_logits`); None when all agree."""
    for name in sorted(a.keys() | b.keys()):
        ha, hb = ((x.get(name) or {}).get("step_logits_sha256") or [] for x in (a, b))
        step = next((i + 1 for i in range(max(len(ha), len(hb)))
                     if i >= min(len(ha), len(hb)) or ha[i] != hb[i]), 0)
        if step:
            then, now = (h[step - 1][:12] if step <= len(h) else "-" for h in (ha, hb))
            return f"{name} step {step}: the row's sha256 differs (then {then}, now {now}; a run that does not " \
                   "keep the rows: sampling.step_logits)"
    return None


def _table_stored(root: Path) -> bool:
    return tables_stored(read_manifest(paths.TABLE[0], root))


def _table(root: Path, item: tuple[str, str], pid: str, derived: bool):
    """A table file of the run, or table.parquet re-derived where the run derives it (`probs.read_table`)."""
    if not derived:
        return read_parquet(paths.lookup(root)(item, pid))
    from pipeline.numerics import probs  # torch: only where a table is derived
    return probs.read_table(paths.lookup(root), pid, read_manifest(paths.TABLE[0], root), item)


def step_logits_difference(a: Path, b: Path) -> str | None:
    """None when two step logits files hold the same steps with the same values bit for bit (decoded:
    `logits_io.read_step_logits`), else the first difference (then vs now)."""
    from pipeline.store import logits_io
    ra, rb = logits_io.read_step_logits(a), logits_io.read_step_logits(b)
    if [(k, p) for k, p, _ in ra] != [(k, p) for k, p, _ in rb]:
        return f"{len(ra)} steps then, {len(rb)} now, or other keys"
    for (key, _, x), (_, _, y) in zip(ra, rb):
        if x.shape != y.shape:
            return f"{key}: {x.size} logits then, {y.size} now"
        bad = np.flatnonzero(x.view(np.uint32) != y.view(np.uint32))
        if bad.size:
            i = int(bad[0])
            return (f"{bad.size} value(s) differ at branch={key['branch']} kv_cache={key['kv_cache']} "
                    f"step={key['step']}; first at token_id={i}: then {x[i].item()!r}, now {y[i].item()!r}")
    return None


def probs_lines(root: Path, here: Path, pid: str) -> list[str]:
    """The first value that differs in each table, and the kept counts per filter."""
    summaries = [json.loads(paths.partition(paths.PROBS_SUMMARY, pid, r).read_text(encoding="utf-8"))["filters"]
                 for r in (root, here)]
    return table_lines(root, here, (paths.TABLE, paths.FILTERED, paths.PROBS_PROMPT_METRICS), pid) \
        + kept_lines_from(*summaries, LABELS)


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def checks_lines(root: Path, here: Path) -> list[str]:
    """Each check whose verdict or measured value changed (per prompt, by name)."""
    then, now = (verdicts.stored_rows(read_parquet(paths.artifact(paths.CHECKS, r)))
                 for r in (root, here))
    fields = ("verdict", "measured", "tolerance", "severity", "what", "detail")
    changed = [k for k in sorted(set(then) | set(now))
               if k not in then or k not in now or any(not _same(then[k][f], now[k][f]) for f in fields)]

    def show(r: dict | None) -> str:
        return "absent" if r is None else f"{r['verdict']} (measured {r['measured']:.6g})"
    return [f"check {k[1]}" + (f" (prompt {k[0]})" if k[0] else "") + f": then {show(then.get(k))} | now "
            f"{show(now.get(k))}" for k in changed] or ["checks: same verdicts and measured values"]
