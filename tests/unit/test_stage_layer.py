"""The stage layer's promises, read off the code (issue 45): one way to run a stage (a fresh interpreter, as
DVC starts it: no module forks, none calls a private CPython API), and no stage reads params.yaml but
validate (the others read the file validate wrote for them, pipeline/store/graph.py)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from pipeline.store import graph
from pipeline.tools import dvc_yaml

REPO = Path(__file__).resolve().parents[2]
CODE = sorted(p for folder in ("pipeline", "stages", "bench") for p in (REPO / folder).rglob("*.py"))
FORKS = {("os", "fork"), ("os", "forkpty"), ("os", "register_at_fork")}
STDLIB = set(sys.stdlib_module_names)


def _calls(tree: ast.AST, imported: dict[str, str]):
    """(module, attribute) for every `<module>.<attribute>` a file names, its module resolved through its imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
            yield imported[node.value.id], node.attr
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                yield node.module, a.name


def _imports(tree: ast.AST) -> dict[str, str]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name.split(".")[0]): (a.name if a.asname else a.name.split(".")[0])
                    for a in node.names}
    return out


def offences(source: str) -> list[str]:
    tree = ast.parse(source)
    found = []
    for module, attr in _calls(tree, _imports(tree)):
        top = module.split(".")[0]
        if (module, attr) in FORKS or (top == "multiprocessing" and attr in {"set_start_method", "get_context"}):
            found.append(f"{module}.{attr} (a fork)")
        elif top in STDLIB and attr.startswith("_") and not attr.startswith("__"):
            found.append(f"{module}.{attr} (a private CPython API)")
    return found


def test_the_check_finds_what_it_looks_for():
    """The two offences the warm fork server committed, and one spelled another way, are found."""
    warm = "import os, runpy\nimport threading as th\nfrom atexit import _run_exitfuncs\n" \
           "pid = os.fork()\nrunpy._run_module_as_main('stages.forward')\nth._shutdown()\n"
    assert sorted(offences(warm)) == ["atexit._run_exitfuncs (a private CPython API)", "os.fork (a fork)",
                                      "runpy._run_module_as_main (a private CPython API)",
                                      "threading._shutdown (a private CPython API)"]
    assert offences("import os\nos.getpid()\nimport torch\ntorch._C._get_tracing_state\n") == []


@pytest.mark.parametrize("path", CODE, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_module_forks_or_calls_a_private_cpython_api(path):
    assert offences(path.read_text(encoding="utf-8")) == []


def _reads_params_yaml(path: Path, root: Path = REPO) -> list[str]:
    """Where a file reads params.yaml: a call of schema.read_params, or the name paths.PARAMS / 'params.yaml'
    (what any other reader would have to name) anywhere but in a `sha256_file(...)` call (a stage may check
    that params.yaml is the one validate checked, by its hash, without reading a key)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hashed = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call)
              and getattr(call.func, "attr", getattr(call.func, "id", None)) == "sha256_file"
              for arg in call.args for n in ast.walk(arg)}
    named = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)    # paths.PARAMS = "params.yaml"
             and [getattr(t, "id", None) for t in n.targets] == ["PARAMS"]}
    reader = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "read_params"
              for n in ast.walk(f)}                                       # its definition: the calls count
    hits = []
    for node in ast.walk(tree):
        if id(node) in reader:
            continue
        where = f"{path.relative_to(root).as_posix()}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and (node.attr, getattr(node.value, "id", None)) in {
                ("read_params", "schema")}:
            hits.append(f"{where} {node.value.id}.{node.attr}")
        elif id(node) in hashed:
            continue
        elif isinstance(node, ast.Attribute) and (node.attr, getattr(node.value, "id", None)) == ("PARAMS", "paths"):
            hits.append(f"{where} paths.PARAMS")
        elif isinstance(node, ast.Constant) and node.value == "params.yaml" and id(node) not in named:
            hits.append(f"{where} 'params.yaml'")
    return sorted(hits)


LIBRARY = ("model", "numerics", "checks", "equivalence")     # compute on values: the stage layer records
RECORDING = {"StageRun", "Writer", "stage_run", "entry"}      # pipeline.store.artifacts' recording names


def recording_uses(source: str) -> list[str]:
    """Where a file reaches for the stage layer's recording: any import of pipeline.executor (or of a name from
    it), or StageRun / Writer / stage_run / entry from pipeline.store.artifacts, imported or named as an
    attribute of the imported module (inside functions too)."""
    tree = ast.parse(source)
    artifacts = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 and n.module == "pipeline.store" for a in n.names if a.name == "artifacts"}
    artifacts |= {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import)
                  for a in n.names if a.name == "pipeline.store.artifacts" and a.asname}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pipeline.executor" or node.module.startswith("pipeline.executor."):
                hits.append(f"{node.lineno}: from {node.module} import ...")
            elif node.module == "pipeline" and any(a.name == "executor" for a in node.names):
                hits.append(f"{node.lineno}: from pipeline import executor")
            elif node.module == "pipeline.store.artifacts":
                hits += [f"{node.lineno}: {a.name} from pipeline.store.artifacts" for a in node.names
                         if a.name in RECORDING]
        elif isinstance(node, ast.Import):
            hits += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith("pipeline.executor")]
        elif isinstance(node, ast.Attribute) and node.attr in RECORDING and (
                getattr(node.value, "id", None) in artifacts or ast.unparse(node.value) == "pipeline.store.artifacts"):
            hits.append(f"{node.lineno}: {ast.unparse(node)}")
    return hits


@pytest.mark.parametrize("path", sorted(p for pkg in LIBRARY for p in (REPO / "pipeline" / pkg).rglob("*.py")),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_library_does_no_recording(path):
    """model/, numerics/, checks/ and equivalence/ take and return values; reading inputs through the run's ledger,
    writing through the run and the executor are pipeline/record's (issue 45 item 3)."""
    assert recording_uses(path.read_text(encoding="utf-8")) == []


def test_the_recording_check_finds_each_spelling():
    """Each way back in is found (a StageRun parameter put back in model/forward.py, the executor imported)."""
    source = (REPO / "pipeline/model/forward.py").read_text(encoding="utf-8")
    for added, found in (("from pipeline.store.artifacts import StageRun, read_json\n", "StageRun from"),
                         ("from pipeline.executor.work import LoadsInSetup\n", "from pipeline.executor.work"),
                         ("def f():\n    from pipeline.executor import run as ex\n", "from pipeline.executor import"),
                         ("from pipeline import executor\n", "from pipeline import executor"),
                         ("from pipeline.store import artifacts\nartifacts.Writer\n", "artifacts.Writer"),
                         ("import pipeline.executor.run\n", "import pipeline.executor.run")):
        hits = recording_uses(source + added)
        assert len(hits) == 1 and found in hits[0], (added, hits)
    assert recording_uses("from pipeline.store.artifacts import read_json, read_parquet\n") == []


@pytest.mark.parametrize("stage", [s.name for s in graph.STAGES])
def test_no_stage_reads_params_yaml_but_validate(stage):
    """The stage module and every library module it runs: validate alone reads params.yaml; every other
    stage reads its validated config (graph.config), so it reads exactly what DVC re-runs it on."""
    files = [REPO / "stages" / f"{stage}.py", *(REPO / f for f in dvc_yaml.code_deps(stage, REPO) if f.endswith(".py"))]
    hits = [h for f in files for h in _reads_params_yaml(f)]
    if stage == "validate":
        assert any(h.startswith("stages/validate.py") for h in hits)
    else:
        assert hits == []


def test_the_params_check_finds_a_read(tmp_path):
    f = tmp_path / "stage.py"
    f.write_text("from pipeline.config import schema\nfrom pipeline.store import paths, provenance\n"
                 "params = schema.read_params(Path(paths.PARAMS))\nother = open('params.yaml')\n"
                 "same = provenance.sha256_file(Path(paths.PARAMS))\n")
    assert _reads_params_yaml(f, tmp_path) == ["stage.py:3 paths.PARAMS", "stage.py:3 schema.read_params",
                                               "stage.py:4 'params.yaml'"]


def test_a_stage_started_by_hand_after_params_yaml_changed_is_refused(tmp_path, monkeypatch):
    """graph.config: the validated config belongs to the params.yaml validate checked (its manifest's
    params_sha256). Started by hand after an edit, a stage would run the old config: one line instead.
    Under DVC (DVC_STAGE set) DVC decides, by values, whether validate re-runs."""
    import json

    from pipeline.errors import UserError
    from pipeline.store import paths, provenance
    (tmp_path / paths.PARAMS).write_text("probs: {}\n")
    validated = {"probs": {"top_n": 3}, "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 0.9},
                 "capture": {"kernels": "native"}}
    paths.validated("probs", tmp_path).parent.mkdir(parents=True)
    paths.validated("probs", tmp_path).write_text(json.dumps(validated))
    manifest = {"facts": {"params_sha256": provenance.sha256_file(tmp_path / paths.PARAMS)}}
    paths.manifest_path("validate", tmp_path).write_text(json.dumps(manifest))
    monkeypatch.delenv("DVC_STAGE", raising=False)
    cfg = graph.config("probs", tmp_path)
    assert cfg.section("sampling").top_p == 0.9 and cfg.section("capture").kernels == "native"
    with pytest.raises(AttributeError):
        _ = cfg.section("capture").dtype             # not declared by probs: not there to read
    (tmp_path / paths.PARAMS).write_text("probs: {}\n# edited\n")
    with pytest.raises(UserError, match=r"^params.yaml has changed since the validate stage checked it: run "
                                        r"`dvc repro`.*artifacts/validate/probs.json$"):
        graph.config("probs", tmp_path)
    monkeypatch.setenv("DVC_STAGE", "probs")
    assert graph.config("probs", tmp_path).validated == validated


def test_a_partial_section_crosses_to_another_process(tmp_path):
    """Ray sends a stage's config sections to its workers by pickle; a partial section's class is made at
    run time, so a fresh process (which never made it) must rebuild it from its section and values."""
    import pickle
    import subprocess

    from pipeline.config import schema
    part = schema.load_part({"capture": {"dtype": "bfloat16", "device": "cpu", "attn_implementation": "eager",
                                         "kernels": "native"}}, "capture")
    (tmp_path / "part.pkl").write_bytes(pickle.dumps(part))
    code = ("import pickle, sys; p = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print(type(p).__name__, p.dtype, p.kernels, hasattr(p, 'positions'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "part.pkl")], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout.split()
    assert out == ["CaptureConfigPart", "bfloat16", "native", "False"]
