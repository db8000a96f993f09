"""Atomic stage outputs, manifests and the provenance fields."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import yaml

from pipeline.errors import UserError
from pipeline.store import artifacts, ledger, paths, provenance, readers

MANIFEST_FIELDS = {"format_version", "stage", "config", "config_sha256", "seeds", "model", "facts", "inputs",
                   "outputs", "libraries", "hardware", "determinism", "git", "python_executable", "command",
                   "created_at", "duration_s", "prompt_seconds"}


def _table():
    return pa.table({"a": pa.array([1, 2, 3], pa.int32()), "b": pa.array([0.5, 1.5, 2.5])})


def test_manifest_records_every_field_and_true_hashes(tmp_path):
    import torch  # noqa: F401  the manifest describes torch once a stage has loaded it (not before: issue 16)
    src = tmp_path / "artifacts" / "prepare_model"
    src.mkdir(parents=True)
    (src / "source.json").write_text("{}")
    with artifacts.stage_run("tokenize", {"prompt": {"text": "x"}}, tmp_path) as run:
        run.use(paths.SOURCE)
        run.seeds["sample"] = 7
        run.write_parquet("t.parquet", _table())
        run.write_json("s.json", {"k": 1})
    m = json.loads((tmp_path / "artifacts/tokenize/manifest.json").read_text())
    assert set(m) >= MANIFEST_FIELDS
    assert m["stage"] == "tokenize" and m["seeds"] == {"sample": 7}
    assert m["inputs"] == [{k: v for k, v in provenance.file_record(src / "source.json", tmp_path).items()
                            if k in ("path", "bytes", "sha256")}]   # no producer manifest: hashed here
    assert {o["path"] for o in m["outputs"]} == {"artifacts/tokenize/t.parquet", "artifacts/tokenize/s.json"}
    for o in m["outputs"]:
        assert o["sha256"] == provenance.sha256_file(tmp_path / o["path"])
    parquet = next(o for o in m["outputs"] if o["path"].endswith(".parquet"))
    assert parquet["logical_sha256"] == provenance.logical_hash(tmp_path / parquet["path"])
    for key in ("torch", "transformers", "pyarrow", "dvc", "hydra-core", "python"):
        assert m["libraries"][key]
    assert m["hardware"]["cpu_cores"] >= 1 and "cuda_available" in m["hardware"]
    assert artifacts.parquet_facts(tmp_path / "artifacts/tokenize/t.parquet")["stage"] == "tokenize"


def test_failed_stage_leaves_previous_output_and_no_staging(tmp_path):
    with artifacts.stage_run("tokenize", {}, tmp_path) as run:
        run.write_json("s.json", {"v": 1})
    with pytest.raises(RuntimeError), artifacts.stage_run("tokenize", {}, tmp_path) as run:
        run.write_json("s.json", {"v": 2})
        raise RuntimeError("boom")
    assert json.loads((tmp_path / "artifacts/tokenize/s.json").read_text()) == {"v": 1}
    assert not any((tmp_path / paths.STAGING).iterdir())


def test_missing_input_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="artifacts/prepare_model/source.json is missing"), \
            artifacts.stage_run("tokenize", {}, tmp_path) as run:
        run.use(paths.SOURCE)
    assert not (tmp_path / "artifacts/tokenize").exists()


def test_parquet_writes_are_deterministic(tmp_path):
    hashes = []
    for _ in range(2):
        with artifacts.stage_run("tokenize", {"c": 1}, tmp_path) as run:
            run.write_parquet("t.parquet", _table())
        hashes.append(provenance.sha256_file(tmp_path / "artifacts/tokenize/t.parquet"))
    assert hashes[0] == hashes[1]


def test_logical_hash_ignores_metadata_but_not_values(tmp_path):
    import pyarrow.parquet as pq
    t = _table()
    pq.write_table(t, tmp_path / "a.parquet")
    pq.write_table(t.replace_schema_metadata({"x": "y"}), tmp_path / "b.parquet", compression="zstd")
    pq.write_table(t.set_column(1, "b", pa.array([0.5, 1.5, 2.25])), tmp_path / "c.parquet")
    la, lb, lc = (provenance.logical_hash(tmp_path / f"{n}.parquet") for n in "abc")
    assert la == lb != lc


def test_safetensors_logical_hash_sees_one_changed_element(tmp_path):
    import torch
    from safetensors.torch import save_file
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    save_file({"x": x}, tmp_path / "a.safetensors", metadata={"m": "1"})
    save_file({"x": x}, tmp_path / "b.safetensors")
    y = x.clone()
    y[1, 2] = 99
    save_file({"x": y}, tmp_path / "c.safetensors")
    ha, hb, hc = (provenance.logical_hash(tmp_path / f"{n}.safetensors") for n in "abc")
    assert ha == hb != hc


def test_corrupt_files_give_clear_errors(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match="bad.parquet is not a readable Parquet file"):
        artifacts.read_parquet(tmp_path / "bad.parquet")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(UserError, match="bad.json is not valid JSON"):
        artifacts.read_json(tmp_path / "bad.json")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(UserError, match="bad.safetensors is not a readable safetensors file"):
        artifacts.read_safetensors(tmp_path / "bad.safetensors")


def test_the_swap_keeps_the_gitignore_dvc_keeps_in_the_stage_folder(tmp_path):
    """For a stage whose outs are files, DVC keeps artifacts/<stage>/.gitignore (committed to
    git). Replacing the folder deleted it, so after a failed `dvc exp run` git showed it deleted
    and the outputs untracked (`git add -A` would commit them)."""
    folder = tmp_path / "artifacts/checks"
    folder.mkdir(parents=True)
    (folder / ".gitignore").write_text("/checks.parquet\n/manifest.json\n")
    with artifacts.stage_run("checks", {}, tmp_path) as run:
        run.write_parquet("checks.parquet", _table())
    assert (folder / ".gitignore").read_text() == "/checks.parquet\n/manifest.json\n"
    recorded = json.loads((folder / paths.MANIFEST).read_text())["outputs"]
    assert [o["path"] for o in recorded] == ["artifacts/checks/checks.parquet"]   # not an output


def _run_checks_on(tmp_path) -> None:
    with artifacts.stage_run("checks", {}, tmp_path) as run:
        run.use(paths.TABLE, "q")
        run.write_json("metrics.json", {})


def test_an_input_made_with_another_config_is_named_stale(tmp_path):
    """`python -m stages.checks` after params.yaml changed (and validate wrote probs' config from it) and
    probs did not re-run: the input is refused as stale, naming the stage and the key, before any check
    blames the numbers."""
    sampling, capture = {"temperature": 1.0, "top_k": 0, "top_p": 0.9}, {"kernels": "native"}
    config = {"probs": {"top_n": 3}, "sampling": sampling, "capture": capture}
    validated = paths.validated("probs", tmp_path)
    validated.parent.mkdir(parents=True)
    validated.write_text(json.dumps(config))
    with artifacts.stage_run("probs", config, tmp_path) as run:
        run.write_parquet(paths.TABLE[1], _table(), prompt_id="q")
    _run_checks_on(tmp_path)                                          # in step: fine
    changed = {**config, "sampling": {**sampling, "top_p": 1.0}}
    validated.write_text(json.dumps(changed))
    (tmp_path / paths.PARAMS).write_text(yaml.safe_dump(config))     # params.yaml is not what a stage reads
    with pytest.raises(UserError, match=r"^artifacts/probs/table/prompt_id=q/table.parquet is stale: "
                                        r"stage probs ran with "
                                        r"sampling.top_p=0.9, params.yaml has 1.0: re-run probs and the stages "
                                        r"after it \(`dvc repro`\)$"):
        _run_checks_on(tmp_path)


def test_an_input_made_from_a_prompt_file_edited_since_is_named_stale(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/p.txt").write_text("one")
    with artifacts.stage_run("probs", {}, tmp_path) as run:
        run.use(tmp_path / "prompts/p.txt")
        run.write_parquet(paths.TABLE[1], _table(), prompt_id="q")
    _run_checks_on(tmp_path)
    (tmp_path / "prompts/p.txt").write_text("two")
    with pytest.raises(UserError, match=r"^artifacts/probs/table/prompt_id=q/table.parquet is stale: "
                                        r"stage probs read prompts/p.txt "
                                        r"\(sha256 [0-9a-f]{12}\), which has changed since \(now [0-9a-f]{12}\)"):
        _run_checks_on(tmp_path)
    stale = r"^artifacts/probs is stale: stage probs read prompts/p.txt \(sha256 "
    with pytest.raises(UserError, match=stale), artifacts.stage_run("checks", {}, tmp_path) as run:
        run.use(tmp_path / "prompts/p.txt")      # as the checks stage: the prompt file first, then the tables
        run.use(paths.TABLE, "q")


def _produce(tmp_path, rows_per_group: int = 2):
    """A tokenize run writing t.parquet (several row groups), as a producer for `use`."""
    with artifacts.stage_run("tokenize", {}, tmp_path) as run:
        run.write_parquet("t.parquet", _table(), row_group_size=rows_per_group)
    return tmp_path / "artifacts/tokenize/t.parquet"


def _consume(tmp_path, item=("tokenize", "t.parquet")) -> dict:
    with artifacts.stage_run("forward", {}, tmp_path) as run:
        run.use(item)
    return json.loads((tmp_path / "artifacts/forward/manifest.json").read_text())["inputs"][0]


def test_an_input_its_producer_recorded_is_not_read_again(tmp_path, monkeypatch):
    made = _produce(tmp_path)
    out = json.loads((tmp_path / "artifacts/tokenize/manifest.json").read_text())["outputs"]
    recorded = next(o for o in out if o["path"].endswith("t.parquet"))
    read = []
    real = provenance.sha256_file
    monkeypatch.setattr(provenance, "sha256_file", lambda p: read.append(p.name) or real(p))
    monkeypatch.setattr(provenance, "logical_hash", lambda *a: pytest.fail("an input was parsed"))
    record = _consume(tmp_path)
    assert "t.parquet" not in read     # same size and mtime as recorded: the recorded hashes stand
    assert record == {k: recorded[k] for k in ("path", "bytes", "sha256", "logical_sha256")}
    monkeypatch.setenv(ledger.HASH_INPUTS_ENV, "1")   # audit-grade: every input hashed in full
    assert _consume(tmp_path)["sha256"] == recorded["sha256"] and read.count("t.parquet") == 1
    assert made.exists()


def test_an_input_changed_since_its_producer_wrote_it_is_hashed_and_refused(tmp_path):
    import os
    made = _produce(tmp_path)
    data = bytearray(made.read_bytes())
    data[len(data) // 2] ^= 0xFF                        # same size, one byte different
    st = made.stat()
    made.write_bytes(bytes(data))
    os.utime(made, ns=(st.st_atime_ns, st.st_mtime_ns + 1))   # any other mtime: read in full
    with pytest.raises(UserError, match="t.parquet was not produced by the recorded run of stage tokenize"):
        _consume(tmp_path)


def test_the_logical_hash_streams_row_groups_and_ignores_metadata(tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    path = _produce(tmp_path, rows_per_group=1)
    assert pq.ParquetFile(path).num_row_groups == 3
    with monkeypatch.context() as m:                     # it never loads the whole table
        m.setattr(pq, "read_table", lambda *a, **k: pytest.fail("the logical hash read the whole table"))
        logical = provenance.logical_hash(path)
    record = {"logical_sha256": logical}
    assert provenance.logical_matches(path, record)
    assert provenance.logical_matches(path, {}) is None
    pq.write_table(_table().replace_schema_metadata({"other": "facts"}), path, row_group_size=1)
    assert provenance.logical_matches(path, record)      # other metadata: the same content
    pq.write_table(_table().set_column(1, "b", pa.array([0.5, 1.5, 2.25])), path, row_group_size=1)
    assert not provenance.logical_matches(path, record)


def test_timed_records_each_prompts_seconds_in_the_manifest(tmp_path):
    import time
    with artifacts.stage_run("logits", {}, root=tmp_path) as run:
        for pid, pause in (("a", 0.02), ("b", 0.0), ("a", 0.03)):       # a prompt timed twice adds up
            with run.timed(pid):
                time.sleep(pause)
        with pytest.raises(RuntimeError), run.timed("c"):                # a prompt that fails is timed too
            raise RuntimeError("boom")
        run.write_json("s.json", {})
    seconds = json.loads((tmp_path / "artifacts/logits/manifest.json").read_text())["prompt_seconds"]
    assert list(seconds) == ["a", "b", "c"] and seconds["a"] >= 0.05 and seconds["a"] >= seconds["b"] >= 0


def test_a_sets_manifest_keeps_each_prompts_facts(tmp_path):
    """`facts` is what every prompt shares; `prompt_facts` each prompt's own values (not the last prompt's)."""
    def manifest(prompts):
        with artifacts.stage_run("tokenize", {}, root=tmp_path) as run:
            for pid, n, ok in prompts:
                with run.timed(pid):
                    run.facts = {"n_tokens": n, "round_trip_ok": ok, "family": "qwen2"}
            run.write_json("s.json", {})
        return json.loads((tmp_path / "artifacts/tokenize/manifest.json").read_text())

    m = manifest([("a", 5, True), ("b", 9, False)])
    assert m["facts"] == {"family": "qwen2"}
    assert m["prompt_facts"] == {"a": {"n_tokens": 5, "round_trip_ok": True},
                                 "b": {"n_tokens": 9, "round_trip_ok": False}}
    m = manifest([("a", 5, True), ("b", 5, True)])                   # nothing differs: no prompt_facts
    assert m["facts"] == {"n_tokens": 5, "round_trip_ok": True, "family": "qwen2"} and "prompt_facts" not in m
    m = manifest([("a", 7, True)])                                    # a single prompt: its facts, as before
    assert "prompt_facts" not in m and m["facts"] == {"n_tokens": 7, "round_trip_ok": True, "family": "qwen2"}


def test_a_sets_prompt_facts_kept_as_text_give_the_manifest_json_dumps_would(tmp_path):
    """Each prompt's facts are held as text and parsed back when the manifest is written (streamed): the same
    facts (nested values, a key one prompt lacks, text outside ASCII, a Ray prompt's facts reported by
    `prompt_done`), in prompt order, and byte for byte the text `json.dumps(indent=2)` gives."""
    with artifacts.stage_run("forward", {}, root=tmp_path) as run:
        for pid, n in (("p2", 3), ("p0", 5)):
            with run.timed(pid):
                run.facts = {"model": "m", "names": {"embed": {"shape": [1, n, 4]}}, "ids": list(range(n)),
                             "text": "Grüße " * n}
        run.prompt_done("p1", 0.1, {"model": "m", "names": {"embed": {"shape": [1, 5, 4]}}, "ids": [0, 1, 2, 3, 4],
                                    "text": "Grüße " * 5, "node": "n1"})
        run.write_json("s.json", {})
    text = (tmp_path / "artifacts/forward/manifest.json").read_text(encoding="utf-8")
    m = json.loads(text)
    assert text == json.dumps(m, indent=2, ensure_ascii=False) + "\n"
    assert m["facts"] == {"model": "m"} and list(m["prompt_facts"]) == ["p2", "p0", "p1"]
    assert m["prompt_facts"]["p2"] == {"names": {"embed": {"shape": [1, 3, 4]}}, "ids": [0, 1, 2], "text": "Grüße " * 3}
    assert m["prompt_facts"]["p1"] == {**m["prompt_facts"]["p0"], "node": "n1"}
    assert m["prompt_facts"]["p0"]["ids"] == [0, 1, 2, 3, 4]


def test_a_sets_inputs_read_each_manifest_once_and_still_verify_every_file(tmp_path, monkeypatch):
    """A stage over a set uses every prompt's partition: each producing manifest is read and its inputs and config
    checked once (not once per partition, which made a set of N cost O(N^2)), while every file is still held to
    its own record."""
    pids = [f"p{i:03d}" for i in range(40)]
    with artifacts.stage_run("tokenize", {}, tmp_path) as run:
        for pid in pids:
            run.write_parquet(paths.TOKENS[1], _table(), prompt_id=pid)
    reads, fresh = [], []
    real_read, real_fresh = readers.read_manifest_once, ledger.check_fresh
    monkeypatch.setattr(readers, "read_manifest_once", lambda *a, **k: reads.append(a[0]) or real_read(*a, **k))
    monkeypatch.setattr(ledger, "check_fresh", lambda *a: fresh.append(a[1]) or real_fresh(*a))
    with artifacts.stage_run("forward", {}, tmp_path) as run:
        for pid in pids:
            run.use(paths.TOKENS, pid)
        assert reads == ["tokenize"] and fresh == ["tokenize"]
        assert len(run.ledger.inputs) == len(pids)
        # the stage run holds the process's one parsed copy, the one the checks and the report read too
        assert run.ledger.producers.manifest("tokenize") is real_read("tokenize", tmp_path)
        run.write_json("s.json", {})
    victim = paths.partition(paths.TOKENS, pids[-1], tmp_path)
    pa_table = pa.table({"a": pa.array([9], pa.int32())})
    import pyarrow.parquet as pq
    pq.write_table(pa_table, victim)                          # one partition edited after tokenize wrote it
    with pytest.raises(UserError, match=f"prompt_id={pids[-1]}.*was not produced by the recorded run"), \
            artifacts.stage_run("forward", {}, tmp_path) as run:
        for pid in pids:
            run.use(paths.TOKENS, pid)


def test_read_once_reads_a_file_again_only_when_it_changes(tmp_path):
    calls = []

    @artifacts.read_once
    def reader(path, label):
        calls.append(label)
        return path.read_text()

    f = tmp_path / "x.json"
    f.write_text("one")
    assert reader(f, "a") == reader(str(f), "a") == "one" and calls == ["a"]
    f.write_text("three")                                    # another size: read again
    assert reader(f, "a") == "three" and calls == ["a", "a"]
    with pytest.raises(FileNotFoundError):                   # missing: the reader's own error, nothing cached
        reader(tmp_path / "gone.json", "b")


class _PromptWork:
    """A per-prompt work as the executors run it: reads its prompt's tokens, writes two files, sets facts."""
    stage = "forward"

    def setup(self) -> None:
        pass

    def run(self, out, prompt_id: str) -> str:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        tokens = pq.read_table(out.use(paths.TOKENS, prompt_id))
        out.facts = {"rows": tokens.num_rows, "prompt": prompt_id}
        out.write_parquet("x.parquet", tokens.append_column("p", pa.array([prompt_id] * tokens.num_rows)),
                          prompt_id=prompt_id)
        out.write_json("y.json", {"prompt": prompt_id, "sum": pc.sum(tokens["a"]).as_py()}, prompt_id=prompt_id)
        return prompt_id


def _forward_files(tmp_path) -> tuple[dict[str, str], dict]:
    m = json.loads((tmp_path / "artifacts/forward/manifest.json").read_text())
    files = {p.relative_to(tmp_path).as_posix(): provenance.sha256_file(p)
             for p in (tmp_path / "artifacts/forward").rglob("*") if p.is_file() and p.name != paths.MANIFEST}
    return files, {k: m.get(k) for k in ("facts", "prompt_facts", "inputs", "outputs")}


def test_a_workers_prompts_accepted_give_the_bytes_and_manifest_of_the_work_done_in_the_stage(tmp_path):
    """The Ray path without Ray: each prompt run on a worker's private Writer (`run_one`), then taken into the
    stage (`accept`: inputs verified, bytes put into staging, facts and seconds logged) gives the files and the
    manifest records the same work gives run in the stage itself (the serial executor)."""
    from pipeline.executor.work import accept, run_one
    pids = ["p0", "p1", "p2"]
    with artifacts.stage_run("tokenize", {}, tmp_path) as run:
        for i, pid in enumerate(pids):
            run.write_parquet(paths.TOKENS[1], _table().slice(0, i + 1), prompt_id=pid)
    work = _PromptWork()
    with artifacts.stage_run("forward", {"c": 1}, tmp_path) as run:
        assert run.prompt_ids(paths.TOKENS) == pids
        for pid in pids:
            with run.timed(pid):
                work.run(run, pid)
    serial = _forward_files(tmp_path)
    with artifacts.stage_run("forward", {"c": 1}, tmp_path) as run:
        values = [accept(run, run_one(work, tmp_path, run.config, run.model, pid)) for pid in pids]
    assert values == pids and _forward_files(tmp_path)[0] == serial[0]
    recorded = _forward_files(tmp_path)[1]
    assert recorded["prompt_facts"] == {pid: {"rows": i + 1, "prompt": pid} for i, pid in enumerate(pids)}

    def drop(outs):
        return [{k: v for k, v in o.items() if k != "mtime_ns"} for o in outs]
    assert {**recorded, "outputs": drop(recorded["outputs"])} == {**serial[1], "outputs": drop(serial[1]["outputs"])}
    assert [i["path"] for i in recorded["inputs"]] == [paths.partition(paths.TOKENS, p).as_posix() for p in pids]


def test_a_workers_input_is_verified_before_any_of_its_bytes_is_taken(tmp_path):
    """A partition edited after tokenize wrote it: the worker reads it, the stage refuses it by name, and no
    output of the stage is left; a missing one is named relative to the repository, as the stage names it."""
    from pipeline.executor.work import accept, run_one
    with artifacts.stage_run("tokenize", {}, tmp_path) as run:
        run.write_parquet(paths.TOKENS[1], _table(), prompt_id="p0")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"a": pa.array([9], pa.int32())}), paths.partition(paths.TOKENS, "p0", tmp_path))
    result = run_one(_PromptWork(), tmp_path, {}, None, "p0")
    assert result.files and result.user_error is None and result.crash is None   # the worker cannot tell
    with pytest.raises(UserError, match=r"prompt_id=p0/tokens.parquet was not produced by the recorded run"), \
            artifacts.stage_run("forward", {}, tmp_path) as run:
        accept(run, result)
    assert not (tmp_path / "artifacts/forward").exists()
    missing = run_one(_PromptWork(), tmp_path, {}, None, "q")
    assert missing.user_error == (f"input {paths.partition(paths.TOKENS, 'q').as_posix()} is missing: run the stage "
                                  f"that makes it (`dvc repro`)")
