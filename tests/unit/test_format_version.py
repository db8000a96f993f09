"""One `format_version` in every manifest; a manifest of another format (or none) is refused in one line
that names the version found, this code's version and commit, and the commit that made the run."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.errors import UserError
from pipeline.store import artifacts, paths, provenance
from pipeline.tools import revisions

REFUSAL = (r"^artifacts/forward/manifest\.json: format_version {found} is not this code's 4 \(nexttoken \S+"
           r"( at [0-9a-f]{{12}})?\): check out the nexttoken revision that made this run to read or audit it "
           r"\({checkout}\)$")


def _manifest(root, stage: str, **fields) -> None:
    path = paths.manifest_path(stage, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stage": stage, "outputs": [], **fields}))


def test_this_code_writes_and_reads_format_4(tmp_path):
    assert provenance.FORMAT_VERSION == 4
    _manifest(tmp_path, "forward", format_version=4, git={"commit": "a" * 40})
    assert artifacts.read_manifest("forward", tmp_path)["format_version"] == 4
    assert list(revisions.load_manifests(tmp_path)) == ["forward"]


@pytest.mark.parametrize(("fields", "found", "checkout"), [
    ({"schema_version": 1, "git": {"commit": "4de4265" + "0" * 33}}, "none", "git checkout 4de426500000"),
    ({"format_version": 1, "git": {"commit": "b" * 40}}, "1", "git checkout " + "b" * 12),
    ({"format_version": 2, "git": {"commit": "c" * 40}}, "2", "git checkout " + "c" * 12),
    ({"format_version": 3, "git": {"commit": "d" * 40}}, "3", "git checkout " + "d" * 12),
    ({"format_version": 5, "git": {"commit": None}}, "5", "the manifest records no commit"),
    ({"format_version": "4"}, "'4'", "the manifest records no commit"),
])
def test_a_manifest_of_another_format_is_one_line_naming_both_versions(tmp_path, fields, found, checkout):
    _manifest(tmp_path, "forward", **fields)
    pattern = REFUSAL.format(found=re.escape(found), checkout=re.escape(checkout))
    for read in (lambda: artifacts.read_manifest("forward", tmp_path), lambda: revisions.load_manifests(tmp_path)):
        with pytest.raises(UserError, match=pattern) as e:
            read()
        assert "\n" not in str(e.value)


def test_the_refusal_names_this_codes_nexttoken_version(tmp_path):
    _manifest(tmp_path, "forward", format_version=1)
    with pytest.raises(UserError) as e:
        artifacts.read_manifest("forward", tmp_path)
    assert f"(nexttoken {provenance.importlib.metadata.version('nexttoken')}" in str(e.value)


def test_a_file_that_is_no_manifest_is_refused_as_such(tmp_path):
    path = paths.manifest_path("forward", tmp_path)
    path.parent.mkdir(parents=True)
    for text in ("[1, 2]", '{"format_version": 4}'):
        path.write_text(text)
        with pytest.raises(UserError, match=r"^artifacts/forward/manifest\.json is not a stage manifest "
                                            r"\(no `outputs` list; corrupt\?\): re-run `dvc repro`$"):
            artifacts.read_manifest("forward", tmp_path)


def test_a_stage_refuses_an_input_of_another_format(tmp_path):
    """What every stage does before reading an earlier stage's output (StageRun.use -> its manifest)."""
    out = tmp_path / "artifacts/forward/facts.json"
    out.parent.mkdir(parents=True)
    out.write_text("{}")
    _manifest(tmp_path, "forward", format_version=1, git={"commit": "c" * 40})
    run = artifacts.StageRun("logits", tmp_path, {})
    try:
        with pytest.raises(UserError, match=REFUSAL.format(found="1", checkout="git checkout " + "c" * 12)):
            run.use(tmp_path / "artifacts/forward")
    finally:
        run.discard()
