"""`nexttoken audit`: re-verify a run as an auditor would, from its files alone.

Findings (one line each; any finding makes the verdict FAIL, exit 1): an output whose bytes
no longer match its manifest; an input that is not what its producing stage wrote (a broken
chain); dvc.lock disagreeing with the files or params; a recorded config that is not
params.yaml's; a stored table, filtered set, summary, set file or check verdict that the same
code does not re-derive, bit for bit, from the stored files it was computed from
(`pipeline.tools.rederived`: probs' files from the logits, trajectories' set files from each
prompt's continuations). Warnings never fail an audit: the
auditing machine's versions or hardware differ from the recorded ones, the code that
re-derives differs from the code that ran, its kernel path differs from the run's (one line
naming the fields: the probability tables and the checks depend on the CPU kernels), or a
kernel-bound check (a recomputation compared bit for bit) comes out otherwise here because
this machine computes on another device or GPU model than the run did (that check is then a
report, saying so: `suite.kernel_bound`). The re-derivation runs under the run's
`capture.kernels`, pinned before torch loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import kernels, progress
from pipeline.checks import verdicts
from pipeline.config import schema
from pipeline.config.registry import diff_keys
from pipeline.errors import UserError
from pipeline.model import sources
from pipeline.numerics.divergence import kernel_difference_line, recorded_kernels
from pipeline.store import graph, paths, provenance
from pipeline.store.artifacts import parquet_facts, read_parquet
from pipeline.tools import rederived, revisions


@dataclass
class Audit:
    """What one audit found: findings fail it, warnings and notes are information."""

    label: str
    findings: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def find(self, area: str, what: str) -> None:
        self.findings.append(f"FINDING [{area}] {what}")

    def warn(self, what: str) -> None:
        self.warnings.append(f"WARN {what}")

    @property
    def clean(self) -> bool:
        return not self.findings

    def lines(self) -> list[str]:
        verdict = "CLEAN" if self.clean else f"FAIL ({len(self.findings)} finding(s))"
        return [f"audit of {self.label}", *self.notes, *self.warnings, *self.findings,
                f"verdict: {verdict}, {len(self.warnings)} warning(s)"]


# ---------------------------------------------------------------- entry point
def audit(repo: Path, rev: str | None = None) -> Audit:
    """Audit the workspace (rev None) or a past commit / experiment, read from git + the DVC cache."""
    revision = revisions.resolve(repo, rev or revisions.WORKSPACE)
    with revisions.open_run(repo, revision) as root:
        return audit_folder(root, str(revision))


def cli(args) -> int:
    """`nexttoken audit [--rev REV]`: the report on stdout; 0 clean, 1 on any finding."""
    progress.quiet_off_terminal()   # no progress bars from model loading in logs (as stage_main)
    result = audit(Path.cwd(), args.rev)
    print("\n".join(result.lines()))
    return 0 if result.clean else 1


def audit_folder(root: Path, label: str) -> Audit:
    """Every check on a run laid out like the workspace in `root`."""
    result = Audit(label)
    manifests = revisions.load_manifests(root)
    params = schema.read_params(root / paths.PARAMS)
    for stage in [s for s in revisions.dvc_stages(root) or [] if s in paths.STAGES and s not in manifests]:
        result.find("stages", f"{stage} is in dvc.yaml but has no manifest (not run, or deleted)")
    outputs = verify_outputs(root, manifests, result)
    verify_chain(root, manifests, outputs, result)
    verify_model_files(root, manifests, result)
    verify_config(params, manifests, result)
    lock = revisions.read_lock(root)
    same_code = False                # unknown without dvc.lock
    if lock is None:
        result.notes.append("no dvc.lock here: the DVC record was not compared")
    else:
        verify_lock(root, lock, manifests, revisions.read_params_as_dvc(root), result)
        same_code = not code_changes(lock, result)
    pin_recorded(params, result)
    if "probs" in manifests:
        rederived.rederive_probs(root, params, manifests["probs"], result, same_code)
    if "trajectories" in manifests:
        rederived.rederive_trajectories(root, manifests["trajectories"], result, same_code)
    if "checks" in manifests:
        rederive_checks(root, params, result)
    environment(manifests, result)
    kernel_path(manifests, result)
    return result


# ---------------------------------------------------------------- files and chain
def verify_outputs(root: Path, manifests: dict[str, dict], result: Audit) -> dict[str, str]:
    """Each recorded output's sha256 (and logical hash) against its file; path -> recorded sha256."""
    recorded: dict[str, str] = {}
    n = 0
    for stage, m in manifests.items():
        if m.get("config_sha256") != provenance.sha256_json(m.get("config")):
            result.find("manifest", f"{stage}/manifest.json: config_sha256 does not match its config (edited?)")
        for out in m["outputs"]:
            n += 1
            path, rec = root / out["path"], out["sha256"]
            recorded[out["path"]] = rec
            if not path.is_file():
                result.find("hashes", f"{out['path']}: missing (recorded by {stage})")
                continue
            got = provenance.sha256_file(path)
            if got != rec:
                result.find("hashes", f"{out['path']}: sha256 {got[:12]} != recorded {rec[:12]} (file changed)")
                continue
            _logical(path, out, m, result)
    result.notes.append(f"checked {n} outputs of {len(manifests)} stages ({', '.join(manifests)})")
    return recorded


def _logical(path: Path, out: dict, manifest: dict, result: Audit) -> None:
    """The logical hash, and a Parquet file's own record of which run wrote it."""
    if provenance.logical_matches(path, out) is False:
        result.find("hashes", f"{out['path']}: logical content hash != recorded")
    if path.suffix == ".parquet":
        written_by = parquet_facts(path).get("config_sha256")
        if written_by is not None and written_by != manifest.get("config_sha256"):
            recorded = str(manifest.get("config_sha256"))[:12]
            result.find("provenance", f"{out['path']}: written by a run with config {written_by[:12]}, "
                                      f"but {manifest['stage']} recorded config {recorded}")


def verify_chain(root: Path, manifests: dict[str, dict], outputs: dict[str, str], result: Audit) -> None:
    """Every input's sha256 must be what the producing stage recorded as its output.

    A stage may read another stage's manifest (the report does): that file is the record,
    not one of the recorded outputs, so its own bytes are what the reader must have seen.
    A file of the repository (a prompt file) has no producer: it must still be the file the
    stage read (for a revision, the file committed there).
    """
    recorded = {**outputs, **{paths.manifest_path(s).as_posix(): provenance.sha256_file(paths.manifest_path(s, root))
                              for s in manifests}}
    n = 0
    for stage, m in manifests.items():
        for inp in m.get("inputs", []):
            n += 1
            producer = _producer(inp["path"])
            if producer is None:
                _repository_input(root, stage, inp, result)
            elif producer not in manifests:
                result.find("chain", f"{stage} read {inp['path']}, but {producer} has no manifest")
            elif inp["path"] not in recorded:
                result.find("chain", f"{stage} read {inp['path']}, which {producer} did not record as an output")
            elif recorded[inp["path"]] != inp["sha256"]:
                result.find("chain", f"{stage} read {inp['path']} with sha256 {inp['sha256'][:12]}, but {producer} "
                                     f"recorded {recorded[inp['path']][:12]}: not the same run's artifact")
    result.notes.append(f"checked {n} recorded inputs against their producers")


def verify_model_files(root: Path, manifests: dict[str, dict], result: Audit) -> None:
    """The model files prepare_model read, hashed again now: a model used in place (model=local, or the HF
    cache), each changed, missing or new file named; a GGUF (a file, a package's, an Ollama blob), found again
    as prepare_model found it."""
    source = paths.stage_dir(paths.SOURCE[0], root) / paths.SOURCE[1]
    if "prepare_model" not in manifests or not source.is_file():
        return
    for line in sources.changed_files(json.loads(source.read_text()), root):
        result.find("model", line)


def _producer(path: str) -> str | None:
    """The stage whose folder holds `path`; None for a file of the repository (not under artifacts/)."""
    parts = Path(path).parts
    if parts[:1] != (paths.ARTIFACTS,):
        return None
    return parts[1] if len(parts) > 2 else "?"


def _repository_input(root: Path, stage: str, inp: dict, result: Audit) -> None:
    path = root / inp["path"]
    if Path(inp["path"]).is_absolute() or ".." in Path(inp["path"]).parts:   # a tampered record: read nothing
        result.find("chain", f"{stage} records an input outside the repository: {inp['path']}")
        return
    if not path.is_file():
        result.find("chain", f"{stage} read {inp['path']}, which is not there now")
        return
    now = provenance.sha256_file(path)
    if now != inp["sha256"]:
        result.find("chain", f"{stage} read {inp['path']} with sha256 {inp['sha256'][:12]}, the file has "
                             f"{now[:12]} now (edited after the run)")


def verify_config(params: dict, manifests: dict[str, dict], result: Audit) -> None:
    """The recorded config = the params.yaml subset the stage reads (`graph.PARAMS`)."""
    for stage, m in manifests.items():
        if stage not in graph.PARAMS:
            result.warn(f"config of {stage} not checked: this code has no stage {stage}")
            continue
        try:
            expected = schema.subset(params, graph.PARAMS[stage])
        except UserError as e:
            result.find("config", f"{stage}: {e}")
            continue
        for key in diff_keys(expected, m.get("config")):
            was, has = revisions.dotted(m.get("config"), key), revisions.dotted(expected, key)
            result.find("config", f"{stage}: {key} recorded {was!r}, params.yaml has {has!r}")
    result.notes.append("compared recorded configs with params.yaml")


# ---------------------------------------------------------------- dvc.lock
def verify_lock(root: Path, lock: dict, manifests: dict[str, dict], params: dict, result: Audit) -> None:
    """DVC's record: its out md5s match the files, artifact deps match their producer, params match.

    `params`: params.yaml as DVC parses it (YAML 1.2), the way it wrote the values in dvc.lock.
    """
    md5s: dict[str, str] = {}

    def md5_of(rel: str) -> str | None:
        if rel not in md5s:
            p = root / rel
            md5s[rel] = revisions.md5_file(p) if p.is_file() else \
                revisions.dir_md5(revisions.dir_listing(p)) if p.is_dir() else None
        return md5s[rel]

    stages = lock["stages"]
    for stage in manifests:
        if stage not in stages:
            result.find("dvc.lock", f"{stage} has a manifest but no entry in dvc.lock")
            continue
        entry = stages[stage]
        for out in entry.get("outs", []):
            got = md5_of(out["path"])
            if got != out.get("md5"):
                result.find("dvc.lock", f"{stage} out {out['path']}: md5 {got} != dvc.lock {out.get('md5')}")
        covered = [o["path"] for o in entry.get("outs", [])]   # DVC 3 lists metrics files among outs
        for out in manifests[stage]["outputs"]:
            if not any(out["path"] == c or out["path"].startswith(c + "/") for c in covered):
                result.find("dvc.lock", f"{out['path']} ({stage}) is not a DVC output of {stage}")
        for dep in entry.get("deps", []):
            if dep["path"].startswith(paths.ARTIFACTS + "/") and md5_of(dep["path"]) != dep.get("md5"):
                result.find("dvc.lock", f"{stage} dep {dep['path']}: dvc.lock md5 {dep.get('md5')} "
                                        f"!= the file's {md5_of(dep['path'])}")
        for key, value in (entry.get("params") or {}).get(paths.PARAMS, {}).items():
            here = revisions.dotted(params, key)
            if here != value:
                result.find("dvc.lock", f"{stage} param {key}={value!r} but params.yaml has {here!r}")
    result.notes.append(f"compared dvc.lock ({len(stages)} stages) with the files and params.yaml")


def code_changes(lock: dict, result: Audit) -> list[str]:
    """Warn when the code that re-derives here is not the code the run recorded in dvc.lock; the
    code files that differ."""
    code_root = Path(__file__).resolve().parents[2]   # where this pipeline/ and stages/ are imported from
    changed = sorted({d["path"] for e in lock["stages"].values() for d in e.get("deps", [])
                      if d["path"].endswith(".py") and (code_root / d["path"]).is_file()
                      and revisions.md5_file(code_root / d["path"]) != d.get("md5")})
    if changed:
        result.warn(f"the code here differs from the run's ({', '.join(changed)}): "
                    f"re-derivation uses the code here")
    return changed


# ---------------------------------------------------------------- re-derivation
def rederive_checks(root: Path, params: dict, result: Audit) -> None:
    """Run the checks again from the stored artifacts; every verdict must be the stored one."""
    try:
        derived = checks_verdicts(root, params)
    except Exception as e:   # as above: a run whose checks cannot be re-run is not clean
        result.find("re-derive", f"checks could not be recomputed: {type(e).__name__}: {e}")
        return
    try:
        stored_t = read_parquet(paths.artifact(paths.CHECKS, root))
    except UserError as e:
        result.find("re-derive", str(e))
        return
    stored = {k: r["verdict"] for k, r in verdicts.stored_rows(stored_t).items()}
    for key in sorted(set(stored) | set(derived)):
        got, want = derived.get(key, ("<absent>", None, "")), stored.get(key, "<absent>")
        if got[0] == want:
            continue
        what = f"{paths.CHECKS[1]}: check {_check_name(key)} stored {want}, re-derived {got[0]} (measured {got[1]})"
        if got[2]:    # kernel-bound, and this machine computes on another device: a finding would be noise
            result.warn(f"{what}: {got[2]}")
        else:
            result.find("re-derive", what)
    result.notes.append(f"re-ran {len(derived)} checks from the stored artifacts")
    if bound := sorted(key for key, (_, _, note) in derived.items() if note):
        result.notes.append(f"{len(bound)} kernel-bound checks are reports here ({derived[bound[0]][2]}): "
                            + ", ".join(dict.fromkeys(name for _, name in bound)))


def _check_name(key: tuple[str, str]) -> str:
    """`name`, or `name (prompt id)` for a check of a run's prompt."""
    return f"{key[1]} (prompt {key[0]})" if key[0] else key[1]


def checks_verdicts(root: Path, params: dict) -> dict[tuple[str, str], tuple[str, float, str]]:
    """(prompt_id, name) -> (verdict, measured, device note), computed by the checks stage's own function."""
    from pipeline.checks import stage  # torch and the model load only when re-deriving the checks
    results, _, _ = stage.compute(params, paths.lookup(root), root)
    return {(c.prompt_id, c.name): (c.verdict, c.measured, c.device_note) for c in results}


# ---------------------------------------------------------------- environment
def environment(manifests: dict[str, dict], result: Audit) -> None:
    """Print what the run recorded; warn where this machine differs (a warning, never a finding)."""
    recorded = revisions.recorded_environment(manifests)
    here = {**{f"libraries.{k}": v for k, v in provenance.library_versions().items()},
            **{f"hardware.{k}": v for k, v in provenance.hardware().items() if k in revisions.HARDWARE_KEYS}}
    for section in ("libraries", "hardware"):
        shown = ", ".join(f"{k.split('.', 1)[1]}={'|'.join(map(str, v))}" for k, v in recorded.items()
                          if k.startswith(section + "."))
        result.notes.append(f"recorded {section}: {shown}")
    for key, values in recorded.items():
        if len(values) > 1:
            result.warn(f"{key}: the stages recorded different values {values}")
        elif key in here and here[key] != values[0]:
            result.warn(f"{key}: recorded {values[0]!r}, auditing machine has {here[key]!r}")


def pin_recorded(params: dict, result: Audit) -> None:
    """Re-derive under the run's capture.kernels; where that cannot be pinned here, say so (a warning)."""
    mode = (params.get("capture") or {}).get("kernels", "native") if isinstance(params.get("capture"), dict) \
        else "native"
    try:
        kernels.pin(mode)
    except (UserError, RuntimeError) as e:
        result.warn(f"re-derivation uses this machine's native kernels: {e}")


def kernel_path(manifests: dict[str, dict], result: Audit) -> None:
    """The run's kernel path against this machine's, as its own line (a warning when they differ)."""
    recorded, here = recorded_kernels(manifests), provenance.kernel_path()
    line = kernel_difference_line(recorded, here, ("recorded", "auditing machine"))
    if recorded is None or not kernels.differences(recorded, here):
        result.notes.append(line)
    else:
        result.warn(line)
