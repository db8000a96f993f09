"""The files of one run: the workspace, a past commit or a `dvc exp` experiment, never checked out.

A run is a folder laid out like the workspace: `params.yaml`, `dvc.yaml`, `dvc.lock` and
`artifacts/<stage>/...`. For the workspace that folder is the repository itself. For a git
revision or an experiment name, the three files come from `git show REV:path`, and every
output recorded in that `dvc.lock` is symlinked by its md5 from the local DVC cache
(`.dir` listings for folder outputs) into a temporary folder. Nothing in the workspace
changes and nothing is copied, so auditing a past run of a large model costs no disk.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.config import schema
from pipeline.config.registry import ABSENT, dotted  # noqa: F401  (revisions.dotted / ABSENT: the tools' names)
from pipeline.errors import UserError
from pipeline.store import paths
from pipeline.store.artifacts import read_manifest

WORKSPACE = "workspace"
DVC_YAML = "dvc.yaml"
DVC_LOCK = "dvc.lock"
RUN_FILES = (paths.PARAMS, DVC_YAML, DVC_LOCK)
# refs/exps/<baseline sha[:2]>/<baseline sha[2:]>/<name>; DVC's own bookkeeping refs
# (refs/exps/celery/..., refs/exps/exec/...) do not have this shape.
_EXP_REF = re.compile(r"^refs/exps/[0-9a-f]{2}/[0-9a-f]{38}/(?P<name>[^/]+)$")
# Hardware fields whose difference can change numbers (CPU reductions, kernels) or speed.
HARDWARE_KEYS = ("machine", "cpu_model", "cpu_cores", "torch_threads", "cuda_available", "gpus",
                 "cuda_version", "cudnn_version", "gpu_driver")


@dataclass(frozen=True)
class Revision:
    """What a user named: the workspace, a git revision, or an experiment (commit resolved)."""

    label: str
    commit: str | None = None   # None: the workspace
    exp: str | None = None      # the experiment name, when the label named one

    def __str__(self) -> str:
        if self.commit is None:
            return WORKSPACE
        short = self.commit[:7]
        return f"experiment {self.exp} ({short})" if self.exp else f"{self.label} ({short})"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=60)


def experiments(repo: Path) -> dict[str, list[str]]:
    """Experiment name -> commits, from the git refs `dvc exp` writes (no DVC call: fast)."""
    proc = _git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/exps/")
    out: dict[str, list[str]] = {}
    for line in proc.stdout.decode().splitlines() if proc.returncode == 0 else []:
        ref, _, sha = line.partition(" ")
        m = _EXP_REF.match(ref)
        if m:
            out.setdefault(m["name"], []).append(sha)
    return out


def resolve(repo: Path, rev: str) -> Revision:
    """A git revision or an experiment name as a commit; 'workspace' as the repository itself."""
    if rev == WORKSPACE:
        return Revision(rev)
    proc = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if proc.returncode == 0:
        return Revision(rev, proc.stdout.decode().strip())
    commits = experiments(repo).get(rev, [])
    if len(commits) == 1:
        return Revision(rev, commits[0], exp=rev)
    if len(commits) > 1:
        raise UserError(f"experiment name {rev!r} is ambiguous ({len(commits)} baselines): "
                        f"give its commit instead ({', '.join(c[:7] for c in commits)})")
    if _git(repo, "rev-parse", "--git-dir").returncode != 0:
        raise UserError(f"unknown revision {rev!r}: {repo} is not a git repository "
                        f"(only '{WORKSPACE}' can be read here)")
    raise UserError(f"unknown revision {rev!r}: neither a git revision nor an experiment name "
                    f"(see `git log`, `dvc exp show`)")


def git_files_under(repo: Path, commit: str, folder: str) -> tuple[str, ...]:
    """The files committed under `folder` at `commit` (none when it has no such folder)."""
    proc = _git(repo, "ls-tree", "-r", "--name-only", commit, "--", folder)
    return tuple(proc.stdout.decode().splitlines()) if proc.returncode == 0 else ()


def git_file(repo: Path, commit: str, path: str) -> bytes | None:
    proc = _git(repo, "show", f"{commit}:{path}")
    return proc.stdout if proc.returncode == 0 else None


# ---------------------------------------------------------------- DVC hashes and cache
def md5_file(path: Path) -> str:
    """DVC 3's md5 of a file (`hash: md5`): the plain md5 of its bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def dir_listing(folder: Path) -> list[dict[str, str]]:
    """A folder as DVC lists it in a `.dir` cache file: [{"md5", "relpath"}] sorted by path."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    return [{"md5": md5_file(p), "relpath": p.relative_to(folder).as_posix()} for p in files]


def dir_md5(listing: list[dict[str, str]]) -> str:
    """DVC's hash of a folder output: the md5 of its `.dir` listing as DVC serialises it."""
    return hashlib.md5(json.dumps(listing, sort_keys=True).encode()).hexdigest() + ".dir"


def read_lock(root: Path) -> dict | None:
    """dvc.lock read as DVC reads it (YAML 1.2: PyYAML would read `1e-06` as a string)."""
    from dvc.utils.serialize import YAMLFileCorruptedError, parse_yaml
    path = Path(root) / DVC_LOCK
    if not path.exists():
        return None
    try:
        lock = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    except YAMLFileCorruptedError:
        raise UserError(f"{path} is not valid YAML (corrupt?)") from None
    if not isinstance(lock, dict) or not isinstance(lock.get("stages"), dict):
        raise UserError(f"{path} has no `stages` mapping: not a dvc.lock")
    return lock


def read_params_as_dvc(root: Path) -> dict:
    """params.yaml parsed as DVC parses it, for comparing with the values DVC wrote in dvc.lock."""
    from dvc.utils.serialize import parse_yaml
    path = Path(root) / paths.PARAMS
    return parse_yaml(path.read_text(encoding="utf-8"), str(path)) or {}


def dvc_stages(root: Path) -> list[str] | None:
    """Stage names in the run's dvc.yaml, in order (None without a dvc.yaml)."""
    path = Path(root) / DVC_YAML
    if not path.exists():
        return None
    return list((yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("stages") or {})


def cache_dir(repo: Path) -> Path:
    """The local DVC cache's md5 folder (honours `dvc cache dir`)."""
    from dvc.repo import Repo
    with Repo(str(repo)) as r:
        return Path(r.cache.local.path)


def _cached(cache: Path, md5: str) -> Path:
    return cache / md5[:2] / md5[2:]


# ---------------------------------------------------------------- a run's folder
@contextmanager
def open_run(repo: Path, rev: Revision) -> Iterator[Path]:
    """The folder holding the run at `rev` (temporary for a commit, removed afterwards)."""
    if rev.commit is None:
        yield Path(repo)
        return
    with tempfile.TemporaryDirectory(prefix="nexttoken-rev-") as tmp:
        root = Path(tmp)
        for name in RUN_FILES + git_files_under(repo, rev.commit, schema.PROMPT_DIR):   # prompt.file: as it was
            data = git_file(repo, rev.commit, name)
            if data is not None:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_bytes(data)
        if not (root / DVC_LOCK).exists():
            raise UserError(f"{rev} has no dvc.lock: no run was committed at that revision")
        _link_outputs(root, read_lock(root), cache_dir(repo), rev)
        yield root


def _link_outputs(root: Path, lock: dict, cache: Path, rev: Revision) -> None:
    """Symlink every output recorded in dvc.lock from the cache; name what is missing."""
    missing: list[str] = []
    for stage in lock["stages"].values():
        for out in stage.get("outs", []):
            md5, dest = out.get("md5"), root / out["path"]
            if md5 is None:
                missing.append(out["path"])
            elif md5.endswith(".dir"):
                listing_file = _cached(cache, md5)
                if not listing_file.exists():
                    missing.append(out["path"])
                    continue
                for entry in json.loads(listing_file.read_text()):
                    _link(_cached(cache, entry["md5"]), dest / entry["relpath"], root, missing)
            else:
                _link(_cached(cache, md5), dest, root, missing)
    if missing:
        raise UserError(f"{len(missing)} output(s) of {rev} are not in the local DVC cache "
                        f"(first: {missing[0]}): fetch them with `dvc pull` or `dvc exp pull`")


def _link(src: Path, dest: Path, root: Path, missing: list[str]) -> None:
    if not src.exists():
        missing.append(dest.relative_to(root).as_posix())
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.symlink_to(src)


# ---------------------------------------------------------------- what a run recorded
def load_manifests(root: Path) -> dict[str, dict]:
    """stage -> manifest for every stage that ran, in pipeline order; a corrupt one, or one of another
    format_version than this code's, is an error (`artifacts.read_manifest`)."""
    listed = dvc_stages(root)
    stages = [s for s in (listed if listed is not None else paths.STAGES) if s in paths.STAGES]
    found = {s: read_manifest(s, root) for s in stages if paths.manifest_path(s, root).exists()}
    if not found:
        raise UserError(f"no runs in {root}: no artifacts/<stage>/manifest.json (run `dvc repro` first)")
    return found


def recorded_environment(manifests: dict[str, dict]) -> dict[str, list]:
    """`libraries.x` / `hardware.y` -> the distinct values the stages recorded (one, normally)."""
    out: dict[str, list] = {}
    for m in manifests.values():
        for section, keys in (("libraries", None), ("hardware", HARDWARE_KEYS)):
            for k, v in (m.get(section) or {}).items():
                if keys is None or k in keys:
                    seen = out.setdefault(f"{section}.{k}", [])
                    if v not in seen:
                        seen.append(v)
    return out
