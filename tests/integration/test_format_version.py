"""Every reader of a run's files refuses a run of another format_version in one line: audit, verify,
diff, sweep, the Python API and the stages that read earlier stages' outputs. A run made by other
code is audited by checking out that code (docs/reproducibility.md), not by special cases here."""

from __future__ import annotations

import json

import pytest

from pipeline import api
from pipeline.errors import UserError
from pipeline.store import paths, provenance
from pipeline.tools import audit, rundiff, sweep, verify
from tests.conftest import copy_ws, run_module

LINE = (r"^artifacts/forward/manifest\.json: format_version 1 is not this code's 4 \(nexttoken \S+"
        r"( at [0-9a-f]{12})?\): check out the nexttoken revision that made this run to read or audit it "
        r"\(git checkout [0-9a-f]{12}\)$")


@pytest.fixture(scope="module")
def old_format(tiny_chain, tmp_path_factory):
    """The session's chain with forward's manifest saying format 1 (what a run of other code records)."""
    run = copy_ws(tiny_chain, tmp_path_factory.mktemp("format") / "run")
    path = paths.manifest_path("forward", run)
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 1
    manifest["git"] = {"commit": "4de4265" + "0" * 33, "dirty": False}
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return run


def test_a_fresh_run_records_this_codes_format_in_every_manifest(tiny_chain):
    for stage in ("prepare_model", "tokenize", "forward", "logits", "probs", "trajectories"):
        manifest = json.loads(paths.manifest_path(stage, tiny_chain).read_text())
        assert manifest["format_version"] == provenance.FORMAT_VERSION == 4, stage
        assert "schema_version" not in manifest
        assert all("logical_hash_scheme" not in o for o in manifest["outputs"])


@pytest.mark.parametrize("read", [
    pytest.param(lambda run, other: audit.audit_folder(run, "run"), id="audit"),
    pytest.param(lambda run, other: verify.verify_folder(run, "run", list(verify.RERUN)), id="verify"),
    pytest.param(lambda run, other: rundiff.compare(run, other, "diff"), id="diff A"),
    pytest.param(lambda run, other: rundiff.compare(other, run, "diff"), id="diff B"),
    pytest.param(lambda run, other: sweep.prompt_figures(run), id="sweep"),
    pytest.param(lambda run, other: api.open_run(run), id="api"),
])
def test_every_tool_refuses_a_run_of_another_format_in_one_line(old_format, tiny_chain, read):
    with pytest.raises(UserError, match=LINE) as e:
        read(old_format, tiny_chain)
    assert "\n" not in str(e.value)


def test_a_stage_refuses_an_input_of_another_format(old_format, tmp_path):
    run = copy_ws(old_format, tmp_path / "run")
    proc = run_module("stages.logits", run)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("nexttoken logits: error: artifacts/forward/manifest.json: format_version 1 is not "
                           "this code's 4 (nexttoken "), proc.stderr
    assert line.endswith("(git checkout 4de426500000)")
