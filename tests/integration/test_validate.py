"""The validate stage: all of params.yaml checked without torch; each stage's resolved config.

What DVC makes of it (it runs first, a refused config leaves every artifact alone, a
temperature change still skips forward) is in tests/e2e/test_workspace_hygiene.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from pipeline.config import schema
from pipeline.store import graph, paths
from tests.conftest import ON_CPU, TEST_STEPS, make_workspace, run_module, snapshot

# The stage run as DVC runs it, then a look at what it imported.
NO_TORCH = ("import runpy, sys; runpy.run_module('stages.validate', run_name='__main__', "
            "alter_sys=True)")


def test_validate_writes_each_stage_s_resolved_config_without_importing_torch(tmp_path):
    ws = make_workspace(tmp_path / "ws", ["model=tiny_qwen2"])
    (ws / "prompts").mkdir()
    (ws / "prompts/story.txt").write_text("Once upon a time\n", encoding="utf-8")
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "model=tiny_qwen2", ON_CPU,
               "prompt.file=prompts/story.txt", "prompt.text=null", check=True)
    code = NO_TORCH + "; assert 'torch' not in sys.modules, 'validate imported torch'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ws, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    params = schema.read_params(ws / paths.PARAMS)
    for stage in graph.validated_stages():
        written = json.loads(paths.validated(stage, ws).read_text(encoding="utf-8"))
        assert written == graph.resolved(params, stage, {"text": "Once upon a time\n"}), stage
    executor = json.loads(paths.validated(graph.EXECUTOR, ws).read_text(encoding="utf-8"))
    assert executor == schema.load_section(params, "executor").model_dump(mode="json") and executor["kind"] == "serial"
    tokenize = json.loads(paths.validated("tokenize", ws).read_text(encoding="utf-8"))
    assert tokenize["prompt"]["text"] == "Once upon a time\n" and tokenize["prompt"]["file"] == "prompts/story.txt"
    manifest = json.loads(paths.manifest_path("validate", ws).read_text())
    assert [i["path"] for i in manifest["inputs"]] == ["prompts/story.txt"]
    assert manifest["config"] == schema.subset(params, tuple(schema.SECTIONS)) and manifest["determinism"] is None


def test_validate_refuses_a_bad_value_and_keeps_its_previous_files(tmp_path):
    ws = make_workspace(tmp_path / "ws", ["model=tiny_qwen2"])
    run_module("stages.validate", ws, check=True)
    before = snapshot(ws)
    params = yaml.safe_load((ws / paths.PARAMS).read_text())
    params["sampling"]["branches"] = ["greedy", "greedy"]
    (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True))
    proc = run_module("stages.validate", ws)
    assert proc.returncode == 2 and proc.stderr == ("nexttoken validate: error: sampling.branches=['greedy', "
                                                    "'greedy'] is not allowed: distinct values\n")
    assert {k: v for k, v in snapshot(ws).items() if k != paths.PARAMS} == \
        {k: v for k, v in before.items() if k != paths.PARAMS}


def _validate_files(ws) -> dict[str, bytes]:
    """Every file of artifacts/validate (DVC's output of the stage, its manifest included), as bytes."""
    folder = paths.stage_dir("validate", ws)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_rerun_on_the_same_config_leaves_every_output_byte_identical(tmp_path):
    """Issue 50: re-running an unchanged config marked dvc.lock modified, as validate rewrote its manifest (run time,
    duration, each output's modification time) though no file it writes had changed. Now a re-run on the same
    params.yaml and prompt file leaves artifacts/validate byte for byte as it was, and any change of what it writes
    or records (a param, the prompt file's text, a file edited by hand) is written again."""
    ws = make_workspace(tmp_path / "ws", ["model=tiny_qwen2"])
    (ws / "prompts").mkdir()
    (ws / "prompts/story.txt").write_text("Once upon a time\n", encoding="utf-8")
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "model=tiny_qwen2", ON_CPU,
               "prompt.file=prompts/story.txt", "prompt.text=null", check=True)
    run_module("stages.validate", ws, check=True)
    first = _validate_files(ws)
    # a file per stage that reads params, where its work runs (executor.json), its manifest
    assert set(first) == {paths.validated(s).name for s in [*graph.validated_stages(), graph.EXECUTOR]} \
        | {"manifest.json"}
    (ws / "prompts/story.txt").touch()                                  # a new modification time, the same text
    proc = run_module("stages.validate", ws, check=True)
    assert _validate_files(ws) == first, "a re-run on the same config rewrote artifacts/validate"
    assert "kept as they are" in proc.stdout

    def rerun_changes(what: str) -> None:
        before = _validate_files(ws)
        run_module("stages.validate", ws, check=True)
        after = _validate_files(ws)
        assert after != before and after["manifest.json"] != before["manifest.json"], what
        params = schema.read_params(ws / paths.PARAMS)
        for stage in graph.validated_stages():       # what it wrote is the config's, whatever was there
            want = graph.resolved(params, stage, {"text": (ws / "prompts/story.txt").read_text(encoding="utf-8")})
            assert json.loads(after[paths.validated(stage).name]) == want, (what, stage)

    (ws / "prompts/story.txt").write_text("Once upon a time, again\n", encoding="utf-8")
    rerun_changes("the prompt file's text")
    params = yaml.safe_load((ws / paths.PARAMS).read_text())
    params["sampling"]["top_k"] = 3
    (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    rerun_changes("sampling.top_k")
    edited = paths.validated("probs", ws)
    edited.write_text(edited.read_text(encoding="utf-8").replace("\n", "\n ", 1), encoding="utf-8")
    rerun_changes("a file of artifacts/validate edited by hand")
    kept = _validate_files(ws)
    run_module("stages.validate", ws, check=True)
    assert _validate_files(ws) == kept
