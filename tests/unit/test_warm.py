"""pipeline/warm.py without a warm process: what keys one, and when a stage runs fresh."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pipeline import warm
from pipeline.errors import UserError

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
    assert warm._why_not("forward") == "the stage is not the __main__ module (`python -m` runs it so)"
    monkeypatch.setattr("sys._xoptions", {"importtime": True})
    assert warm._why_not("forward") == "the interpreter runs with -X options"


def test_a_socket_folder_too_long_is_refused_not_truncated(monkeypatch, tmp_path):
    """Every socket path under the folder fits Linux's 107 bytes, the longest pid included."""
    deep = tmp_path / ("d" * 90)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    with pytest.raises(OSError, match="too long a folder for a Unix socket"):
        warm.home()
    longest = "/" + "x" * (warm.SOCKET_DIR_MAX - len(f"/nexttoken-warm-{os.getuid()}") - 1)
    assert len(longest + f"/nexttoken-warm-{os.getuid()}") == warm.SOCKET_DIR_MAX
    assert len(f"{longest}/nexttoken-warm-{os.getuid()}/{'0' * 20}.sock.4194304") <= 107


def test_a_fresh_run_records_why():
    assert warm.record()["warm"] is False and warm.record()["why"]


@pytest.mark.parametrize("env,named", [({warm.SWITCH: "yes"}, "NEXTTOKEN_WARM='yes'"),
                                       ({warm.SWITCH: ""}, "NEXTTOKEN_WARM=''"),
                                       ({warm.IDLE_ENV: "soon"}, "NEXTTOKEN_WARM_IDLE_S='soon'"),
                                       ({warm.IDLE_ENV: "0"}, "NEXTTOKEN_WARM_IDLE_S='0'"),
                                       ({warm.IDLE_ENV: "nan"}, "NEXTTOKEN_WARM_IDLE_S='nan'"),
                                       ({warm.IDLE_ENV: "-5"}, "NEXTTOKEN_WARM_IDLE_S='-5'")])
def test_a_bad_setting_is_one_line_naming_it(env, named):
    with pytest.raises(UserError, match="is not allowed") as e:
        warm.settings(env)
    assert str(e.value).startswith(named) and "\n" not in str(e.value)


def test_the_settings_default_to_on_and_a_minute():
    assert warm.settings({}) == (True, 60.0)
    assert warm.settings({warm.SWITCH: "0", warm.IDLE_ENV: "2.5"}) == (False, 2.5)


def test_a_socket_folder_others_can_reach_is_refused(monkeypatch):
    base = Path(tempfile.mkdtemp(prefix="ntw-", dir="/tmp"))    # short enough for a socket
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
        d = warm.home()
        assert oct(d.stat().st_mode & 0o777) == "0o700"
        d.chmod(0o777)                   # another user could put a socket of theirs there
        with pytest.raises(OSError, match="not a folder of this user's alone"):
            warm.home()
        d.rmdir()
        d.symlink_to(base)               # a link to somewhere else
        with pytest.raises(OSError, match="not a folder of this user's alone"):
            warm.home()
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("argv,options", [(["python", "-m", "stages.forward"], []),
                                          (["python", "-u", "-W", "error", "-m", "stages.forward"],
                                           ["-u", "-W", "error"]),
                                          (["python", "-B", "-c", "pass"], ["-B"]),
                                          (["python", "script.py", "-u"], [])])
def test_the_interpreter_options_go_to_the_warm_process(monkeypatch, argv, options):
    monkeypatch.setattr("sys.orig_argv", argv)
    assert warm._options() == options
