"""The stages on tiny_qwen2 in a temporary workspace: the acceptance figures of the chain.

The session's `tiny_chain` (prepare_model -> trajectories, run once) is read here; tests
that need to change something work on their own copy.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from pipeline.model import capture, decode, loader
from pipeline.numerics.sampling import SamplingSettings
from pipeline.store import artifacts, logits_io, paths, provenance
from tests.conftest import CHAIN, run_module
from tests.helpers.partitions import part

REFERENCE = yaml.safe_load((Path(__file__).resolve().parents[2] / "pipeline/reference/seed_article.yaml")
                           .read_text())


@pytest.fixture(scope="module")
def ws(tiny_chain):
    return tiny_chain


def test_tokens_are_the_reference_ids_and_pieces(ws):
    tokens = pq.read_table(part(paths.TOKENS, ws)).to_pandas()
    assert tokens["token_id"].tolist() == REFERENCE["tokenize"]["token_ids"]
    assert tokens["position"].tolist() == list(range(25))
    for pos, (tid, text) in REFERENCE["tokenize"]["pieces"].items():
        row = tokens.iloc[pos]
        assert (row.token_id, row.text) == (tid, text)
    split = tokens.iloc[15:17]
    assert split["token_id"].tolist() == REFERENCE["tokenize"]["byte_split_example"]["ids"]
    assert not split["decodes_alone"].any() and tokens.drop(index=[15, 16])["decodes_alone"].all()
    # the two halves' bytes together are " 就"
    assert bytes.fromhex("".join(split["piece_bytes_hex"])).decode() == " 就"
    summary = json.loads(part(paths.TOKENIZE_SUMMARY, ws).read_text())
    assert summary["round_trip_ok"] and summary["decoded"] == REFERENCE["prompt"]
    assert summary["expected_token_ids_match"] is True


def test_every_manifest_hash_matches_its_file(ws):
    for stage in ("prepare_model", "tokenize", *CHAIN):
        m = artifacts.read_manifest(stage, ws)
        assert m["outputs"], stage
        for out in m["outputs"]:
            assert provenance.sha256_file(ws / out["path"]) == out["sha256"], out["path"]
        for inp in m["inputs"]:
            assert provenance.sha256_file(ws / inp["path"]) == inp["sha256"], inp["path"]


def test_tokenize_rerun_is_byte_identical(ws, tmp_path):
    copy = tmp_path / "ws"
    shutil.copytree(ws, copy, symlinks=True)
    before = provenance.sha256_file(part(paths.TOKENS, copy))
    run_module("stages.tokenize", copy, check=True)
    assert provenance.sha256_file(part(paths.TOKENS, copy)) == before


def test_capture_names_and_shapes(ws):
    t = artifacts.read_safetensors(part(paths.CAPTURE, ws))
    facts = json.loads(part(paths.FORWARD_FACTS, ws).read_text())
    T, H, V = 25, 64, 152064
    # safetensors stores names sorted; the capture order is kept in its metadata
    from safetensors import safe_open
    with safe_open(str(part(paths.CAPTURE, ws)), framework="pt") as f:
        order = json.loads(f.metadata()["names"])
    assert order == [*facts["names"], "input_ids"] and set(order) == set(t)
    assert t["embed"].shape == (1, T, H) and t["logits"].shape == (1, T, V)
    assert t["blocks.1.attn_weights"].shape == (1, 4, T, T)
    for i in range(2):
        for kind in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
            assert t[capture.act_name(kind, i)].shape == (1, T, H)
    assert all(v.dtype == torch.bfloat16 for k, v in t.items() if k not in ("input_ids", "blocks.0.attn.mask"))
    assert facts["output_size"] == V and facts["tokenizer_len"] == 151669
    # capture changes nothing: a plain forward (no hooks) gives the stored logits bit for bit;
    # the checks stage establishes this (capture_transparent, repeat_deterministic), not facts.json
    model = loader.load_model(ws / "artifacts/prepare_model", torch.bfloat16, "cpu", "eager", False)
    assert torch.equal(capture.plain_forward_logits(model, t["input_ids"], "all"), t["logits"])
    assert not {"capture_transparent", "repeat_identical"} & set(facts)


def test_lm_head_recompute_is_exact(ws):
    t = artifacts.read_safetensors(part(paths.CAPTURE, ws))
    snapshot = ws / "artifacts/prepare_model"
    model = loader.load_model(snapshot, torch.bfloat16, "cpu", "eager", False)
    from pipeline.checks.recompute import lm_head_recompute
    assert lm_head_recompute(model, t["final_norm_out"], t["logits"]) == 0.0


def test_logits_parquet_equals_capture_exactly(ws):
    path = part(paths.LOGITS, ws)
    t = artifacts.read_safetensors(part(paths.CAPTURE, ws))["logits"][0]
    table = pq.read_table(path)
    assert table.num_rows == 25 * 152064
    assert table.schema.field("logit").type == "float" and table.schema.field("position").type == "int32"
    stored = table["logit"].to_numpy().reshape(25, 152064)
    assert np.array_equal(stored, t.float().numpy())
    assert "BYTE_STREAM_SPLIT" in logits_io.logit_encodings(path)
    facts = artifacts.parquet_facts(path)
    assert facts["dtype"] == "bfloat16" and facts["model"]["name"] == "tiny_qwen2"


def test_logits_readable_by_duckdb_and_polars_and_one_row_group_per_position(ws):
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    path = part(paths.LOGITS, ws)
    n, mx = duckdb.sql(f"select count(*), max(logit) from '{path}' where position = 24").fetchall()[0]
    assert n == 152064
    df = pl.read_parquet(path).filter(pl.col("position") == 24)
    assert df.height == 152064 and df["logit"].max() == pytest.approx(mx)
    md = pq.ParquetFile(path).metadata
    assert md.num_row_groups == 25
    idx = md.schema.names.index("position")
    # statistics let a filtered read skip every row group but one
    matching = [rg for rg in range(md.num_row_groups)
                if md.row_group(rg).column(idx).statistics.min <= 24 <= md.row_group(rg).column(idx).statistics.max]
    assert matching == [24]


def test_vocab_marks_ids_past_the_tokenizer(ws):
    vocab = pq.read_table(ws / "artifacts/tokenize/vocab.parquet").to_pandas()
    assert len(vocab) == 152064
    assert vocab.loc[151669:, "has_token"].eq(False).all() and vocab.loc[151669:, "piece"].isna().all()
    assert vocab.loc[9315, "piece"] == "Ġtemperature" and vocab.loc[9315, "text"] == " temperature"


def test_vocab_text_is_each_ids_own_decode(ws):
    """vocab.parquet's text column, decoded for all ids in one backend call, is what
    tokenizer.decode([i]) gives for every id; a tokenizer class with its own decode is called per id."""
    from pipeline.model import tokenization
    tokenizer = loader.load_tokenizer(ws / "artifacts/prepare_model")
    ids = list(range(len(tokenizer)))
    want = [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]
    assert pq.read_table(ws / "artifacts/tokenize/vocab.parquet", columns=["text"])["text"].to_pylist()[:len(ids)] \
        == want
    assert tokenization.is_byte_level(tokenizer)

    class OwnDecode(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return "<" + super()._decode(token_ids, **kwargs) + ">"
    tokenizer.__class__ = OwnDecode
    assert tokenization.decode_each(tokenizer, [9315, 0]) == ["< temperature>", "<!>"]


def test_probability_tables_are_numpys_softmax_of_the_logits(ws):
    table = pq.read_table(part(paths.TABLE, ws)).to_pandas()
    assert set(table["position"]) == {24} and len(table) == 152064
    logits = table["logit"].to_numpy().astype(np.float64)
    for col, t in (("p_T0_5", 0.5), ("p_T1", 1.0), ("p_T2", 2.0)):
        e = np.exp((logits - logits.max()) / t)
        np.testing.assert_allclose(table[col].to_numpy(), e / math.fsum(e.tolist()), rtol=1e-12, atol=0)
    by_logit = table.sort_values(["logit", "token_id"], ascending=[False, True])
    assert by_logit["rank"].tolist() == list(range(1, 152065))


def _generate_kept(model, ids: list[int], **filter_) -> set[int]:
    """The ids generate's warpers keep at its first step (its own prompt pass, its own warpers)."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, max_new_tokens=1, output_scores=True,
                         return_dict_in_generate=True, **{**decode.NEUTRAL, "top_k": 0, **filter_})
    return set(torch.nonzero(torch.isfinite(out.scores[0][0])).flatten().tolist())


def test_filtered_sets_are_what_generate_keeps(ws):
    f = pq.read_table(part(paths.FILTERED, ws)).to_pandas()
    model = loader.load_model(ws / "artifacts/prepare_model", torch.bfloat16, "cpu", "eager", False)
    ids = pq.read_table(part(paths.TOKENS, ws))["token_id"].to_pylist()
    k2, p9 = f[f["filter"] == "top_k_2"], f[f["filter"] == "top_p_0.9"]
    assert set(k2["token_id"]) == _generate_kept(model, ids, top_k=2) and len(k2) == 2
    assert set(p9["token_id"]) == _generate_kept(model, ids, top_p=0.9) and len(p9) > 2


def _steps(ws):
    return pq.read_table(part(paths.STEPS, ws)).to_pandas()


def test_trajectories_match_generate(ws):
    steps = _steps(ws)
    model = loader.load_model(ws / "artifacts/prepare_model", torch.bfloat16, "cpu", "eager", False)
    ids = pq.read_table(part(paths.TOKENS, ws))["token_id"].to_pylist()
    sample = steps[(steps.branch == "sample") & ~steps.kv_cache]["token_id"].tolist()
    greedy = steps[(steps.branch == "greedy") & ~steps.kv_cache]["token_id"].tolist()
    n = yaml.safe_load((ws / paths.PARAMS).read_text())["sampling"]["max_new_tokens"]   # the tests' TEST_STEPS
    ref = decode.generate_reference(model, ids, SamplingSettings(1.0, 0, 1.0), n, 20261002, kv_cache=False)
    assert sample == ref.ids
    assert greedy == decode.generate_reference(model, ids, SamplingSettings(0.0, 0, 1.0), n, 0, kv_cache=False).ids
    assert steps.sort_values(["branch", "kv_cache", "step"])["prefix_len"].tolist()[:n] == list(range(25, 25 + n))
    assert steps.groupby(["branch", "kv_cache"]).size().eq(n).all()


def test_step_one_is_the_lm_head_on_the_captured_input_one_row(ws):
    # generate's prompt pass computes one row of logits; so does step 1, from the same LM-head input
    t = artifacts.read_safetensors(part(paths.CAPTURE, ws))
    model = loader.load_model(ws / "artifacts/prepare_model", torch.bfloat16, "cpu", "eager", False)
    with torch.no_grad():
        one_row = model.lm_head(t["final_norm_out"][:, -1:, :])[0, -1].float().numpy()
    first = [(k, row) for k, _, row in logits_io.read_step_logits(part(paths.STEP_LOGITS, ws)) if k["step"] == 1]
    assert len(first) == 4 + 4                  # sample, greedy x 2 cache modes; conf/'s 4 what-if branches
    for k, row in first:
        assert np.array_equal(row, one_row), k
    steps = _steps(ws)
    assert steps[(steps.branch == "greedy") & (steps.step == 1)]["token_id"].eq(int(np.argmax(one_row))).all()


def test_text_so_far_is_decoded_not_joined(ws):
    steps = _steps(ws)
    tok = loader.load_tokenizer(ws / "artifacts/prepare_model")
    for _, g in steps.groupby(["branch", "kv_cache"]):
        ids = g.sort_values("step")["token_id"].tolist()
        assert g.sort_values("step")["text_so_far"].iloc[-1] == tok.decode(ids)
