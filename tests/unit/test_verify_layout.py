"""verify against a run recorded by older code: a file newer code added keys or columns to is equal on
what both hold, or it differs (pipeline.tools.verify._same_on_shared)."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.tools import verify


def _json(path, obj):
    path.write_text(json.dumps(obj))
    return path


def test_a_metrics_json_with_new_keys_is_equal_on_the_keys_both_hold(tmp_path):
    old = _json(tmp_path / "old.json", {"kept": 3, "entropy": 2.5})
    new = _json(tmp_path / "new.json", {"kept": 3, "entropy": 2.5, "entropy_median": 2.5, "kept_median": 3})
    assert verify._same_on_shared(old, new) == "only one holds entropy_median, kept_median"
    assert verify._same_on_shared(old, _json(tmp_path / "v.json", {"kept": 3, "entropy": 2.5000000000000004,
                                                                    "kept_median": 3})) is None   # one bit off
    assert verify._same_on_shared(old, _json(tmp_path / "s.json", {"kept": 3, "entropy": 2.5})) is None  # same layout


def test_a_checks_table_with_a_new_column_is_equal_on_the_columns_both_hold(tmp_path):
    rows = {"name": ["a", "b"], "measured": [0.0, math.nan], "verdict": ["pass", "fail"]}
    pq.write_table(pa.table(rows), old := tmp_path / "old.parquet")
    pq.write_table(pa.table({"prompt_id": ["p", "p"], **rows}), new := tmp_path / "new.parquet")
    assert verify._same_on_shared(old, new) == "only one holds column prompt_id"     # NaN equals NaN, bit for bit
    flipped = {"prompt_id": ["p", "p"], **rows, "verdict": ["pass", "pass"]}
    pq.write_table(pa.table(flipped), bad := tmp_path / "b.parquet")
    assert verify._same_on_shared(old, bad) is None
    ulp = {"prompt_id": ["p", "p"], **rows, "measured": [5e-324, math.nan]}          # one bit off
    pq.write_table(pa.table(ulp), off := tmp_path / "u.parquet")
    assert verify._same_on_shared(old, off) is None
    pq.write_table(pa.table({"prompt_id": ["p"], "name": ["a"], "measured": [0.0], "verdict": ["pass"]}),
                   short := tmp_path / "s.parquet")
    assert verify._same_on_shared(old, short) is None                                 # a row fewer
