"""The validate stage: all of params.yaml checked without torch; each stage's resolved config.

What DVC makes of it (it runs first, a refused config leaves every artifact alone, a
temperature change still skips forward) is in tests/e2e/test_workspace_hygiene.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from pipeline.config import registry, schema
from pipeline.store import paths
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
    for stage in registry.validated_stages():
        written = json.loads(paths.validated(stage, ws).read_text(encoding="utf-8"))
        assert written == registry.resolved(params, stage, {"text": "Once upon a time\n"}), stage
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
