"""`nexttoken verify`, the kernel path in manifests, audit and diff, on tiny_qwen2 runs.

A fresh run verifies identical and verify changes nothing; the same run re-computed with the
kernels capped below AVX2 (a simulated other machine) differs, and verify names the kernel-path
fields and the first diverging tensor; a portable run reproduces under a cap at or above AVX2
and is refused (one line, exit 2) under a cap below it. `nexttoken diff` and `audit` show the
kernel path as a line of its own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline import kernels
from pipeline.errors import UserError
from pipeline.numerics import divergence
from pipeline.store import paths, provenance
from pipeline.tools import audit, rundiff, verify
from tests.conftest import copy_ws, run_module, snapshot
from tests.helpers.partitions import part
from tests.reliability.conftest import python_env

PORTABLE = ("forward", "logits", "probs")
BELOW_AVX2 = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
AT_OR_ABOVE_AVX2 = {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}


def _set_kernels(ws: Path, mode: str) -> None:
    params = yaml.safe_load((ws / paths.PARAMS).read_text())
    params["capture"]["kernels"] = mode
    (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))


def _chain(src: Path, dest: Path, mode: str, stages: tuple[str, ...], env: dict | None = None) -> Path:
    ws = copy_ws(src, dest)
    _set_kernels(ws, mode)
    for stage in stages:
        run_module(f"stages.{stage}", ws, check=True, env=env)
    return ws


@pytest.fixture(scope="module")
def native(tiny_chain, tmp_path_factory) -> Path:
    """The session's native chain, with the checks stage run too."""
    return _chain(tiny_chain, tmp_path_factory.mktemp("verify") / "native", "native", ("checks",))


@pytest.fixture(scope="module")
def portable(tiny_workspace, tmp_path_factory) -> Path:
    if kernels.portable_refusal(kernels.platform.machine(), kernels.cpu_flags(), {}):
        pytest.skip("capture.kernels=portable has no meaning on this machine")
    return _chain(tiny_workspace, tmp_path_factory.mktemp("verify") / "portable", "portable", PORTABLE)


def _verify(ws: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["nexttoken", "verify", *args], cwd=ws, capture_output=True, text=True, timeout=900,
                          env={**python_env(), **(env or {})})


def _everything(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_a_fresh_run_verifies_identical_and_nothing_changes(native):
    before, listed = snapshot(native), _everything(native)
    result = verify.verify(native)
    assert result.identical, "\n".join(result.lines)
    files = [ln for ln in result.lines if ln.startswith(("identical", "differs"))]
    # every output of forward..checks (vocab.parquet is tokenize's, which verify does not re-run), lens's two
    assert len(files) == 17 and all(ln.startswith("identical") for ln in files)
    assert result.lines[1].startswith("kernel path: same (native;")
    assert result.lines[-1].startswith("verdict: IDENTICAL")
    assert snapshot(native) == before and _everything(native) == listed


def test_a_file_the_run_did_not_record_is_a_difference(native, tmp_path):
    """One format_version: a file the re-run makes and the run's manifest does not list is a difference."""
    run = copy_ws(native, tmp_path / "old")
    rel = paths.artifact(paths.PROBS_PROMPT_METRICS).as_posix()
    (run / rel).unlink()
    m = json.loads(paths.manifest_path("probs", run).read_text())
    m["outputs"] = [o for o in m["outputs"] if o["path"] != rel]
    paths.manifest_path("probs", run).write_text(json.dumps(m, indent=2) + "\n")
    result = verify.verify_folder(run, "old", ["probs"])
    assert not result.identical and result.differing == ["probs/prompt_metrics.parquet"], "\n".join(result.lines)
    assert "differs   probs/prompt_metrics.parquet" in result.lines
    assert "probs prompt_metrics.parquet: not there then" in result.lines
    assert "identical probs/table/prompt_id=temperature_question/table.parquet" in result.lines


def test_kernels_capped_below_avx2_differ_and_verify_names_the_fields_and_tensor(native):
    proc = _verify(native, "--stages", "forward", "probs", env=BELOW_AVX2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "re-running forward, logits, probs" in out          # logits joins: it lies between them
    line = next(ln for ln in out.splitlines() if ln.startswith("kernel path:"))
    assert "-> DEFAULT" in line and "env.ATEN_CPU_CAPABILITY None -> default" in line \
        and "env.ONEDNN_MAX_CPU_ISA None -> SSE41" in line, line
    capture = part(paths.CAPTURE, native).relative_to(paths.stage_dir("forward", native)).as_posix()
    assert f"differs   forward/{capture}" in out
    assert re.search(r"capture: first diverging tensor \(forward order\) (embed|blocks\.\d+\.[\w.]+|final_norm_out"
                     r"|logits): max \|Δ\| [0-9.e-]+ at position \d+", out), out
    assert "top-1 id:" in out and "kept counts per filter (position, filter: then | now)" in out
    assert out.rstrip().endswith("artifact(s) differ")


def test_a_portable_run_reproduces_under_a_cap_at_or_above_avx2_and_refuses_one_below(portable):
    record = json.loads(paths.manifest_path("forward", portable).read_text())["kernels"]
    assert record["mode"] == "portable" and record["aten_cpu_capability"] == "AVX2"
    assert {k: record["env"][k] for k in kernels.PORTABLE_ENV} == kernels.PORTABLE_ENV
    assert record["torch_threads"] == kernels.PORTABLE_THREADS
    proc = _verify(portable, "--stages", "forward", "logits", "probs", env=AT_OR_ABOVE_AVX2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kernel path: same (portable;" in proc.stdout
    before = snapshot(portable)
    proc = _verify(portable, env=BELOW_AVX2)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "capture.kernels='portable' is not allowed on this machine: ATEN_CPU_CAPABILITY=default" in proc.stderr
    assert snapshot(portable) == before


def test_diff_of_a_native_and_a_portable_run_shows_the_kernel_path_and_first_tensor(tiny_workspace, portable,
                                                                                      tmp_path):
    other = _chain(tiny_workspace, tmp_path / "capped", "native", ("forward",), env=BELOW_AVX2)
    line = rundiff.kernel_line(other, portable)
    assert line.startswith("kernel path: ") and "mode native -> portable" in line \
        and "aten_cpu_capability DEFAULT -> AVX2" in line, line
    (pair,), _ = rundiff.prompt_pairs(other, portable)
    assert rundiff.capture_line(other, portable, *pair).startswith("capture: first diverging tensor (forward order) ")
    assert rundiff.capture_line(portable, portable, pair[1], pair[1]).startswith("capture: all ")


def test_audit_shows_a_kernel_path_difference_as_its_own_line(native, monkeypatch):
    here = {**provenance.kernel_path(), "aten_cpu_capability": "DEFAULT"}
    monkeypatch.setattr(provenance, "kernel_path", lambda: here)
    result = audit.audit(native)
    assert any(w.startswith("WARN kernel path: 1 field(s) differ (recorded -> auditing machine): "
                            "aten_cpu_capability") for w in result.warnings), result.lines()


def test_a_run_without_its_snapshot_is_refused_before_any_work(native, tmp_path):
    ws = copy_ws(native, tmp_path / "ws")
    shutil.rmtree(paths.stage_dir("prepare_model", ws))
    with pytest.raises(UserError, match=r"the run's model snapshot is missing"):
        verify.verify(ws)


def test_stage_selection():
    assert verify.selected(None) == list(verify.RERUN)
    assert verify.selected(["forward", "probs"]) == ["forward", "logits", "probs"]
    assert verify.selected(["trajectories", "checks"]) == ["trajectories", "checks"]
    assert verify.selected(["forward", "checks"]) == ["forward", "logits", "probs", "lens", "checks"]
    with pytest.raises(UserError, match=r"^--stages='tokenize' is not allowed: stages that compute: forward"):
        verify.selected(["tokenize"])


def test_recorded_kernels_prefer_the_forward_record():
    assert divergence.recorded_kernels({"probs": {"kernels": {"mode": "x"}}, "forward": {"kernels": {"mode": "y"}}}) \
        == {"mode": "y"}
    assert divergence.recorded_kernels({"forward": {}}) is None
    assert divergence.kernel_difference_line(None, {"mode": "native"}).endswith("(no stage there computed with "
                                                                                 "torch)")


def test_audit_finds_a_config_key_the_stage_reads_and_did_not_record():
    """One format_version: every key the stage reads is in its record; one recorded by one side only
    is a finding (no allowance for a run of older code: that code audits it)."""
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    old = {"probs": {"config": {"probs": {}, "sampling": sampling}}}
    result = audit.Audit("old run")
    audit.verify_config({"probs": {}, "sampling": sampling, "capture": {"kernels": "native"}}, old, result)
    assert result.findings == ["FINDING [config] probs: capture recorded '<absent>', params.yaml has "
                               "{'kernels': 'native'}"]
