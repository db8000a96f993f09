"""dvc.yaml is generated from the stage declarations (pipeline/store/graph.py) and the stages' imports
(pipeline/tools/dvc_yaml.py): the file in the checkout is what they give, and what they give is right.

Code deps: the stage module plus every pipeline/ module it imports, transitively (found by
reading the imports, not by hand), so editing library code invalidates exactly the stages
that run it. Params: the declaration's keys. Outs: the stage's fixed folder from pipeline/store/paths.py.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.config.schema import PROMPT_DIR, SECTIONS
from pipeline.store import graph, paths
from pipeline.tools import dvc_yaml

REPO = Path(__file__).resolve().parents[2]
DVC = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def test_dvc_yaml_is_what_the_declarations_give(capsys):
    """`nexttoken dvc-yaml --check` in the checkout: exit 0 (the tests' gate on a hand-edited dvc.yaml)."""
    assert (REPO / "dvc.yaml").read_text(encoding="utf-8") == dvc_yaml.render(REPO)


def _copy(tmp: Path) -> Path:
    for part in ("stages", "pipeline"):
        shutil.copytree(REPO / part, tmp / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dvc.yaml", tmp / "dvc.yaml")
    return tmp


def test_a_new_import_changes_exactly_its_stages_code_deps(tmp_path, monkeypatch, capsys):
    """An import added inside a function of a library module (lazily, as the stages import torch) makes
    that module's importers depend on the imported one: found, not listed; `--check` then fails and
    names the difference, and writing the file makes it pass again."""
    root = _copy(tmp_path)
    target = "pipeline/numerics/exactsum.py"
    importers = {s.name for s in graph.STAGES if "pipeline/record/logits.py" in dvc_yaml.code_deps(s.name, REPO)}
    assert importers and all(target not in dvc_yaml.code_deps(s, REPO) for s in importers)
    lib = root / "pipeline/record/logits.py"
    lib.write_text(lib.read_text() + "\n\ndef _later():\n    from pipeline.numerics import exactsum  # noqa: F401\n")
    dvc_yaml.code_deps.cache_clear()
    try:
        changed = {s.name for s in graph.STAGES if target in dvc_yaml.code_deps(s.name, root)
                   and target not in dvc_yaml.code_deps(s.name, REPO)}
        assert changed == importers
        monkeypatch.chdir(root)
        assert dvc_yaml.cli(argparse.Namespace(check=True)) == 1
        assert f"+      - {target}" in capsys.readouterr().out
        assert dvc_yaml.cli(argparse.Namespace(check=False)) == 0
        assert dvc_yaml.cli(argparse.Namespace(check=True)) == 0
    finally:
        dvc_yaml.code_deps.cache_clear()


def test_stage_order_matches_paths():
    assert list(DVC) == list(paths.STAGES)


def test_stage_order_is_topological():
    """dvc.yaml's order runs each stage after every stage whose outputs it reads: the tests' whole-chain
    runs (tests/helpers/inprocess.py CHAIN) take that order from dvc.yaml as `dvc repro` would run it."""
    seen: set[str] = set()
    for stage, spec in DVC.items():
        upstream = {Path(d).parts[1] for d in spec["deps"] if d.startswith(paths.ARTIFACTS + "/")}
        assert upstream - {stage} <= seen, f"{stage} reads {sorted(upstream - seen - {stage})} before they run"
        seen.add(stage)


@pytest.mark.parametrize("stage", list(DVC))
def test_stage_declares_its_code_params_and_outs(stage):
    spec = DVC[stage]
    assert spec["cmd"] == f"python -m stages.{stage}"
    if stage == "validate":     # the whole params.yaml: it checks every section and refuses unknown ones
        assert spec["params"] == [{paths.PARAMS: None}] and graph.PARAMS[stage] == tuple(SECTIONS)
    else:
        assert tuple(spec.get("params", ())) == graph.PARAMS[stage]
    assert spec["deps"][0] == f"stages/{stage}.py"
    assert {"pipeline/store/paths.py", "pipeline/store/artifacts.py"} <= set(spec["deps"])   # every stage writes
    # outputs: the stage folder itself, or (where DVC metrics/plots live beside them) its files
    # one by one, always including the manifest; nothing outside the folder
    folder = paths.stage_dir(stage).as_posix()
    outs = [o if isinstance(o, str) else next(iter(o)) for o in spec["outs"]]
    declared = outs + [next(iter(m)) if isinstance(m, dict) else m for m in spec.get("metrics", [])] \
        + [next(iter(p)) if isinstance(p, dict) else p for p in spec.get("plots", [])]
    assert outs == [folder] or f"{folder}/{paths.MANIFEST}" in outs
    assert all(d == folder or d.startswith(folder + "/") for d in declared)
    # a per-prompt file is a folder of partitions (one per prompt): outs name the folder, never a file
    datasets = {paths.dataset(i).as_posix() for i in paths.PER_PROMPT if i[0] == stage}
    assert outs == [folder] or datasets <= set(outs)


@pytest.mark.parametrize("stage", list(DVC))
def test_artifact_deps_name_what_the_stages_write(stage):
    """A dep under artifacts/ is a stage folder, a set-level file or a per-prompt dataset folder:
    a per-prompt file's flat path (the layout before issue 17) names nothing DVC could hash."""
    flat = {paths.stage_dir(i[0]).joinpath(i[1]).as_posix() for i in paths.PER_PROMPT}
    datasets = {paths.dataset(i).as_posix() for i in paths.PER_PROMPT}
    for dep in (d for d in DVC[stage]["deps"] if d.startswith(paths.ARTIFACTS + "/")):
        assert dep not in flat, f"{stage}: {dep} is one file per prompt now: depend on its folder"
        assert Path(dep).parts[1] in paths.STAGES and (len(Path(dep).parts) == 2 or dep in datasets
                                                        or "." in Path(dep).name), dep


@pytest.mark.parametrize("stage", list(DVC))
def test_each_stage_that_reads_params_depends_on_its_validated_config(stage):
    """validate is the only stage that depends on prompts/ (it reads the prompt file) and on the
    whole params.yaml; every other stage that reads params depends on its own resolved config,
    artifacts/validate/<stage>.json (with the prompt's text), which validate writes: so DVC runs
    validate first, a new file under prompts/ re-runs validate alone, and an edit of the prompt
    file that is used re-runs the stages that read it."""
    deps = DVC[stage]["deps"]
    assert (PROMPT_DIR in deps) == (stage == "validate")
    assert (REPO / PROMPT_DIR).is_dir()      # DVC refuses a missing dependency
    wants = stage in graph.validated_stages()
    assert (paths.validated(stage).as_posix() in deps) == wants
    assert wants == (bool(graph.PARAMS[stage]) and stage != "validate")
    if stage == "validate":
        assert DVC[stage]["outs"] == [{paths.stage_dir(stage).as_posix(): {"persist": True}}]


def test_validate_writes_a_file_for_each_stage_that_depends_on_one():
    assert set(graph.validated_stages()) == {s for s in DVC if paths.validated(s).as_posix() in DVC[s]["deps"]}


# ---------------------------------------------------------------- what DVC keeps in git (issue 27 item 5)
def _cached_outs() -> dict[str, list[str]]:
    """folder -> the `/name` entries DVC writes into folder/.gitignore for the cached outs (and metrics) there."""
    out: dict[str, list[str]] = {}
    for stage in DVC.values():
        for item in [*stage.get("outs", []), *stage.get("metrics", []), *stage.get("plots", [])]:
            path, opts = next(iter(item.items())) if isinstance(item, dict) else (item, {})
            if (opts or {}).get("cache", True):
                folder, _, name = path.rpartition("/")
                out.setdefault(folder, []).append(f"/{name}")
    return out


def test_the_repository_holds_the_gitignore_files_dvc_writes():
    """After `dvc repro` in a fresh clone DVC asked to `git add` artifacts/.gitignore and three stage folders'
    ones: they are committed, each listing exactly the cached outs of its folder (so DVC, finding every out
    ignored already, writes none and asks nothing)."""
    expected = _cached_outs()
    found = {p.parent.relative_to(REPO).as_posix(): p for p in (REPO / paths.ARTIFACTS).rglob(".gitignore")}
    assert set(found) == set(expected)
    for folder, entries in expected.items():
        assert found[folder].read_text(encoding="utf-8").splitlines() == entries, folder


def test_dvc_stages_dvc_lock_itself():
    """dvc.lock is a run's record (its outs' hashes depend on the CPU's bf16 kernels): not committed with the
    code, staged by DVC after each run (`core.autostage`), so `git commit` records the run."""
    import configparser
    config = configparser.ConfigParser()
    config.read(REPO / ".dvc/config")
    assert config.getboolean("core", "autostage")
    tracked = subprocess.run(["git", "ls-files", "dvc.lock"], cwd=REPO, capture_output=True, text=True, check=True)
    assert tracked.stdout == ""
