"""The one dataset layout: per-prompt files in Hive partitions, read as one table (issue 17 item 2)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

from pipeline.errors import UserError
from pipeline.store import artifacts, paths, provenance


def test_the_path_rule_puts_a_per_prompt_file_in_its_prompts_partition(tmp_path):
    assert paths.partition(paths.LOGITS, "q1", tmp_path) == \
        tmp_path / "artifacts/logits/logits/prompt_id=q1/logits.parquet"
    assert paths.partition(paths.CAPTURE, "q1") == Path("artifacts/forward/capture/prompt_id=q1/capture.safetensors")
    assert paths.partition(paths.TOKENIZE_SUMMARY, "a.b-c") == \
        Path("artifacts/tokenize/tokenize/prompt_id=a.b-c/tokenize.json")
    assert paths.dataset(paths.TABLE, tmp_path) == tmp_path / "artifacts/probs/table"
    assert paths.artifact(paths.VOCAB) == Path("artifacts/tokenize/vocab.parquet")     # set-level: no partition
    with pytest.raises(ValueError, match="one file per prompt"):
        paths.artifact(paths.LOGITS)
    with pytest.raises(ValueError, match="one file per run"):
        paths.partition(paths.VOCAB, "q1")
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="cannot name a partition folder"):
            paths.partition(paths.LOGITS, bad)
    # every per-prompt item has its own dataset folder: two never share one
    folders = [paths.dataset(i) for i in paths.PER_PROMPT]
    assert len(set(folders)) == len(folders)


def _two_prompt_logits(root: Path) -> None:
    """A logits stage run writing two prompts' partitions, with rows that tell them apart."""
    with artifacts.stage_run("logits", {}, root) as run:
        for pid, base in (("alpha", 0.0), ("beta", 10.0)):
            table = pa.table({"position": pa.array([0, 0, 1], pa.int32()), "token_id": pa.array([0, 1, 0], pa.int32()),
                              "logit": pa.array([base, base + 1, base + 2], pa.float32())})
            run.write_parquet(paths.LOGITS[1], table, prompt_id=pid)


def test_a_stage_writes_partitions_and_its_manifest_lists_each_with_its_hash(tmp_path):
    _two_prompt_logits(tmp_path)
    m = json.loads(paths.manifest_path("logits", tmp_path).read_text())
    assert [o["path"] for o in m["outputs"]] == [paths.partition(paths.LOGITS, p).as_posix() for p in ("alpha", "beta")]
    for o in m["outputs"]:
        assert o["sha256"] == provenance.sha256_file(tmp_path / o["path"])
    assert paths.prompt_ids(paths.LOGITS, tmp_path) == ["alpha", "beta"]
    # no prompt_id column in the files: it lives in the path only
    import pyarrow.parquet as pq
    assert "prompt_id" not in pq.read_schema(paths.partition(paths.LOGITS, "alpha", tmp_path)).names


def test_use_verifies_a_partition_and_refuses_a_stray_or_changed_one(tmp_path):
    _two_prompt_logits(tmp_path)
    with artifacts.stage_run("probs", {}, tmp_path) as run:
        run.use(paths.LOGITS, "beta")
    (inp,) = json.loads(paths.manifest_path("probs", tmp_path).read_text())["inputs"]
    assert inp["path"] == "artifacts/logits/logits/prompt_id=beta/logits.parquet"
    stray = paths.partition(paths.LOGITS, "gamma", tmp_path)
    stray.parent.mkdir()
    shutil.copy(paths.partition(paths.LOGITS, "beta", tmp_path), stray)
    with pytest.raises(UserError, match="prompt_id=gamma/logits.parquet is not a partition the recorded run"), \
            artifacts.stage_run("probs", {}, tmp_path) as run:
        run.use(paths.LOGITS, "gamma")
    shutil.copy(paths.partition(paths.LOGITS, "alpha", tmp_path), paths.partition(paths.LOGITS, "beta", tmp_path))
    with pytest.raises(UserError, match="prompt_id=beta/logits.parquet was not produced by the recorded run"), \
            artifacts.stage_run("probs", {}, tmp_path) as run:
        run.use(paths.LOGITS, "beta")


def test_read_dataset_gives_one_table_with_prompt_id_and_prunes_on_it(tmp_path):
    _two_prompt_logits(tmp_path)
    whole = artifacts.read_dataset(paths.LOGITS, tmp_path)
    assert whole.num_rows == 6 and whole.schema.field("prompt_id").type == pa.string()
    beta = artifacts.read_dataset(paths.LOGITS, tmp_path, filter=pc.field("prompt_id") == "beta")
    assert set(beta["prompt_id"].to_pylist()) == {"beta"} and beta["logit"].to_pylist() == [10.0, 11.0, 12.0]
    hive = ds.partitioning(pa.schema([("prompt_id", pa.string())]), flavor="hive")
    fragments = ds.dataset(paths.dataset(paths.LOGITS, tmp_path), format="parquet", partitioning=hive) \
        .get_fragments(filter=pc.field("prompt_id") == "beta")
    assert [Path(f.path).parent.name for f in fragments] == ["prompt_id=beta"]     # one file opened
    with pytest.raises(UserError, match="holds no partition"):
        artifacts.read_dataset(paths.TABLE, tmp_path)


def test_duckdb_reads_the_partitions_as_one_table_and_a_prompt_filter_reads_one_file(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    _two_prompt_logits(tmp_path)
    glob = (paths.dataset(paths.LOGITS, tmp_path) / "*" / "*.parquet").as_posix()
    scan = f"read_parquet('{glob}', hive_partitioning = true)"
    con = duckdb.connect()
    rows = con.sql(f"select prompt_id, count(*), max(logit) from {scan} group by prompt_id order by 1").fetchall()
    assert rows == [("alpha", 3, 2.0), ("beta", 3, 12.0)]
    assert con.sql(f"select logit from {scan} where prompt_id = 'beta' and position = 1").fetchall() == [(12.0,)]
    plan = "\n".join(str(r[-1]) for r in con.sql(
        f"explain analyze select logit from {scan} where prompt_id = 'beta'").fetchall())
    files = [int(n) for n in re.findall(r"Scanning Files:\s*(\d+)/(\d+)", plan)[0]]
    assert files == [1, 2], plan      # the filter on prompt_id opened one partition of two
