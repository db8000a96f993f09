"""The Python API (issue 27 item 7): docs/api.md's notebook code, run as written on a tiny_qwen2 run.

The page's python blocks are executed in a copy of the session chain with the checks stage run; the
block that opens a git revision needs a committed run in a DVC cache and is left to the e2e runs of
`nexttoken audit --rev`, whose reader (`tools.revisions.open_run`) `open_run` reuses.
"""

from __future__ import annotations

import contextlib
import io
import re

import numpy as np
import pandas as pd
import pytest

from pipeline import api
from pipeline.store import paths
from tests.conftest import REPO, copy_ws, run_module

BLOCKS = re.findall(r"^```python\n(.*?)^```", (REPO / "docs/api.md").read_text(encoding="utf-8"), re.S | re.M)


@pytest.fixture(scope="module")
def ws(tiny_chain, tmp_path_factory):
    ws = copy_ws(tiny_chain, tmp_path_factory.mktemp("api") / "ws")
    run_module("stages.checks", ws, check=True)
    return ws


def _exec(code: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/api.md", "exec"), namespace)
    return out.getvalue()


def test_the_docs_notebook_code_runs_and_a_changed_file_is_one_error(ws, monkeypatch):
    monkeypatch.chdir(ws)
    session, revision, tampered = BLOCKS[1:]         # BLOCKS[0]: the import line alone
    assert 'open_run("HEAD")' in revision
    namespace: dict = {}
    out = _exec(session, namespace)
    assert "Run(." in out and "bfloat16" in out and "pass" in out
    pid = namespace["pid"]
    path = paths.partition(paths.LOGITS, pid, ws)
    good = path.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    try:
        out = _exec(tampered, namespace)
        rel = path.relative_to(ws).as_posix()
        assert out.startswith(f"{rel} has sha256 ") and "artifacts/logits/manifest.json records" in out, out
        assert out.count("\n") == 1                                            # one line
        assert api.open_run(".", verify=False).path(paths.LOGITS, pid) == path    # verify=False reads it anyway
    finally:
        path.write_bytes(good)      # the module's workspace, for the next test


def test_reads_equal_the_artifacts_and_the_capture_is_lazy(ws):
    run = api.open_run(ws)
    pid = run.prompt_ids[0]
    from safetensors.torch import load_file
    stored = load_file(paths.partition(paths.CAPTURE, pid, ws))
    cap = run.capture(pid)
    assert sorted(cap.names) == sorted(stored) and (cap["logits"] == stored["logits"]).all()
    assert np.array_equal(run.logits(pid), stored["logits"][0].float().numpy())
    assert list(run.tokens(pid).token_id) == run.prompts.token_ids[0]
    lens, summary = run.lens(pid), run.lens_summary(pid)            # layer L is the model's own top-1
    last = summary[summary.layer == summary.layer.max()]
    assert (last.final_top1_rank == 1).all() and len(lens) == 10 * len(summary)
    with pytest.raises(KeyError, match="'nope' is not in capture.safetensors"):
        cap["nope"]
    with pytest.raises(api.UserError, match="prompt_id='x' is not in this run: one of "):
        run.tokens("x")


def test_a_file_no_manifest_records_is_refused(ws, tmp_path):
    other = copy_ws(ws, tmp_path / "other")
    manifest = paths.manifest_path("probs", other)
    manifest.write_text(manifest.read_text().replace('"artifacts/probs/table/', '"artifacts/probs/elsewhere/'))
    with pytest.raises(api.ArtifactChanged, match="is recorded by no stage manifest"):
        api.open_run(other).probs()


def test_tables_carry_each_id_s_piece_and_its_decoded_text(ws):
    """Issue 50: the probability and lens tables carried ids only. Each id's `piece_text` is that token decoded by the
    `tokenizers` library straight from the snapshot's tokenizer.json (not the vocab.parquet the API reads), and
    `piece` its byte-level vocabulary piece: for the Qwen token 问题, `éĹ®é¢ĺ` and `问题`."""
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(next((ws / paths.ARTIFACTS / "prepare_model").rglob("tokenizer.json"))))
    (wenti,) = raw.encode("问题", add_special_tokens=False).ids
    assert raw.id_to_token(wenti) == "éĹ®é¢ĺ"

    def decoded(i: int) -> str | None:       # an output id past the tokenizer has no token: no text
        return None if raw.id_to_token(i) is None else raw.decode([i], skip_special_tokens=False)

    def texts(column) -> list[str | None]:
        return [None if pd.isna(v) else v for v in column]

    run = api.open_run(ws)
    pid = run.prompt_ids[0]
    probs = run.probs(pid)
    assert list(probs.columns[:4]) == ["position", "token_id", "piece", "piece_text"]
    row = probs[probs.token_id == wenti].iloc[0]
    assert (row.piece, row.piece_text) == ("éĹ®é¢ĺ", "问题")
    top = probs.nsmallest(20, ["position", "rank"])
    assert texts(top.piece_text) == [decoded(i) for i in top.token_id]
    assert texts(top.piece) == [raw.id_to_token(i) for i in top.token_id]
    lens = run.lens(pid)
    assert texts(lens.piece_text) == [decoded(i) for i in lens.token_id]
    summary = run.lens_summary(pid)
    assert texts(summary.final_top1_piece_text) == [decoded(i) for i in summary.final_top1_id]
    tokens = run.tokens(pid)
    assert texts(tokens.piece_text) == [decoded(i) for i in tokens.token_id] and "问题" in set(tokens.piece_text)
    steps = run.trajectories(pid)
    assert texts(steps.piece_text) == [decoded(i) for i in steps.token_id]
    filtered = run.filtered(pid)
    assert texts(filtered.piece_text) == [decoded(i) for i in filtered.token_id]
    past = probs[[raw.id_to_token(i) is None for i in probs.token_id]]     # output ids past the tokenizer: no text
    assert len(past) and past.piece.isna().all() and past.piece_text.isna().all()
