"""Every stage loops over the run's prompts, one partition each (issue 17 items 2 and 3).

`prompt_set.for_config` still gives a set of one, so the second prompt is made by hand: the
session run's tokenize partition copied under another id and recorded in tokenize's manifest,
as a tokenize stage over a two-prompt set would have written it. forward -> trajectories then
run over both prompts (one model load per stage), and each prompt's files hold exactly the
numbers the single-prompt run holds: a prompt alone and inside a set give the same content.
"""

from __future__ import annotations

import json
import shutil

import pyarrow.compute as pc

from pipeline.store import paths, provenance
from pipeline.store.artifacts import read_dataset
from pipeline.tools import audit
from tests.conftest import CHAIN, copy_ws, run_module

TWIN = "twin.2"


def _content(path) -> str:
    """What identical means: the tensors / table content (metadata aside), else the bytes."""
    return provenance.logical_hash(path) or provenance.sha256_file(path)


def test_two_prompts_run_in_one_pass_each_equal_to_the_prompt_alone(tiny_workspace, tiny_chain, tmp_path):
    ws = copy_ws(tiny_workspace, tmp_path / "ws")
    (pid,) = paths.prompt_ids(paths.TOKENS, ws)
    manifest = json.loads(paths.manifest_path("tokenize", ws).read_text())
    for item in (paths.TOKENS, paths.TOKENIZE_SUMMARY):
        twin = paths.partition(item, TWIN, ws)
        twin.parent.mkdir(parents=True)
        shutil.copy2(paths.partition(item, pid, ws), twin)
        manifest["outputs"].append(provenance.file_record(twin, ws))
    paths.manifest_path("tokenize", ws).write_text(json.dumps(manifest, indent=2))
    for stage in CHAIN:
        run_module(f"stages.{stage}", ws, check=True)

    per_prompt = [i for i in paths.PER_PROMPT if i[0] in CHAIN]
    for item in per_prompt:
        assert paths.prompt_ids(item, ws) == sorted([pid, TWIN]), item
        alone = _content(paths.partition(item, pid, tiny_chain))
        for p in (pid, TWIN):
            assert _content(paths.partition(item, p, ws)) == alone, (item, p)
    outputs = {o["path"] for s in CHAIN for o in json.loads(paths.manifest_path(s, ws).read_text())["outputs"]}
    assert {paths.partition(i, p).as_posix() for i in per_prompt for p in (pid, TWIN)} <= outputs

    # the set reads as one table; a filter on prompt_id reads one prompt's rows
    whole = read_dataset(paths.LOGITS, ws)
    one = read_dataset(paths.LOGITS, ws, filter=pc.field("prompt_id") == TWIN)
    assert whole.num_rows == 2 * one.num_rows and set(one["prompt_id"].to_pylist()) == {TWIN}
    # the audit re-derives probs per partition
    result = audit.audit_folder(ws, "two prompts")
    assert any("re-derived" in n and "(2 prompt(s))" in n for n in result.notes), result.lines()
    assert result.clean, result.lines()
