"""The library's structure: folders by role, imports pointing one way, no cycles.

Read from the source (every import statement, inside functions too), not from a running
interpreter, so a lazy import cannot hide an arrow. docs/architecture.md draws the same
layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PIPELINE = REPO / "pipeline"
# Lowest first: a module may import its own package and the layers below it, never above. Packages on one level
# (a tuple) import neither each other: checks judges the recorded numbers, equivalence re-runs the model.
# record: the stage layer's recording (StageRun, the executor), above the library it calls.
LAYERS = ("base", "config", "store", "numerics", "model", ("checks", "equivalence"), "report", "executor", "record",
          "tools", "api")   # api: pipeline/api.py
LEVEL = {name: i for i, entry in enumerate(LAYERS) for name in ((entry,) if isinstance(entry, str) else entry)}
# shared by every layer
BASE = ("pipeline", "pipeline.errors", "pipeline.progress", "pipeline.atomic", "pipeline.kernels")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PIPELINE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Every module named by an import in the file (from-imports of submodules resolved)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def layer(module: str) -> str:
    if module in BASE or module == "pipeline.__main__":
        return "base" if module != "pipeline.__main__" else "tools"
    return module.split(".")[1]


def test_every_module_is_in_a_layer():
    assert {layer(m) for m in MODULES} <= set(LEVEL), sorted({layer(m) for m in MODULES} - set(LEVEL))


def test_each_package_says_its_role():
    for package in (p for p in PIPELINE.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"{package.name}/__init__.py has no docstring saying its role"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_library_never_imports_entry_points_or_dev_code(module):
    bad = {i for i in _imports(MODULES[module]) if i.split(".")[0] in ("stages", "bench", "tests")}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    mine = LEVEL[layer(module)]
    upward = sorted(i for i in GRAPH[module] if LEVEL[layer(i)] > mine)
    beside = sorted(i for i in GRAPH[module] if LEVEL[layer(i)] == mine and layer(i) != layer(module))
    assert not upward, f"{module} ({layer(module)}) imports higher layers: {upward}"
    assert not beside, f"{module} ({layer(module)}) imports a package on its own level: {beside}"


def test_the_layer_test_finds_an_import_beside_or_above(monkeypatch):
    """checks and equivalence sit on one level: either importing the other fails, as an import upward does."""
    for module, bad in (("pipeline.checks.equivalence", "pipeline.equivalence.matrix"),
                        ("pipeline.model.lens", "pipeline.executor.work")):
        monkeypatch.setitem(GRAPH, module, GRAPH[module] | {bad})
        with pytest.raises(AssertionError, match=bad):
            test_imports_point_down_the_layers(module)


def test_no_import_cycle():
    """Depth-first search for a back edge; the cycle is named when there is one."""
    state: dict[str, int] = {}          # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_the_cycle_test_can_fail(monkeypatch):
    monkeypatch.setitem(GRAPH, "pipeline.store.paths", GRAPH["pipeline.store.paths"] | {"pipeline.store.artifacts"})
    with pytest.raises(AssertionError, match="pipeline.store"):
        test_no_import_cycle()


def test_measurement_code_is_not_installed():
    """bench/ and tests/ stay out of the wheel: setuptools packages only pipeline* and stages*."""
    import tomllib
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == ["pipeline*", "stages*"]
    assert not any((PIPELINE / name).exists() for name in ("bench.py", "scale.py", "worktree.py"))
