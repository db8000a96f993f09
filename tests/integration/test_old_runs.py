"""Runs recorded by older code stay auditable: logical hash scheme 1, vocab.parquet in logits/.

The run is made by the code of OLD_COMMIT itself (`git archive` of it, its stages run with this
interpreter; `python -m` puts that tree first on sys.path), then audited by this code. The
checks stage is left out: re-deriving verdicts compares one code's checks with another's, which
is what the audit's code-change warning is about, not what this test is about.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from pipeline.store import paths, provenance
from pipeline.tools import audit
from tests.conftest import REPO, run_module

OLD_COMMIT = "4de4265"          # main before logical hash scheme 2 and before vocab.parquet moved to tokenize
OLD_STAGES = ("prepare_model", "tokenize", "forward", "logits", "probs", "trajectories", "report")


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """A tiny_qwen2 run made by OLD_COMMIT's code, without dvc.yaml (its stages run directly)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD_COMMIT], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"git history with {OLD_COMMIT} is not available here: {archive.stderr.decode()[:200]}")
    root = tmp_path_factory.mktemp("old") / "run"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    (root / "dvc.yaml").unlink()
    run_module("pipeline.tools.cli", root, "compose", "model=tiny_qwen2", check=True)
    for stage in OLD_STAGES:
        run_module(f"stages.{stage}", root, check=True)
    return root


@pytest.mark.slow
def test_audit_passes_on_a_run_made_before_scheme_2(old_run):
    manifests = {s: json.loads(paths.manifest_path(s, old_run).read_text()) for s in OLD_STAGES}
    logical = [o for m in manifests.values() for o in m["outputs"] if "logical_sha256" in o]
    assert logical and all(provenance.recorded_scheme(o) == 1 for o in logical)   # it is an old run
    assert (old_run / "artifacts/logits/vocab.parquet").exists()
    result = audit.audit_folder(old_run, "old run")
    assert result.clean, "\n".join(result.lines())
    assert any("re-derived" in n for n in result.notes)


@pytest.mark.slow
def test_audit_of_an_old_run_still_sees_a_changed_table(old_run, tmp_path):
    """The scheme-1 path is a real check: a table whose values changed is found (its sha256 too)."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq
    run = tmp_path / "run"
    shutil.copytree(old_run, run, symlinks=True)
    path = paths.recorded(paths.TOKENS, None, run)          # flat: made before partitions
    table = pq.read_table(path)
    pq.write_table(table.set_column(1, "token_id", pa.array([0] * table.num_rows, pa.int32())), path)
    out = next(o for o in json.loads(paths.manifest_path("tokenize", run).read_text())["outputs"]
               if o["path"].endswith("tokens.parquet"))
    assert provenance.logical_matches(path, out) is False
    lines = audit.audit_folder(run, "old run, edited").lines()
    assert any("tokens.parquet" in line and "FINDING" in line for line in lines), lines


@pytest.mark.slow
def test_verify_of_a_run_recorded_before_partitions_is_one_clear_line(old_run):
    """verify re-runs with this code, which writes partitions: nothing would compare, so it says why."""
    from pipeline.errors import UserError
    from pipeline.tools import verify
    assert paths.run_prompt_ids(old_run) == [None]          # flat files: made before partitions
    with pytest.raises(UserError, match=r"^old run was recorded before per-prompt partitions \(issue 17\): .*"
                                        r"`nexttoken audit` checks it as it is$"):
        verify.verify_folder(old_run, "old run", list(verify.RERUN))
