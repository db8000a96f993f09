"""table.parquet stored or derived (`probs.table`, issue 29): a reader's derived table is, bit for bit and byte
for byte, the table the stage stores from the same logits.parquet, by the same function; the comparison
used would see one ulp."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config.schema import ProbsConfig, SamplingConfig
from pipeline.numerics import probs
from pipeline.store import logits_io, paths, provenance
from pipeline.store.artifacts import PARQUET_META_KEY
from pipeline.tools.rundiff import table_difference

T, V = 4, 4099
TEMPS = (0.5, 1.0, 2.0)


def _cfg(table: str = "auto") -> tuple[ProbsConfig, SamplingConfig]:
    p = ProbsConfig(positions=(0, -1), temperatures=TEMPS, fp32_sum_tolerance=2e-6, fp64_sum_tolerance=1e-12,
                    top_n=3, extra_filters=(), table=table)
    s = SamplingConfig(temperature=1.0, top_k=0, top_p=0.9, seed=1, max_new_tokens=1, branches=("greedy",),
                       kv_cache=(False,), top_n=1)
    return p, s


@pytest.fixture
def files(tmp_path):
    """logits.parquet of T positions (bf16 values with ties and a masked id), vocab.parquet, tokenize.json."""
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((T, V)) * 3).astype(np.float32)
    rows = (rows.view(np.uint32) & 0xFFFF0000).view(np.float32)      # bf16 values, as the forward stores them
    rows[:, 11] = rows[:, 12]                                         # a tie
    rows[1, 5] = -np.inf                                              # a masked id
    logits = tmp_path / "logits.parquet"
    meta = {PARQUET_META_KEY: json.dumps({"n_positions": T, "positions": list(range(T)), "output_size": V}).encode()}
    logits_io.write_logits(logits, enumerate(rows), meta)
    vocab = tmp_path / "vocab.parquet"
    pq.write_table(pa.table({"token_id": pa.array(range(V), pa.int32()), "text": [f"t{i}" for i in range(V)]}), vocab)
    tok = tmp_path / "tokenize.json"
    tok.write_text(json.dumps({"prompt_id": "q"}))
    return logits, vocab, tok


def test_auto_stores_the_table_of_one_prompt_and_derives_a_sets():
    assert probs.table_mode(_cfg()[0], 1) == "stored" and probs.table_mode(_cfg()[0], 2) == "derived"
    assert probs.table_mode(_cfg("stored")[0], 20) == "stored" and probs.table_mode(_cfg("derived")[0], 1) == "derived"


def test_the_derived_table_is_the_stored_one_bit_for_bit_and_byte_for_byte(files, tmp_path):
    logits, vocab, tok = files
    stored_out, facts = probs.build(logits, vocab, *_cfg(), tok, "stored")
    derived_out, derived_facts = probs.build(logits, vocab, *_cfg(), tok, "derived")
    assert facts["table"] == "stored" and derived_facts["table"] == "derived"
    assert paths.TABLE not in derived_out and paths.FILTERED not in derived_out    # not written; the rest the same
    assert {k: v for k, v in stored_out.items() if k not in probs.DERIVABLE}.keys() == derived_out.keys()
    for item, value in derived_out.items():
        assert value == stored_out[item] if not isinstance(value, pa.Table) else value.equals(stored_out[item])
    stored = stored_out[paths.TABLE]
    derived = probs.derive_table(logits, stored_out[paths.PROBS_SUMMARY]["positions"], list(TEMPS))
    assert stored_out[paths.PROBS_SUMMARY]["positions"] == [0, T - 1]
    assert table_difference(stored, derived) is None and stored.equals(derived)
    # written as the stage writes table.parquet, the two files are the same bytes
    a, b = tmp_path / "stored.parquet", tmp_path / "derived.parquet"
    for t, p in ((stored, a), (derived, b)):
        pq.write_table(t, p, compression="zstd", row_group_size=V)
    assert provenance.sha256_file(a) == provenance.sha256_file(b)
    assert provenance.logical_hash(a) == provenance.logical_hash(b)
    # filtered.parquet likewise, with the filters of the manifest's config
    config = {"probs": {"extra_filters": []}, "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 0.9}}
    assert probs.config_filters(config) == probs.filters(*_cfg())
    kept = probs.derive_filtered(logits, [0, T - 1], probs.config_filters(config))
    assert table_difference(stored_out[paths.FILTERED], kept) is None and kept.num_rows > 2
    for t, p in ((stored_out[paths.FILTERED], a), (kept, b)):
        pq.write_table(t, p, compression="zstd")
    assert provenance.sha256_file(a) == provenance.sha256_file(b)


def test_one_ulp_in_a_derived_table_is_a_difference(files):
    logits, vocab, tok = files
    stored = probs.build(logits, vocab, *_cfg(), tok, "stored")[0][paths.TABLE]
    for col in ("p_T1", "logit"):
        values = stored[col].to_numpy().copy()
        values[1234] = np.nextafter(values[1234], np.inf)
        off = stored.set_column(stored.schema.get_field_index(col), col, pa.array(values))
        assert f"1 value(s) differ in column {col}" in table_difference(stored, off)


def test_read_table_reads_a_stored_file_and_derives_an_absent_one(files, tmp_path):
    logits, vocab, tok = files
    out = probs.build(logits, vocab, *_cfg(), tok, "stored")[0]
    table_path, summary = tmp_path / "table.parquet", tmp_path / "summary.json"
    pq.write_table(out[paths.TABLE], table_path)
    summary.write_text(json.dumps(out[paths.PROBS_SUMMARY]))
    where = {paths.TABLE: table_path, paths.LOGITS: logits, paths.PROBS_SUMMARY: summary}
    asked = []

    def find(item, prompt_id):
        asked.append(item)
        return where[item]
    stored = probs.read_table(find, "q", {"facts": {"table": "stored", "temperatures": list(TEMPS)}})
    assert asked == [paths.TABLE] and stored.equals(out[paths.TABLE])
    asked.clear()
    config = {"probs": {"extra_filters": []}, "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 0.9}}
    manifest = {"facts": {"table": "derived", "temperatures": list(TEMPS)}, "config": config}
    derived = probs.read_table(find, "q", manifest)
    assert asked == [paths.PROBS_SUMMARY, paths.LOGITS] and table_difference(out[paths.TABLE], derived) is None
    assert table_difference(out[paths.FILTERED], probs.read_table(find, "q", manifest, paths.FILTERED)) is None
    with pytest.raises(ValueError, match="not one of the probs files"):
        probs.read_table(find, "q", manifest, paths.STEPS)
