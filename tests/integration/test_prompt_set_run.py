"""A real two-prompt set (`prompt.set`) through tokenize -> checks on tiny_qwen2 (issue 17 items 3 and 5).

The set holds the reference prompt (the text of the single-prompt session run) and a short English
one. Each stage runs once over both; the reference prompt's files in the set hold exactly the
numbers of the same prompt run alone; checks.parquet holds every check once per prompt, and a
wrong number in one prompt's files fails the stage naming that prompt.
"""

from __future__ import annotations

import json
import shutil

import pyarrow.compute as pc
import pytest

from pipeline.checks import verdicts
from pipeline.store import paths, provenance
from pipeline.store.artifacts import read_parquet
from tests.conftest import CHAIN, REPO, TEST_STEPS, copy_ws, run_module
from tests.integration.test_checks import rewrite

REFERENCE, OTHER = "temperature_question", "capital_france"


def _content(path) -> str:
    """What identical means: the tensors / table content (metadata aside), else the bytes."""
    return provenance.logical_hash(path) or provenance.sha256_file(path)


@pytest.fixture(scope="module")
def set_run(tiny_workspace, tmp_path_factory):
    """tiny_workspace recomposed with a two-prompt set from prompts/concepts.jsonl, run tokenize -> checks."""
    ws = copy_ws(tiny_workspace, tmp_path_factory.mktemp("set_run") / "ws")
    records = [json.loads(line) for line in (REPO / "prompts/concepts.jsonl").read_text(encoding="utf-8").splitlines()]
    pair = [r for r in records if r["id"] in (REFERENCE, OTHER)]
    (ws / "prompts").mkdir(exist_ok=True)
    (ws / "prompts/pair.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pair),
                                           encoding="utf-8")
    # the user's command of issue 27, `nexttoken compose model=tiny_qwen2 prompt.set=prompts/mine.jsonl && dvc repro`:
    # the set replaces conf/'s default text (no prompt=concepts, no prompt.text=null)
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "capture.device=cpu", "model=tiny_qwen2",
               "prompt.set=prompts/pair.jsonl", check=True)
    for stage in ("tokenize", *CHAIN):
        run_module(f"stages.{stage}", ws, check=True)
    checks = run_module("stages.checks", ws)
    return ws, checks


def test_a_prompt_alone_and_inside_a_set_hold_identical_numbers(set_run, tiny_chain):
    ws, _ = set_run
    (alone_id,) = paths.prompt_ids(paths.TOKENS, tiny_chain)
    derived = (paths.TABLE, paths.FILTERED)         # a set's are derived (probs.table=auto): the test below
    for item in [i for i in paths.PER_PROMPT if i[0] in ("tokenize", *CHAIN) and i not in derived]:
        assert paths.prompt_ids(item, ws) == sorted([REFERENCE, OTHER]), item
        mine, alone = paths.partition(item, REFERENCE, ws), paths.partition(item, alone_id, tiny_chain)
        if item == paths.TOKENIZE_SUMMARY:      # the run's name (a set's is its file's stem) aside
            assert {**json.loads(mine.read_text()), "prompt_name": None, "prompt_id": None} == \
                {**json.loads(alone.read_text()), "prompt_name": None, "prompt_id": None}
        else:
            assert _content(mine) == _content(alone), item
    for item in (paths.PROBS_PROMPT_METRICS, paths.TRAJECTORY_PROMPT_METRICS):
        alone = read_parquet(paths.artifact(item, tiny_chain)).drop_columns(["prompt_id"]).to_pylist()
        mine = read_parquet(paths.artifact(item, ws)).filter(pc.field("prompt_id") == REFERENCE)
        assert mine.drop_columns(["prompt_id"]).to_pylist() == alone, item


def test_a_sets_tables_are_derived_bit_for_bit_as_the_prompt_alone_stores_them(set_run, tiny_chain):
    """probs.table=auto: a set writes no table.parquet nor filtered.parquet (issue 29); every reader
    re-derives them from logits.parquet, and for the reference prompt they are the files the single-prompt
    run stored."""
    from pipeline import api
    from pipeline.numerics import probs
    from pipeline.store.artifacts import read_manifest
    from pipeline.tools.rundiff import table_difference
    ws, _ = set_run
    manifest = read_manifest("probs", ws)
    assert manifest["facts"]["table"] == "derived" and paths.prompt_ids(paths.TABLE, ws) == []
    for item in (paths.TABLE, paths.FILTERED):      # DVC's outs: each folder holds a note saying how to read it
        assert json.loads((paths.dataset(item, ws) / "derived.json").read_text())["stored"] is False
    assert paths.prompt_ids(paths.FILTERED, ws) == []
    assert not [o for o in manifest["outputs"] if o["path"].endswith((paths.TABLE[1], paths.FILTERED[1]))]
    assert read_manifest("probs", tiny_chain)["facts"]["table"] == "stored"
    (alone_id,) = paths.prompt_ids(paths.TOKENS, tiny_chain)
    for item in (paths.TABLE, paths.FILTERED):
        stored = read_parquet(paths.partition(item, alone_id, tiny_chain))
        assert table_difference(stored, probs.read_table(paths.lookup(ws), REFERENCE, manifest, item)) is None
    stored = read_parquet(paths.partition(paths.TABLE, alone_id, tiny_chain))
    text = ["piece", "piece_text"]      # the API adds each id's text from vocab.parquet (docs/api.md)
    with api.open_run(ws) as run:
        frame = run.probs(REFERENCE)
        assert frame.drop(columns=text).equals(stored.to_pandas())
        assert len(run.probs(OTHER)) == len(frame)
        assert run.filtered(REFERENCE).drop(columns=text).equals(read_parquet(paths.partition(
            paths.FILTERED, alone_id, tiny_chain)).to_pandas())
        steps = run.step_logits(OTHER)
        assert len(steps) == len(read_parquet(paths.partition(paths.STEPS, OTHER, ws)))


def test_the_checks_stage_checks_every_prompt_and_says_which(set_run):
    ws, proc = set_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks over 2 prompts" in proc.stdout
    table = read_parquet(paths.artifact(paths.CHECKS, ws))
    assert table.column_names[0] == "prompt_id"
    rows = verdicts.stored_rows(table)
    names = {pid: {n for p, n in rows if p == pid} for pid in (REFERENCE, OTHER)}
    # the same suite per prompt; the reference figures only where the prompt is the reference's, and the
    # expected ids where the record gives them
    only = names[REFERENCE] - names[OTHER]
    assert "ref_token_ids" in only and all(n.startswith("ref_") or n == "tokenizer_expected_ids" for n in only)
    assert names[OTHER] <= names[REFERENCE] and "logits_file_exact" in names[OTHER]
    assert not [k for k, r in rows.items() if r["severity"] == "error" and r["verdict"] == "fail"]
    metrics = json.loads(paths.artifact(paths.METRICS, ws).read_text())
    assert metrics["checks"] == len(rows) and metrics["failing_prompts"] == "none"


def test_a_wrong_number_in_one_prompt_fails_the_stage_naming_that_prompt(set_run, tmp_path):
    ws = copy_ws(set_run[0], tmp_path / "ws")
    logits = paths.partition(paths.LOGITS, OTHER, ws)

    def flip(v):        # position 0: no table or trajectory reads it, so only the file check sees it
        v[42] += 0.25
    rewrite(logits, tmp_path / "l.parquet", "logit", flip).replace(logits)
    for manifest_path in (ws / "artifacts").glob("*/manifest.json"):   # recorded faithfully: only a check sees it
        manifest = json.loads(manifest_path.read_text())
        for rec in manifest["outputs"] + manifest["inputs"]:
            if rec["path"] == paths.partition(paths.LOGITS, OTHER).as_posix():
                rec["sha256"] = provenance.sha256_file(logits)
        manifest_path.write_text(json.dumps(manifest))
    shutil.rmtree(paths.stage_dir("checks", ws))
    proc = run_module("stages.checks", ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"error checks failed: logits_file_exact (prompt {OTHER}) " in proc.stderr, proc.stderr
    rows = verdicts.stored_rows(read_parquet(paths.artifact(paths.CHECKS, ws)))
    failed = sorted(k for k, r in rows.items() if r["verdict"] == "fail" and r["severity"] == "error")
    assert failed == [(OTHER, "logits_file_exact")] and rows[(OTHER, "logits_file_exact")]["measured"] == 0.25
    assert rows[(REFERENCE, "logits_file_exact")]["verdict"] == "pass"
    assert json.loads(paths.artifact(paths.METRICS, ws).read_text())["failing_prompts"] == OTHER


def test_duckdb_reads_the_set_as_one_table_and_a_prompt_filter_opens_one_file(set_run):
    duckdb = pytest.importorskip("duckdb")
    ws, _ = set_run
    source = f"read_parquet('{paths.dataset(paths.LOGITS, ws).as_posix()}/*/*.parquet', hive_partitioning = true)"
    counts = dict(duckdb.sql(f"select prompt_id, count(*) from {source} group by 1").fetchall())
    assert set(counts) == {REFERENCE, OTHER}
    assert counts[OTHER] == len(read_parquet(paths.partition(paths.LOGITS, OTHER, ws), columns=["logit"]))

    def profile(where: str) -> str:
        return duckdb.sql(f"explain analyze select max(logit) from {source} where {where}").fetchall()[0][1]
    one = profile(f"prompt_id = '{OTHER}' and position = 2")
    assert "Total Files Read: 1" in one and "Row Groups Scanned: 1 /" in one, one   # file, then row group
    assert "Total Files Read: 2" in profile("position = 2")


def test_the_audit_of_a_set_re_derives_every_prompt_and_is_clean(set_run):
    from pipeline.tools import audit
    ws, _ = set_run
    result = audit.audit_folder(ws, "two-prompt set")
    assert result.clean, result.lines()
    assert any("re-derived" in n and "(2 prompt(s))" in n and "metrics.json" in n for n in result.notes), result.notes
    assert any(n.startswith("re-ran ") and "checks" in n for n in result.notes), result.notes


def test_the_checks_read_each_prompts_own_kernel_path(set_run, tmp_path):
    """Issue 29: a cluster of different CPUs mixes kernel paths, so the checks' severities read the one each prompt
    was computed with. The forward manifest records OTHER as computed on an AVX-512 node of a Ray cluster: its
    recomputes against this process's kernels become reports saying why; the reference prompt's stay errors."""
    from pipeline import kernels
    ws = copy_ws(set_run[0], tmp_path / "ws")
    path = paths.manifest_path("forward", ws)
    manifest = json.loads(path.read_text())
    here = kernels.cpu_key(manifest["kernels"])
    other = {"node": "node-b", "device": "cpu", "kernel_mode": "native", "aten_cpu_capability": "AVX512",
             "cpu_flags": ["avx2", "fma", "avx512f", "avx512bw"]}
    assert kernels.cpu_key(other) != here
    manifest["executor"] = {"kind": "ray", "prompts": {OTHER: other}}
    path.write_text(json.dumps(manifest))
    shutil.rmtree(paths.stage_dir("checks", ws))
    proc = run_module("stages.checks", ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = verdicts.stored_rows(read_parquet(paths.artifact(paths.CHECKS, ws)))
    assert rows[(REFERENCE, "lm_head_recompute")]["severity"] == "error"
    moved = rows[(OTHER, "lm_head_recompute")]
    assert moved["severity"] == "report" and "forward ran on CPU kernels ATen AVX512" in moved["detail"], moved
    assert f"this check on {here}" in moved["detail"]


def test_checks_prompts_checks_a_fixed_sample_and_the_manifest_says_how_many(set_run, tmp_path):
    """checks.prompts=1 on the pair: the sample of one is the prompt the reference figures are compared on, every
    row of checks.parquet is that prompt's, and the manifest records 1 of 2 checked."""
    import yaml
    ws = copy_ws(set_run[0], tmp_path / "ws")
    params = yaml.safe_load((ws / paths.PARAMS).read_text(encoding="utf-8"))
    params["checks"]["prompts"] = 1
    (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False), encoding="utf-8")
    shutil.rmtree(paths.stage_dir("checks", ws))
    proc = run_module("stages.checks", ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = verdicts.stored_rows(read_parquet(paths.artifact(paths.CHECKS, ws)))
    assert {pid for pid, _ in rows} == {REFERENCE} and "ref_token_ids" in {n for _, n in rows}
    everything = verdicts.stored_rows(read_parquet(paths.artifact(paths.CHECKS, set_run[0])))
    assert {n for p, n in everything if p == REFERENCE} == {n for _, n in rows}
    facts = json.loads(paths.manifest_path("checks", ws).read_text())["facts"]
    assert (facts["prompts_checked"], facts["prompts"]) == (1, 2)
    assert list(json.loads(paths.manifest_path("checks", ws).read_text())["prompt_seconds"]) == [REFERENCE]
