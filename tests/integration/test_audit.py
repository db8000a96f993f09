"""`nexttoken audit` on a real tiny_qwen2 run: clean when untouched, and each kind of tampering
is found and named. Also the revision plumbing (git refs, the DVC cache) on a hand-made repo.

One module workspace runs the chain once (prepare_model and tokenize come from the session's
tiny workspace); each tampering test works on its own copy.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.errors import UserError
from pipeline.store import paths, provenance
from pipeline.store.artifacts import PARQUET_META_KEY, parquet_facts
from pipeline.tools import audit, cli, rederived, revisions, rundiff
from tests.conftest import ON_CPU, TEST_STEPS, copy_ws, run_module
from tests.helpers.partitions import part


@pytest.fixture(scope="module")
def run(tiny_chain, tmp_path_factory) -> Path:
    """A complete run: a copy of the session's chain, plus the checks stage."""
    ws = copy_ws(tiny_chain, tmp_path_factory.mktemp("audit") / "ws")
    run_module("stages.checks", ws, check=True)
    return ws


@pytest.fixture(scope="module")
def other_prompt_run(tiny_workspace, tmp_path_factory) -> Path:
    """A second run, tokenized for another prompt: a source of plausible but wrong artifacts."""
    ws = tmp_path_factory.mktemp("audit_other") / "ws"
    shutil.copytree(tiny_workspace, ws)
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "model=tiny_qwen2", ON_CPU, "prompt.text=Hello world",
               check=True)
    run_module("stages.tokenize", ws, check=True)
    return ws


@pytest.fixture
def copy(run, tmp_path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "copy"))


def findings(root: Path) -> list[str]:
    return audit.audit_folder(root, "test").findings


def manifest(root: Path, stage: str) -> dict:
    return json.loads(paths.manifest_path(stage, root).read_text())


def save_manifest(root: Path, stage: str, m: dict) -> None:
    paths.manifest_path(stage, root).write_text(json.dumps(m, indent=2) + "\n")


def rerecord(root: Path, rel: str, stage: str, section: str) -> None:
    """Make `stage`'s manifest record the current bytes of `rel` (what a careful forger does)."""
    m = manifest(root, stage)
    m[section] = [provenance.file_record(root / rel, root) if r["path"] == rel else r for r in m[section]]
    save_manifest(root, stage, m)


# ---------------------------------------------------------------- clean and tampered runs
def test_fresh_run_is_clean(run):
    result = audit.audit_folder(run, "fresh")
    assert result.clean, result.lines()
    text = "\n".join(result.lines())
    assert "re-derived table.parquet, filtered.parquet, summary.json, metrics.json, prompt_metrics.parquet" in text
    assert "re-derived prompt_metrics.parquet, metrics.json from trajectories.json (1 prompt(s))" in text
    assert "re-ran" in text and "checks from the stored artifacts" in text
    assert text.splitlines()[-1].startswith("verdict: CLEAN")


def test_one_flipped_byte_in_logits_is_named(copy, monkeypatch, capsys):
    path = part(paths.LOGITS, copy)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    monkeypatch.chdir(copy)
    assert cli.main(["audit"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert f"FINDING [hashes] {path.relative_to(copy).as_posix()}: sha256" in "\n".join(lines)
    assert lines[-1].startswith("verdict: FAIL")


def test_a_changed_probability_with_matching_hashes_is_caught_by_rederivation(copy):
    path = part(paths.TABLE, copy)
    table = pq.read_table(path)   # keeps the schema metadata (the run's facts)
    p = table["p_T1"].to_numpy().copy()
    top = int(p.argmax())
    p[top] = np.nextafter(p[top], 2.0)   # one ulp: only a bit-for-bit comparison sees it
    table = table.set_column(table.schema.get_field_index("p_T1"), "p_T1", pa.array(p))
    pq.write_table(table, path, compression="zstd", row_group_size=table.num_rows)
    rel = path.relative_to(copy).as_posix()
    rerecord(copy, rel, "probs", "outputs")
    rerecord(copy, rel, "checks", "inputs")   # every hash in every manifest now agrees
    found = findings(copy)
    assert found and all(f.startswith("FINDING [re-derive]") for f in found), found
    assert any(rel in f and "column p_T1" in f and f"token_id={top}" in f
               for f in found), found


def re_derived_fail(name: str, line: str) -> bool:
    """The audit's line for a check of the run's prompt that passed when stored and fails re-derived."""
    return re.search(rf"check {name} \(prompt [\w.-]+\) stored pass, re-derived fail", line) is not None


def test_a_changed_prompt_metrics_cell_with_matching_hashes_is_caught_twice(copy):
    """By the re-derivation (the probs stage's code) and by the re-run check (numpy's)."""
    def one_more_kept(path):
        table = pq.read_table(path)
        col = table["top_p_0.9_kept"].to_numpy() + 1
        pq.write_table(table.set_column(table.schema.get_field_index("top_p_0.9_kept"), "top_p_0.9_kept",
                                        pa.array(col, pa.int32())), path)
    forge(copy, paths.artifact(paths.PROBS_PROMPT_METRICS).as_posix(), one_more_kept)
    found = findings(copy)
    assert any(f.startswith("FINDING [re-derive] artifacts/probs/prompt_metrics.parquet") and "top_p_0.9_kept" in f
               for f in found), found
    assert any(re_derived_fail("probs_prompt_metrics_rows", f) for f in found), found


def test_forged_trajectory_set_files_are_caught_by_rederivation(copy):
    """A loop flag flipped in trajectories/prompt_metrics.parquet and a loop rate changed in its metrics.json,
    every hash re-recorded: the audit rebuilds both from trajectories.json (`trajectories.set_files`)."""
    def flip_loop(path):
        table = pq.read_table(path)
        pq.write_table(table.set_column(table.schema.get_field_index("loop"), "loop", pc.invert(table["loop"])), path)

    def other_rate(path):
        m = json.loads(path.read_text())
        m["greedy_loop_rate"] = 0.25 if m["greedy_loop_rate"] != 0.25 else 0.5
        path.write_text(json.dumps(m))
    forge(copy, paths.artifact(paths.TRAJECTORY_PROMPT_METRICS).as_posix(), flip_loop)
    forge(copy, paths.artifact(paths.TRAJECTORIES_METRICS).as_posix(), other_rate)
    result = audit.Audit("forged")      # the audit's step alone (the whole audit re-runs every check: ~1 min)
    rederived.rederive_trajectories(copy, manifest(copy, "trajectories"), result, same_code=True)
    found = result.findings
    assert any(f.startswith("FINDING [re-derive] artifacts/trajectories/prompt_metrics.parquet") and "column loop" in f
               for f in found), found
    assert any(f.startswith("FINDING [re-derive] artifacts/trajectories/metrics.json") and "greedy_loop_rate" in f
               for f in found), found


def test_a_probs_record_without_prompt_metrics_is_a_finding(copy):
    """One format_version: a run whose probs stage recorded no prompt_metrics.parquet (what earlier code
    wrote) is not audited as an older layout; the missing file is a finding, named."""
    metrics_rel = paths.artifact(paths.PROBS_PROMPT_METRICS).as_posix()
    (copy / metrics_rel).unlink()
    m = manifest(copy, "probs")
    m["outputs"] = [o for o in m["outputs"] if o["path"] != metrics_rel]
    save_manifest(copy, "probs", m)
    result = audit.audit_folder(copy, "without prompt_metrics")
    assert not result.clean
    assert f"FINDING [re-derive] {metrics_rel} is not among the outputs the run's manifest records" \
        in result.lines(), result.lines()


def test_an_edited_manifest_config_is_named(copy):
    m = manifest(copy, "probs")
    m["config"]["sampling"]["top_p"] = 0.9
    m["config_sha256"] = provenance.sha256_json(m["config"])   # internally consistent
    save_manifest(copy, "probs", m)
    assert "FINDING [config] probs: sampling.top_p recorded 0.9, params.yaml has 1.0" in findings(copy)


def test_an_artifact_from_another_run_breaks_the_chain(copy, other_prompt_run):
    # The other run's whole tokenize folder: its manifest agrees with its own files (another
    # prompt: another partition, so forward's tokens are no output of this tokenize run).
    tokens = part(paths.TOKENS, copy).relative_to(copy).as_posix()
    shutil.rmtree(paths.stage_dir("tokenize", copy))
    shutil.copytree(paths.stage_dir("tokenize", other_prompt_run), paths.stage_dir("tokenize", copy))
    found = findings(copy)
    assert any(f.startswith(f"FINDING [chain] forward read {tokens}") for f in found), found
    assert any(f.startswith("FINDING [config] tokenize: prompt.text recorded 'Hello world'") for f in found), found


def test_a_replaced_file_is_traced_to_the_run_that_wrote_it(copy, other_prompt_run):
    # Only tokens.parquet, with this run's manifest updated to its bytes: the file's own
    # metadata still says which config wrote it.
    rel = part(paths.TOKENS, copy).relative_to(copy).as_posix()
    shutil.copy2(part(paths.TOKENS, other_prompt_run), copy / rel)     # the other prompt's, in this one's partition
    rerecord(copy, rel, "tokenize", "outputs")
    found = findings(copy)
    assert any(f.startswith(f"FINDING [provenance] {rel}: written by a run with config") for f in found), found


def test_recorded_environment_is_printed_and_differences_warn(run, monkeypatch):
    here = provenance.library_versions()
    monkeypatch.setattr(provenance, "library_versions", lambda: {**here, "torch": "0.0.0-other"})
    result = audit.Audit("fresh")
    audit.environment(revisions.load_manifests(run), result)
    assert result.clean   # a different machine is a warning, never a finding
    assert any(n.startswith("recorded libraries: python=") for n in result.notes)
    assert any(w.startswith("WARN libraries.torch: recorded") and "'0.0.0-other'" in w for w in result.warnings)


# ---------------------------------------------------------------- a GPU run audited on a CPU
H200 = {"device": "cuda:0", "gpu_name": "NVIDIA H200"}
RTX = {"device": "cuda", "gpu_name": "NVIDIA GeForce RTX 3090"}
KERNEL_BOUND = ("final_norm_recompute", "lm_head_recompute", "layer0_attention_q", "layer0_attention_attn_out",
                "capture_transparent", "step1_logits_sample", "step1_logits_greedy_kv", "generate_parity_greedy",
                "generate_parity_sample_kv", "generate_logits_sample", "generate_logits_greedy_kv")
SAME_PROCESS = ("repeat_deterministic", "greedy_tokens_argmax", "residual_adds_layer0", "logits_file_exact")


def forge(root: Path, rel: str, write) -> None:
    """`write(path)` rewrites `rel`; every manifest then records its new bytes (a consistent forgery)."""
    write(root / rel)
    new = provenance.file_record(root / rel, root)
    for folder in sorted(p for p in (root / paths.ARTIFACTS).iterdir() if paths.manifest_path(p.name, root).exists()):
        m = manifest(root, folder.name)
        for section in ("inputs", "outputs"):
            m[section] = [{**r, **{k: new[k] for k in r if k in new}} if r["path"] == rel else r
                          for r in m.get(section, [])]
        save_manifest(root, folder.name, m)


def ran_on(device: dict):
    """A `forge` writer: the parquet file's facts say it was computed on `device` (its rows unchanged)."""
    def write(path):
        pf = pq.ParquetFile(path)
        table = pf.read()
        meta = {**table.schema.metadata, PARQUET_META_KEY: json.dumps({**parquet_facts(path), **device}).encode()}
        pq.write_table(table.replace_schema_metadata(meta), path, row_group_size=pf.metadata.row_group(0).num_rows)
    return write


def as_gpu_run(root: Path) -> None:
    """The run's records say: forward on an H200, trajectories on an RTX 3090 (the numbers are the CPU's)."""
    def facts(path):
        path.write_text(json.dumps({**json.loads(path.read_text()), **H200}, indent=2) + "\n")
    forge(root, part(paths.FORWARD_FACTS, root).relative_to(root).as_posix(), facts)
    for item in (paths.STEPS, paths.STEP_LOGITS):       # the checks read where trajectories ran from steps.parquet
        forge(root, part(item, root).relative_to(root).as_posix(), ran_on(RTX))


def kernels_differ_here(monkeypatch) -> None:
    """Loads in this process compute the LM head a little otherwise, as other kernels would."""
    from pipeline.model import loader
    real = loader.load_model

    def load(*args, **kwargs):
        model = real(*args, **kwargs)
        model.lm_head.register_forward_hook(lambda module, inputs, output: output + 0.5)
        return model
    monkeypatch.setattr(loader, "load_model", load)


def test_a_gpu_run_checked_and_audited_on_a_cpu_reports_kernel_bound_checks_and_never_fails(copy, monkeypatch):
    as_gpu_run(copy)
    run_module("stages.checks", copy, check=True)
    rows = {r["name"]: r for r in pq.read_table(paths.artifact(paths.CHECKS, copy)).to_pylist()}
    for name in KERNEL_BOUND:
        assert rows[name]["severity"] == "report", rows[name]
    assert "report, not error: forward ran on cuda (NVIDIA H200), this check on cpu" in rows["lm_head_recompute"][
        "detail"]
    # step 1 is compared with the LM head run here, one row: trajectories vs this check
    assert "trajectories ran on cuda (NVIDIA GeForce RTX 3090), this check on cpu" in rows[
        "step1_logits_sample"]["detail"]
    assert "trajectories ran on cuda (NVIDIA GeForce RTX 3090), this check on cpu" in rows[
        "generate_parity_greedy"]["detail"]
    assert all(rows[name]["severity"] == "error" for name in SAME_PROCESS)
    checks_facts = manifest(copy, "checks")["facts"]
    assert (checks_facts["device"], checks_facts["gpu_name"]) == ("cpu", None)

    clean = audit.audit_folder(copy, "gpu run")
    assert clean.clean and not clean.warnings, clean.lines()
    note = next(n for n in clean.notes if "kernel-bound checks are reports here (report, not error: " in n)
    assert all(name in note for name in KERNEL_BOUND) and not any(name in note for name in SAME_PROCESS), note
    # This machine's kernels give other numbers: the re-derived kernel-bound checks fail, as
    # reports; the audit warns, naming them and why, and stays clean.
    kernels_differ_here(monkeypatch)
    result = audit.audit_folder(copy, "gpu run")
    assert result.clean, result.lines()
    warned = "\n".join(result.warnings)
    for name in ("lm_head_recompute", "capture_transparent"):
        assert re_derived_fail(name, warned) and "forward ran on cuda (NVIDIA H200)" in warned


def test_the_same_kernel_difference_on_a_cpu_run_is_a_finding(copy, monkeypatch):
    kernels_differ_here(monkeypatch)
    found = findings(copy)
    for name in ("lm_head_recompute", "capture_transparent"):
        assert any(re_derived_fail(name, f) for f in found), found


# ---------------------------------------------------------------- bad input: exit 2
def test_a_manifest_that_is_not_json_is_a_clear_error(copy, monkeypatch, capsys):
    paths.manifest_path("logits", copy).write_text("{not json")
    monkeypatch.chdir(copy)
    assert cli.main(["audit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nexttoken audit: error:") and "logits/manifest.json is not valid JSON" in err
    assert len(err.splitlines()) == 1


def test_a_workspace_with_no_runs_is_a_clear_error(tmp_path, monkeypatch, capsys):
    (tmp_path / paths.PARAMS).write_text("model: {name: x}\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["audit"]) == 2
    assert "no runs in" in capsys.readouterr().err


def test_an_unknown_revision_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["audit", "--rev", "v9.9"]) == 2                   # not a git repository
    assert "unknown revision 'v9.9'" in capsys.readouterr().err
    git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("x")
    git(tmp_path, "add", "f")
    git(tmp_path, "commit", "-qm", "one")
    assert cli.main(["audit", "--rev", "no-such-exp"]) == 2
    assert "neither a git revision nor an experiment name" in capsys.readouterr().err
    assert cli.main(["diff", "HEAD", "no-such-exp"]) == 2
    assert cli.main(["audit", "--rev", "HEAD"]) == 2                   # a commit without dvc.lock
    assert "has no dvc.lock" in capsys.readouterr().err


# ---------------------------------------------------------------- revisions: git + DVC cache
def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def test_a_revision_is_read_from_git_and_the_dvc_cache_without_checkout(tmp_path):
    repo = tmp_path
    git(repo, "init", "-q")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True, capture_output=True)
    cache = revisions.cache_dir(repo)
    files = {"a.json": b'{"a": 1}\n', "sub/b.bin": b"\x00\x01"}
    listing = [{"md5": _md5(v), "relpath": k} for k, v in sorted(files.items())]
    blobs = {**{e["md5"]: files[e["relpath"]] for e in listing},
             revisions.dir_md5(listing): json.dumps(listing, sort_keys=True).encode()}
    lone = b"metrics\n"
    blobs[_md5(lone)] = lone
    for md5, data in blobs.items():
        (cache / md5[:2]).mkdir(parents=True, exist_ok=True)
        (cache / md5[:2] / md5[2:]).write_bytes(data)
    lock = {"schema": "2.0", "stages": {"s": {"cmd": "x", "outs": [
        {"path": "artifacts/s", "hash": "md5", "md5": revisions.dir_md5(listing)},
        {"path": "artifacts/t/m.json", "hash": "md5", "md5": _md5(lone)}]}}}
    (repo / "dvc.lock").write_text(json.dumps(lock))
    (repo / "params.yaml").write_text("a: 1\n")
    (repo / "prompts/long").mkdir(parents=True)
    (repo / "prompts/long/q.txt").write_text("the prompt of that run\n")
    (repo / "notes.txt").write_text("not part of a run\n")
    git(repo, "add", "dvc.lock", "params.yaml", "prompts", "notes.txt")
    git(repo, "commit", "-qm", "run")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    git(repo, "update-ref", f"refs/exps/{sha[:2]}/{sha[2:]}/tidy-exp", sha)
    (repo / "params.yaml").write_text("a: 2\n")   # the workspace moves on; the revision must not
    (repo / "prompts/long/q.txt").write_text("edited since\n")

    rev = revisions.resolve(repo, "tidy-exp")
    assert (rev.commit, rev.exp, str(rev)) == (sha, "tidy-exp", f"experiment tidy-exp ({sha[:7]})")
    with revisions.open_run(repo, rev) as root:
        assert root != repo and (root / "params.yaml").read_text() == "a: 1\n"
        # prompt.file is read under the run's root, as committed (not the workspace's edit)
        assert (root / "prompts/long/q.txt").read_text() == "the prompt of that run\n"
        assert not (root / "notes.txt").exists()
        assert (root / "artifacts/s/sub/b.bin").read_bytes() == b"\x00\x01"
        assert (root / "artifacts/t/m.json").read_bytes() == lone
        assert revisions.dir_md5(revisions.dir_listing(root / "artifacts/s")) == lock["stages"]["s"]["outs"][0]["md5"]
    assert not root.exists()   # the temporary folder is gone

    (cache / _md5(lone)[:2] / _md5(lone)[2:]).unlink()
    with pytest.raises(UserError, match="not in the local DVC cache .first: artifacts/t/m.json"), \
            revisions.open_run(repo, rev):
        pass


def test_json_and_table_differences_are_bit_exact():
    assert rundiff.json_difference({"a": [1, 0.1]}, {"a": [1, 0.1]}) is None
    assert rundiff.json_difference({"a": [1, 0.1]}, {"a": [1, np.nextafter(0.1, 1)]}).startswith("a.1: stored 0.1")
    assert rundiff.json_difference({"a": 1}, {"a": 1.0}) is not None   # int vs float: not the same record
    t = pa.table({"position": pa.array([3, 3], pa.int32()), "token_id": pa.array([0, 1], pa.int32()),
                  "p": pa.array([0.0, 0.5])})
    assert rundiff.table_difference(t, t) is None
    neg = t.set_column(2, "p", pa.array([-0.0, 0.5]))
    assert "column p; first at row 0 (position=3, token_id=0)" in rundiff.table_difference(t, neg)


def test_a_stage_may_read_another_stages_manifest_but_only_as_recorded(tmp_path):
    # The report stage reads manifests: the record itself, not one of the recorded outputs.
    for stage in ("probs", "report"):
        paths.manifest_path(stage, tmp_path).parent.mkdir(parents=True)
        paths.manifest_path(stage, tmp_path).write_text(f'{{"stage": "{stage}", "outputs": []}}\n')
    path = paths.manifest_path("probs", tmp_path)
    read = {"path": "artifacts/probs/manifest.json", "sha256": provenance.sha256_file(path)}
    manifests = {"probs": {"outputs": []}, "report": {"inputs": [read]}}
    result = audit.Audit("t")
    audit.verify_chain(tmp_path, manifests, {}, result)
    assert result.clean, result.findings
    path.write_text('{"stage": "probs", "outputs": [], "edited": true}\n')
    audit.verify_chain(tmp_path, manifests, {}, result)
    assert result.findings == [f"FINDING [chain] report read artifacts/probs/manifest.json with sha256 "
                               f"{read['sha256'][:12]}, but probs recorded {provenance.sha256_file(path)[:12]}: "
                               f"not the same run's artifact"]
