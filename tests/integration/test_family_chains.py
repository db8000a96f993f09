"""Every family of `families.TINY_FAMILIES` through the whole chain on its seeded toy
(`model=tiny model.source.family=<model_type>`), in one process: every stage `dvc repro` runs
(`inprocess.CHAIN`, read from dvc.yaml), with conf/'s defaults but the tests' decode length; zero
failing error checks, the golden capture names, and facts.json saying what was captured."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from pipeline.model.families import GENERIC_TESTED, TINY_FAMILIES
from pipeline.store import paths, provenance
from tests.conftest import REPO, make_workspace
from tests.helpers.inprocess import CHAIN, run_chain
from tests.helpers.partitions import part
from tests.unit.test_families import GOLDEN

pytestmark = pytest.mark.slow
# These run the whole chain from a user's save_pretrained folder of the same toy (model=local) in
# tests/e2e/test_own_model.py, with the same assertions: not twice.
FROM_FOLDERS = ("cohere", "stablelm", "falcon")
# kind=tiny family=qwen2 is tiny_qwen2, weights byte for byte (the last test here), and tiny_qwen2 runs every
# stage in the session's tiny_chain, whose error checks (tests/integration/test_checks.py) and capture names
# (test_tiny_chain.py) are asserted there: not a third time.
ELSEWHERE = (*FROM_FOLDERS, "qwen2")


@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if f not in ELSEWHERE])
def test_family_chain(family, tmp_path):
    ws = make_workspace(tmp_path / "ws", ["model=tiny", f"model.source.family={family}"])
    shutil.copytree(REPO / "prompts", ws / "prompts")
    run_chain(ws)
    # every stage of dvc.yaml ran and committed its outputs (a stage added later is covered here too)
    assert all(paths.manifest_path(stage, ws).is_file() for stage in CHAIN), \
        [s for s in CHAIN if not paths.manifest_path(s, ws).is_file()]
    checks = pd.read_parquet(ws / "artifacts/checks/checks.parquet")
    failing = checks[(checks.severity == "error") & (checks.verdict != "pass")]
    assert failing.empty, failing[["name", "detail"]].to_string()
    facts = json.loads(part(paths.FORWARD_FACTS, ws).read_text())
    assert facts["model_type"] == family and list(facts["names"]) == GOLDEN[family]
    level = "residual" if family in GENERIC_TESTED else "full"
    assert facts["capture_level"] == level
    # the recomputes ran where the family has the pieces (and not where it has none)
    has_internals = checks.name.str.startswith("layer0_attention_").any()
    assert has_internals == (level == "full") and checks.name.eq("lm_head_recompute").any()
    assert (ws / "artifacts/report/report.md").is_file()


def test_tiny_qwen2_is_the_tiny_qwen2_model(tiny_workspace, tmp_path):
    """kind=tiny family=qwen2 builds tiny_qwen2's model: the same weights, byte for byte."""
    ws = make_workspace(tmp_path / "ws", ["model=tiny", "model.source.family=qwen2"])
    run_chain(ws, ("prepare_model",))
    weights = "artifacts/prepare_model/model.safetensors"
    assert provenance.sha256_file(ws / weights) == provenance.sha256_file(tiny_workspace / weights)
