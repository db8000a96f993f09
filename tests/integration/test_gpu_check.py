"""bench/gpu_check.py: runs on the CPU too (so it cannot rot), with nothing outside its list.

`make gpu-check` runs here on the CPU in a Python that cannot import Hydra, omegaconf, DVC,
pydantic, psutil or accelerate, nor PyYAML from the repository's code
(tests/helpers/bare_site). The model it builds is the one prepare_model saves, its conf/
reader agrees with PyYAML, a numerical finding never changes its exit status and a pipeline
error does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from bench import gpu_check
from pipeline.checks import recompute
from pipeline.model import capture
from pipeline.store import paths
from tests.conftest import REPO
from tests.helpers.partitions import part

BARE = {"PYTHONPATH": str(REPO / "tests/helpers/bare_site"), "NEXTTOKEN_BARE_REPO": str(REPO),
        "HF_HUB_OFFLINE": "1"}


def bare(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **BARE})


@pytest.mark.parametrize("name", sorted(gpu_check.CONF))
def test_the_conf_reader_is_yaml_on_every_file_it_reads(name):
    path = gpu_check.CONF[name]
    assert gpu_check.read_conf(path) == yaml.safe_load(path.read_text(encoding="utf-8"))


def test_the_built_model_is_the_one_prepare_model_saves(tiny_workspace, tmp_path):
    prepared = tiny_workspace / "artifacts/prepare_model"
    built = gpu_check.build_snapshot(gpu_check.settings(), tmp_path)
    want, got = load_file(prepared / "model.safetensors"), load_file(built / "model.safetensors")
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)
    assert json.loads((prepared / "generation_config.json").read_text())["eos_token_id"] == gpu_check.EOS_ID
    assert gpu_check.settings()["ids"] == json.loads(part(paths.TOKENIZE_SUMMARY, tiny_workspace)
                                                     .read_text())["token_ids"]


def test_the_bare_site_hides_what_it_says():
    """Without this the next test would prove nothing: the hidden modules really are missing."""
    for code in ("import omegaconf", "import dvc.api", "import psutil", "import pipeline.config.schema"):
        proc = bare(sys.executable, "-c", code)
        assert proc.returncode != 0 and ("ModuleNotFoundError" in proc.stderr or "bare site:" in proc.stderr), code


def test_make_gpu_check_runs_on_the_cpu_with_nothing_outside_its_list():
    proc = bare("make", "--no-print-directory", "gpu-check", f"GPU_CHECK_PYTHON={sys.executable}",
                "GPU_CHECK_ARGS=--device cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bare site: hiding hydra" in proc.stderr
    out = proc.stdout
    for line in ("on the article's 25 token ids", "determinism flags as found", "== cpu", "lm_head_recompute",
                 "layer0_attention_attn_weights", "capture_transparent", "generate_parity_greedy",
                 "FP64 table at the last position", "KV cache vs full prefix, sample: max |logit diff| per step",
                 "times: load", "gpu-check: finished"):
        assert line in out, line
    # on the CPU every exact figure is 0 and the KV cache drifts by nothing (the FP32 sums may miss 2e-6)
    findings = [line for line in out.splitlines()
                if "FINDING" in line and not ("FP32 >" in line or "is a FINDING" in line)]
    assert findings == [], out


def test_a_numerical_finding_is_printed_never_an_exit_status(monkeypatch, capsys):
    monkeypatch.setattr(recompute, "lm_head_recompute", lambda *args: 0.25)
    assert gpu_check.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:3] == ["lm_head_recompute", "0.25", "FINDING"] for line in out.splitlines()), out


def test_a_pipeline_error_exits_1_naming_it(monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("capture mismatch: missing ['embed']")
    monkeypatch.setattr(capture, "run_capture", broken)
    assert gpu_check.main(["--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("gpu-check: pipeline error after ") and "capture mismatch" in err
