"""logits.parquet: the required layout, exact round trips, byte-deterministic writes, one
row group per filtered read. Small arrays (fast); the real sizes are in the bench."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import UserError
from pipeline.store import logits_io

T, V = 5, 3001


def _logits(dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    return (torch.randn(T, V, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


def _write(path, logits, **kw):
    return logits_io.write_logits(path, enumerate(logits), {b"nexttoken": b"{}"}, **kw)


def test_layout_is_the_required_one(tmp_path):
    path = tmp_path / "logits.parquet"
    assert _write(path, _logits()) == T * V
    pf = pq.ParquetFile(path)
    schema = pf.schema_arrow
    assert [(f.name, str(f.type), f.nullable) for f in schema] == [
        ("position", "int32", False), ("token_id", "int32", False), ("logit", "float", False)]
    assert schema.metadata[b"nexttoken"] == b"{}"
    md = pf.metadata
    assert md.num_row_groups == T and all(md.row_group(rg).num_rows == V for rg in range(T))
    for rg in range(T):
        cols = {md.row_group(rg).column(c).path_in_schema: md.row_group(rg).column(c) for c in range(3)}
        assert {c.compression for c in cols.values()} == {"ZSTD"}
        assert "BYTE_STREAM_SPLIT" in cols["logit"].encodings
        stats = cols["position"].statistics
        assert stats.has_min_max and stats.min == stats.max == rg      # row-group skipping by position
    assert logits_io.logit_encodings(path) >= {"BYTE_STREAM_SPLIT"}
    assert logits_io.positions_in(path) == list(range(T))
    table = pq.read_table(path)     # sorted by (position, token_id)
    assert table["position"].to_numpy().tolist() == np.repeat(np.arange(T), V).tolist()
    assert table["token_id"].to_numpy().tolist() == np.tile(np.arange(V), T).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_exact(tmp_path, dtype):
    logits = _logits(dtype)
    path = tmp_path / "logits.parquet"
    _write(path, logits)
    want = logits.float().numpy()
    positions, got = logits_io.read_matrix(path)
    assert positions == list(range(T)) and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(pq.read_table(path)["logit"].to_numpy().reshape(T, V), want)
    for p in (0, T - 1):
        assert np.array_equal(logits_io.read_position(path, p), want[p])


def test_bf16_widening_is_torchs_bit_for_bit_including_special_values():
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3.5, 65504.0,
                            3.3895e38], dtype=torch.bfloat16)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)   # every bf16
    for row in (special, bits, _logits()[2]):
        got, want = logits_io._float32(row), row.to(torch.float32).numpy()
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    half = _logits(torch.float16)[1]
    assert np.array_equal(logits_io._float32(half), half.float().numpy())


def test_two_writes_of_the_same_data_give_identical_bytes(tmp_path):
    logits = _logits()
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    _write(a, logits)
    _write(b, logits.clone())
    assert a.read_bytes() == b.read_bytes()
    _write(b, _logits(seed=1))
    assert a.read_bytes() != b.read_bytes()


def test_read_position_touches_one_row_group(tmp_path):
    """Garbage in every other row group's data pages: reading position 3 still works, so the
    reader never decoded them (the statistics ruled them out)."""
    logits = _logits()
    path = tmp_path / "logits.parquet"
    _write(path, logits)
    md = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    for rg in range(T):
        if rg == 3:
            continue
        for c in range(md.num_columns):
            col = md.row_group(rg).column(c)
            start = col.data_page_offset
            data[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(data))
    assert np.array_equal(logits_io.read_position(path, 3), logits[3].float().numpy())
    with pytest.raises(UserError, match="not a readable"):
        logits_io.read_position(path, 2)
    with pytest.raises(UserError, match="not a readable"):
        logits_io.read_matrix(path)


def test_read_position_names_a_missing_position(tmp_path):
    path = tmp_path / "logits.parquet"
    _write(path, _logits())
    with pytest.raises(UserError, match="no rows for position 99"):
        logits_io.read_position(path, 99)


def test_read_matrix_keeps_the_file_order_of_positions_and_uses_any_thread_count(tmp_path):
    logits = _logits()
    path = tmp_path / "last.parquet"
    logits_io.write_logits(path, [(7, logits[0]), (2, logits[1]), (9, logits[2])], {})
    for threads in (1, 2, 3, 16):
        positions, got = logits_io.read_matrix(path, threads=threads)
        assert positions == [7, 2, 9] and np.array_equal(got, logits[:3].float().numpy())


def test_read_matrix_refuses_files_that_are_not_one_row_per_position(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"position": pa.array([0, 0, 1], pa.int32()), "token_id": pa.array([0, 1, 0], pa.int32()),
                             "logit": pa.array([1.0, 2.0, 3.0], pa.float32())}), path, row_group_size=2)
    with pytest.raises(UserError, match="differ in length"):
        logits_io.read_matrix(path)
    pq.write_table(pa.table({"position": pa.array([0, 1], pa.int32()), "token_id": pa.array([0, 0], pa.int32()),
                             "logit": pa.array([1.0, 2.0], pa.float32())}), path)
    with pytest.raises(UserError, match="one position"):
        logits_io.read_matrix(path)
    with pytest.raises(UserError, match="missing"):
        logits_io.read_matrix(tmp_path / "nope.parquet")
    (tmp_path / "cut.parquet").write_bytes(path.read_bytes()[:-20])
    with pytest.raises(UserError, match="not a readable"):
        logits_io.read_matrix(tmp_path / "cut.parquet")


def test_uncompressed_floor_has_the_same_layout(tmp_path):
    logits = _logits()
    z, raw = tmp_path / "z.parquet", tmp_path / "raw.parquet"
    _write(z, logits)
    _write(raw, logits, compression=None)
    mz, mr = pq.ParquetFile(z).metadata, pq.ParquetFile(raw).metadata
    assert mr.row_group(0).column(2).compression == "UNCOMPRESSED"
    assert mr.num_row_groups == mz.num_row_groups and pq.read_schema(raw).equals(pq.read_schema(z))
    assert [mr.row_group(0).column(c).encodings for c in range(3)] == \
        [mz.row_group(0).column(c).encodings for c in range(3)]
    assert np.array_equal(logits_io.read_matrix(raw)[1], logits_io.read_matrix(z)[1])
    assert raw.stat().st_size > z.stat().st_size


def _steps(dtype=torch.bfloat16):
    """Eight steps as a trajectories run makes them: per step a full-prefix row and a KV-cache row; steps 1
    and 3 bit-identical between the two, step 2 one ulp apart at three ids, step 4 another row altogether."""
    logits, rows, keys = _logits(dtype), [], []
    for step in (1, 2, 3, 4):
        full = logits[step - 1].clone()
        cached = full.clone()
        if step == 2:
            bits = cached.view(torch.int16 if dtype != torch.float32 else torch.int32)
            bits[[0, 7, V - 1]] ^= 1                      # one ulp (the lowest mantissa bit)
        if step == 4:
            cached = logits[4].clone()
        for kv, row in ((False, full), (True, cached)):
            rows.append((10 + step, row))
            keys.append({"branch": "greedy", "kv_cache": kv, "step": step})
    return rows, keys


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_step_logits_read_back_bit_for_bit_in_file_order(tmp_path, dtype):
    rows, keys = _steps(dtype)
    path = tmp_path / "step_logits.parquet"
    assert logits_io.write_step_logits(path, rows, keys, {b"x": b"y"}) == len(rows)
    back = logits_io.read_step_logits(path)
    assert [k for k, _, _ in back] == keys and [p for _, p, _ in back] == [p for p, _ in rows]
    for (_, _, got), (_, row) in zip(back, rows):
        want = row.float().numpy()
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert pq.read_schema(path).metadata[b"x"] == b"y"
    assert logits_io.step_layout(path) == {"dtype": {torch.bfloat16: "BF16", torch.float16: "F16",
                                                     torch.float32: "F32"}[dtype], "size": V}


def test_a_kv_cache_row_is_stored_as_its_xor_with_the_full_prefix_row(tmp_path):
    rows, keys = _steps()
    path = tmp_path / "step_logits.parquet"
    logits_io.write_step_logits(path, rows, keys, {})
    t = pq.read_table(path)
    assert t.schema.names == ["branch", "kv_cache", "step", "position", "base", "bits"]
    # the KV-cache rows of steps 1-3 (file rows 1, 3, 5) are XORed with their full-prefix row; step 4's
    # cached row shares nothing with it (another row: stored as it is), nor does any full-prefix row
    assert t["base"].to_pylist() == [-1, 0, -1, 2, -1, 4, -1, -1]
    assert t["bits"][1].as_py() == bytes(2 * V)                       # bit-identical: all zero bytes
    diff = np.frombuffer(t["bits"][3].as_py(), np.uint8)
    assert np.count_nonzero(diff) == 3                                 # three ulps, in the low byte plane
    md = pq.ParquetFile(path).metadata
    sizes = [md.row_group(rg).column(5).total_compressed_size for rg in range(md.num_row_groups)]
    assert sizes[1] < sizes[0] / 20 and sizes[3] < sizes[0] / 20


def test_a_wrong_xor_base_or_a_flipped_bit_changes_the_decoded_values(tmp_path):
    """The reader follows `base`: pointing a row at another base, or a flipped stored bit, decodes other
    values (what the round-trip test would catch); a base that is not an earlier row is refused."""
    rows, keys = _steps()
    path, bad = tmp_path / "s.parquet", tmp_path / "bad.parquet"
    logits_io.write_step_logits(path, rows, keys, {})
    t = pq.read_table(path)
    want = rows[3][1].float().numpy()
    assert np.array_equal(logits_io.read_step_logits(path)[3][2], want)
    for base in ([-1, 0, -1, 0, -1, 4, -1, -1], [-1, 0, -1, -1, -1, 4, -1, -1]):   # row 3's base is row 2
        pq.write_table(t.set_column(4, "base", pa.array(base, pa.int32())), bad)
        assert not np.array_equal(logits_io.read_step_logits(bad)[3][2], want)
    flipped = bytearray(t["bits"][3].as_py())
    flipped[-1] ^= 0x80                                                        # the sign of the last id
    pq.write_table(t.set_column(5, "bits", pa.array([*t["bits"].to_pylist()[:3], bytes(flipped),
                                                     *t["bits"].to_pylist()[4:]], t.schema.field("bits").type)), bad)
    got = logits_io.read_step_logits(bad)[3][2]
    assert np.flatnonzero(got != want).tolist() == [V - 1] and got[-1] == -want[-1]
    pq.write_table(t.set_column(4, "base", pa.array([-1, 3, -1, 2, -1, 4, -1, -1], pa.int32())), bad)
    with pytest.raises(UserError, match="not an earlier one"):
        logits_io.read_step_logits(bad)


def test_a_file_of_the_long_layout_is_not_read_as_step_logits(tmp_path):
    path = tmp_path / "long.parquet"
    logits = _logits()
    logits_io.write_logits(path, [(0, logits[0])], {})
    with pytest.raises(UserError, match="not a step logits file"):
        logits_io.read_step_logits(path)


def test_no_step_at_all_is_an_empty_file_of_the_layout(tmp_path):
    path = tmp_path / "s.parquet"
    assert logits_io.write_step_logits(path, [], [], {}) == 0
    assert logits_io.read_step_logits(path) == []
