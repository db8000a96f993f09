"""logits.parquet: the required layout, exact round trips, byte-deterministic writes, one
row group per filtered read. Small arrays (fast); the real sizes are in the bench."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import UserError
from pipeline.model import trajectories
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


def test_trajectory_keys_are_constant_columns_per_row_group(tmp_path):
    logits = _logits()
    keys = [{"branch": "greedy", "kv_cache": kv, "step": s} for kv in (False, True) for s in (1, 2)]
    path = tmp_path / "step_logits.parquet"
    rows = [(10 + i, logits[i]) for i in range(len(keys))]
    assert logits_io.write_logits(path, rows, {}, extra_schema=trajectories.STEP_LOGITS_KEYS,
                                  extra_values=keys) == len(keys) * V
    pf = pq.ParquetFile(path)
    assert pf.schema_arrow.names == ["branch", "kv_cache", "step", "position", "token_id", "logit"]
    for rg, k in enumerate(keys):
        t = pf.read_row_group(rg)
        assert t.num_rows == V and set(t["branch"].to_pylist()) == {"greedy"}
        assert set(t["kv_cache"].to_pylist()) == {k["kv_cache"]} and set(t["step"].to_pylist()) == {k["step"]}
        assert set(t["position"].to_pylist()) == {10 + rg}
        assert np.array_equal(t["logit"].to_numpy(), logits[rg].float().numpy())
