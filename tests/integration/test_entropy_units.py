"""Every figure named `entropy` is in nats (issue 50: the sweep table and `dvc exp show` gave bits, 5.94, under the
name the report, the DuckDB example and the API give nats, 4.11). A figure in bits says so in its name (`top_bits`,
summary.json's `entropy_bits`).

Each is compared with numpy's FP64 entropy of the session chain's own logits (the last position's row of
logits.parquet): a figure in bits is ln 2 = 0.69 times off and fails. The places are found by name, not listed by
hand, so a new `entropy` column or key is checked from its first day.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import schema
from pipeline.store import logits_io, paths
from pipeline.tools import sweep
from tests.helpers.partitions import part


@pytest.fixture(scope="module")
def nats(tiny_chain) -> dict[float, float]:
    """numpy's entropy (nats) of the last position's logits at each of probs.temperatures, in FP64."""
    tok = json.loads(part(paths.TOKENIZE_SUMMARY, tiny_chain).read_text(encoding="utf-8"))
    row = logits_io.read_position(part(paths.LOGITS, tiny_chain), tok["n_tokens"] - 1).astype(np.float64)
    out = {}
    for t in schema.read_params(tiny_chain / paths.PARAMS)["probs"]["temperatures"]:
        z = row / t - (row / t).max()
        p = np.exp(z) / np.exp(z).sum()
        out[float(t)] = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    return out


def _entropy_keys(obj, prefix: str = "") -> dict[str, float]:
    """Every number under a key that names an entropy (`entropy`, `entropy_*`) in a JSON object, by dotted path."""
    found: dict[str, float] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (dict, list)):
            found |= _entropy_keys(v, key)
        elif str(k).startswith("entropy") and isinstance(v, (int, float)):
            found[key] = v
    return found


NAMES = {"entropy": 1.0, "entropy_median": 1.0, "entropy_mean": 1.0, "entropy_nats": 1.0,
         "entropy_bits": 1 / math.log(2)}     # each name an entropy may have in the run's files, and its unit in nats


def test_every_entropy_in_the_run_s_json_files_is_nats_unless_named_bits(tiny_chain, nats):
    seen = {}
    for path in sorted((tiny_chain / paths.ARTIFACTS).rglob("*.json")):
        if path.name != paths.MANIFEST:
            rel = path.relative_to(tiny_chain).as_posix()
            seen |= {f"{rel}:{k}": v for k, v in _entropy_keys(json.loads(path.read_text(encoding="utf-8"))).items()}
    assert {k.rpartition(".")[2].rpartition(":")[2] for k in seen} <= set(NAMES), seen   # a new name: give its unit
    sampling_t = schema.read_params(tiny_chain / paths.PARAMS)["sampling"]["temperature"] or 1.0
    metrics = {k.rpartition(":")[2]: v for k, v in seen.items() if k.startswith("artifacts/probs/metrics.json:")}
    assert set(metrics) == {"entropy", "entropy_median", "entropy_mean"}        # DVC's metrics, `dvc exp show`
    for key, value in metrics.items():
        assert value == pytest.approx(nats[sampling_t], rel=1e-9), (key, value, nats[sampling_t])
    summary = json.loads(part(paths.PROBS_SUMMARY, tiny_chain).read_text(encoding="utf-8"))
    last = [t for t in summary["temperatures"] if t["position"] == summary["positions"][-1]]
    assert sorted(t["temperature"] for t in last) == sorted(nats)
    for t in last:
        for name in ("entropy_nats", "entropy_bits"):
            assert t[name] == pytest.approx(nats[t["temperature"]] * NAMES[name], rel=1e-9), (name, t)


def test_every_entropy_column_of_the_run_s_tables_is_nats(tiny_chain, nats):
    columns = {}
    for path in sorted((tiny_chain / paths.ARTIFACTS).rglob("*.parquet")):
        names = [n for n in pq.read_schema(path).names if n.startswith("entropy")]
        if names:
            columns[path.relative_to(tiny_chain).as_posix()] = names
    assert all(names == ["entropy"] for names in columns.values()), columns     # no other unit, no other name
    frame = pq.read_table(paths.artifact(paths.PROBS_PROMPT_METRICS, tiny_chain)).to_pandas()
    assert len(frame) == len(nats)
    for r in frame.to_dict("records"):
        assert r["entropy"] == pytest.approx(nats[r["temperature"]], rel=1e-9), r
    lens = pq.read_table(part(paths.LENS_SUMMARY, tiny_chain)).to_pandas()
    final = lens[(lens.layer == lens.layer.max()) & (lens.position == lens.position.max())].iloc[0]
    # the lens's last layer is the model's own head in FP64 from the stored residual: nats, within a bf16 rounding
    assert final["entropy"] == pytest.approx(nats[1.0], rel=1e-2)
    assert {p.split("/")[1] for p in columns} >= {"probs", "lens"}


def test_the_sweep_s_per_prompt_entropy_is_the_table_s_nats(tiny_chain, nats):
    figures = sweep.prompt_figures(tiny_chain)
    (fig,) = figures.values()
    assert fig["entropy"] == pytest.approx(nats[fig["T"]], rel=1e-9)
