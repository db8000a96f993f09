"""bench/manifest_scale.py (docs/scale.md's 1,000,000-prompt projection): its synthetic manifest has a real
manifest's record shape, and its figures are measured (the file grows with N, the writer's and the parser's
figures come from their own processes)."""

from __future__ import annotations

import json

from bench import manifest_scale
from pipeline.store import provenance


def test_the_synthetic_records_have_a_real_manifest_s_shape():
    m = manifest_scale.manifest(3)
    assert len(m["outputs"]) == 6 and len(m["inputs"]) == 6 and len(m["prompt_facts"]) == 3
    record = m["outputs"][0]
    assert set(record) == {"path", "bytes", "mtime_ns", "sha256", "logical_sha256"}
    assert len(record["sha256"]) == 64 and record["path"].startswith("artifacts/forward/capture/prompt_id=q0000000/")
    assert provenance.canonical_json(m)                          # serialisable as the stages' JSON is


def test_the_figures_grow_with_the_set(tmp_path):
    out = tmp_path / "scale.json"
    manifest_scale.main(["--sizes", "200", "800", "--out", str(out)])
    small, large = json.loads(out.read_text())
    assert 3.5 < large["mb"] / small["mb"] < 4.5 and large["outputs"] == 1600
    assert small["write_s"] > 0 and large["parse_s"] > 0 and 1.0 < small["kb_per_prompt"] < 2.0


def test_a_set_size_below_one_is_refused_in_one_line(tmp_path, capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        manifest_scale.main(["--sizes", "0", "--out", str(tmp_path / "scale.json")])
    assert e.value.code == 2 and "'0': a set size is an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "scale.json").exists()
