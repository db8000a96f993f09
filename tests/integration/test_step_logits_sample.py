"""`sampling.step_logits`: a set stores the full step logits rows of a fixed sample of its prompts and
re-derives the others' bit for bit when read (issue 29: a set's disk per prompt).

A three-prompt set on tiny_qwen2 with `sampling.step_logits=1` (so only the run's first prompt stores
step_logits.parquet) and `checks.prompts=all` (so the checks re-derive the other two) runs tokenize ->
trajectories -> checks in this process; the same set with `sampling.step_logits=all` is the reference whose
files hold every row. Every re-derived row equals the stored one bit for bit; trajectories.json's sha256
rows prove it, and a wrong one is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.compute as pc
import pytest

from pipeline.errors import UserError
from pipeline.store import logits_io, paths
from pipeline.store.artifacts import read_manifest, read_parquet
from tests.conftest import REPO, TEST_STEPS, copy_ws
from tests.helpers.inprocess import run_chain

IDS = ("temperature_question", "temperature_question_en", "capital_france")
STAGES = ("validate", "tokenize", "forward", "logits", "probs", "trajectories", "checks")


def _set_run(tiny_workspace, dest, step_logits: str):
    from pipeline.tools import cli
    from tests.helpers import inprocess
    ws = copy_ws(tiny_workspace, dest)
    records = [json.loads(line) for line in (REPO / "prompts/concepts.jsonl").read_text(encoding="utf-8").splitlines()]
    (ws / "prompts").mkdir(exist_ok=True)
    (ws / "prompts/three.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records
                                                    if r["id"] in IDS), encoding="utf-8")
    with inprocess.cwd(ws):
        assert cli.main(["compose", TEST_STEPS, "capture.device=cpu", "model=tiny_qwen2",
                         "prompt.set=prompts/three.jsonl", f"sampling.step_logits={step_logits}",
                         "checks.prompts=all"]) in (0, None)
    run_chain(ws, STAGES)
    return ws


@pytest.fixture(scope="module")
def runs(tiny_workspace, tmp_path_factory):
    """(sampled: step_logits=1, every: step_logits=all), the same three-prompt set."""
    base = tmp_path_factory.mktemp("step_logits")
    return _set_run(tiny_workspace, base / "one", "1"), _set_run(tiny_workspace, base / "all", "all")


def test_only_the_sample_stores_its_rows_and_every_prompt_records_their_sha256(runs):
    one, every = runs
    first = min(IDS)
    assert paths.prompt_ids(paths.STEP_LOGITS, one) == [first]
    assert paths.prompt_ids(paths.STEP_LOGITS, every) == sorted(IDS)
    facts = read_manifest("trajectories", one)["prompt_facts"]
    assert {pid: f["step_logits"] for pid, f in facts.items()} == \
        {pid: "stored" if pid == first else "derived" for pid in IDS}
    for pid in IDS:     # the rest of the stage's files: byte for byte the all-stored run's, sha256 rows included
        for item in (paths.STEPS, paths.TRAJECTORIES):
            a, b = (paths.partition(item, pid, r) for r in (one, every))
            if item == paths.TRAJECTORIES:
                assert a.read_bytes() == b.read_bytes(), (pid, item)
            else:
                assert read_parquet(a).equals(read_parquet(b)), (pid, item)
        recorded = json.loads(paths.partition(paths.TRAJECTORIES, pid, every).read_text())
        stored = logits_io.read_step_logits(paths.partition(paths.STEP_LOGITS, pid, every))
        by_key = {(k["branch"], k["kv_cache"], k["step"]): logits_io.row_sha256(r) for k, _, r in stored}
        assert by_key == {(v["branch"], v["kv_cache"], i + 1): h for v in recorded.values()
                          for i, h in enumerate(v["step_logits_sha256"])}


def test_the_api_re_derives_an_unstored_prompts_rows_bit_for_bit(runs):
    from pipeline import api
    one, every = runs
    with api.open_run(one) as run, api.open_run(every) as ref:
        for pid in IDS:
            got, want = run.step_logits(pid), ref.step_logits(pid)
            assert got.keys() == want.keys() and len(got) == (4 + 4) * 4, pid   # (4 runs + conf/'s 4 what-if) x 4 steps
            for key in want:
                assert np.array_equal(got[key].view(np.uint32), want[key].view(np.uint32)), (pid, key)


def test_the_checks_check_re_derived_rows_as_stored_ones(runs):
    one, every = runs
    for ws in runs:
        checks = read_parquet(paths.artifact(paths.CHECKS, ws))
        assert read_manifest("checks", ws)["facts"]["prompts_checked"] == 3
        sha = checks.filter(pc.field("name") == "step_logits_sha256").to_pylist()
        assert [(r["prompt_id"], r["verdict"]) for r in sha] == [(pid, "pass") for pid in sorted(IDS)], ws
        failed = checks.filter(pc.field("verdict") != "pass").to_pylist()
        assert [r for r in failed if r["severity"] == "error"] == [], ws
    mine, ref = (read_parquet(paths.artifact(paths.CHECKS, ws)).select(["prompt_id", "name", "measured", "verdict"])
                 .to_pylist() for ws in runs)
    assert mine == ref          # re-derived or stored, the same checks with the same values


def test_a_wrong_recorded_sha256_is_refused_in_one_line(runs, tmp_path):
    from pipeline import api
    one, _ = runs
    ws = copy_ws(one, tmp_path / "ws")
    pid = "temperature_question"             # not stored: min(IDS), capital_france, is the sample of one
    path = paths.partition(paths.TRAJECTORIES, pid, ws)
    recorded = json.loads(path.read_text())
    recorded["greedy"]["step_logits_sha256"][2] = "0" * 64
    path.write_text(json.dumps(recorded))
    with api.open_run(ws, verify=False) as run, pytest.raises(UserError) as e:
        run.step_logits(pid)
    assert f"'{pid}'" in str(e.value) and "greedy step 3" in str(e.value) and "\n" not in str(e.value)
    from pipeline import kernels
    from pipeline.store import provenance
    here = kernels.cpu_key(provenance.kernel_path())        # the same machine: both sides name this one's kernels
    assert f"they were computed on CPU kernels {here}, these on CPU kernels {here}" in str(e.value), e.value


def test_checks_of_re_derived_rows_recorded_on_another_device_are_kernel_bound(runs, tmp_path):
    """Rows re-derived here rest on this machine's kernels: where the trajectories ran on another device, the
    hashes and the recorded greedy tokens vs the rows' argmax are reports, as every re-computation is; a stored
    prompt's rows are the recorded ones, so its checks stay errors."""
    from tests.integration.test_audit import RTX, forge, ran_on
    one, _ = runs
    ws = copy_ws(one, tmp_path / "ws")
    derived, stored = "temperature_question", min(IDS)
    for pid in (derived, stored):       # the checks read where trajectories ran from steps.parquet
        forge(ws, paths.partition(paths.STEPS, pid, ws).relative_to(ws).as_posix(), ran_on(RTX))
    run_chain(ws, ("checks",))
    rows = {(r["prompt_id"], r["name"]): r for r in read_parquet(paths.artifact(paths.CHECKS, ws)).to_pylist()}
    for name in ("step_logits_sha256", "greedy_tokens_argmax"):
        assert rows[(derived, name)]["severity"] == "report", rows[(derived, name)]
        assert "trajectories ran on cuda (NVIDIA GeForce RTX 3090)" in rows[(derived, name)]["detail"]
        assert rows[(stored, name)]["severity"] == "error", rows[(stored, name)]
        assert rows[(derived, name)]["verdict"] == rows[(stored, name)]["verdict"] == "pass"


def test_the_checks_fail_a_re_derived_row_whose_recorded_sha256_is_wrong(runs, tmp_path):
    """The checks' own re-derivation (not the API's) is held to the recorded sha256: one wrong hash of a derived
    prompt fails step_logits_sha256 as an error on the recording machine, naming the step."""
    from tests.integration.test_audit import forge
    one, _ = runs
    ws = copy_ws(one, tmp_path / "ws")
    pid = "temperature_question"             # derived: the sample of one is capital_france

    def wrong(path):
        recorded = json.loads(path.read_text())
        recorded["greedy"]["step_logits_sha256"][2] = "0" * 64
        path.write_text(json.dumps(recorded))
    forge(ws, paths.partition(paths.TRAJECTORIES, pid, ws).relative_to(ws).as_posix(), wrong)
    with pytest.raises(SystemExit) as e:
        run_chain(ws, ("checks",))
    assert e.value.code == 1                 # a failed check, not a crash
    rows = {(r["prompt_id"], r["name"]): r for r in read_parquet(paths.artifact(paths.CHECKS, ws)).to_pylist()}
    bad = rows[(pid, "step_logits_sha256")]
    assert (bad["verdict"], bad["severity"], bad["measured"]) == ("fail", "error", 1), bad
    assert "greedy step 3" in bad["detail"], bad
    assert all(rows[(p, "step_logits_sha256")]["verdict"] == "pass" for p in IDS if p != pid)
