"""pipeline/warm.py without a warm process: what keys one, and when a stage runs fresh."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import warm

BASE = {"PATH": "/usr/bin", "HOME": "/root", "HF_HUB_OFFLINE": "1"}


def test_the_key_is_the_environment_but_what_differs_per_stage_or_test():
    key = warm.environment_key(BASE)
    assert warm.environment_key(BASE) == key
    for per_run in ({"DVC_STAGE": "forward"}, {"DVC_ROOT": "/tmp/x"}, {"PYTEST_CURRENT_TEST": "t (call)"},
                    {"DVC_EXP_NAME": "exp-1"}, {"PYTEST_XDIST_WORKER": "gw1"}, {warm.CHILD_ENV: "123"},
                    {"PWD": "/tmp/ws"}):
        assert warm.environment_key({**BASE, **per_run}) == key, per_run


@pytest.mark.parametrize("var,value", [("ATEN_CPU_CAPABILITY", "avx2"), ("OMP_NUM_THREADS", "2"),
                                       ("MKL_CBWR", "AVX2,STRICT"), ("PYTHONPATH", "/x"), ("TMPDIR", "/t"),
                                       ("NEXTTOKEN_TEST_PAUSE", "import.torch"), ("HF_HUB_OFFLINE", "0")])
def test_anything_an_import_may_read_is_a_new_key(var, value):
    """A kernel pin read when torch loads, a sitecustomize's switch, a cached temp folder: a warm
    process made under another value would hand a stage the other value's imports."""
    assert warm.environment_key({**BASE, var: value}) != warm.environment_key(BASE)


def test_the_switch_and_the_interpreter_options_keep_a_stage_fresh(monkeypatch):
    monkeypatch.setenv(warm.SWITCH, "0")
    assert warm._why_not("forward") == "NEXTTOKEN_WARM=0"
    monkeypatch.setenv(warm.SWITCH, "1")
    # this process runs pytest, not `python -m stages.forward`: a test calling main() stays in-process
    assert warm._why_not("forward") in ("the stage is not run as `python -m stages.<name>`",
                                         "torch is loaded already")
    monkeypatch.setattr("sys._xoptions", {"importtime": True})
    assert warm._why_not("forward") == "the interpreter runs with -X/-O/-I options"


def test_a_socket_folder_too_long_is_refused_not_truncated(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 90)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    with pytest.raises(OSError, match="too long a folder for a Unix socket"):
        warm.home()
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/tmp")
    assert warm.home() == Path(f"/tmp/nexttoken-warm-{os.getuid()}")


def test_a_fresh_run_records_why():
    assert warm.record()["warm"] is False and warm.record()["why"]
