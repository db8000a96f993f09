"""The report's run conditions (pipeline/report/conditions.py): the Stages table lists every stage of the graph,
and the title names which model ran, not only the kind of source (issue 50)."""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.report import conditions
from pipeline.store import paths

REPO = Path(__file__).resolve().parents[2]


def _manifest(stage: str, k: int) -> dict:
    return {"stage": stage, "created_at": f"2026-12-05T10:00:{k:02d}+00:00", "duration_s": k + 0.5,
            "hardware": {"cpu_model": "cpu-x", "gpus": []}, "config_sha256": f"{k:02d}" * 32,
            "git": {"commit": f"c{k:02d}" * 10}}


def test_the_stages_table_has_a_row_per_stage_of_dvc_yaml_in_its_order():
    graph = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    ran = {s: _manifest(s, k) for k, s in enumerate(graph) if s not in ("equivalence", "report")}
    rows = conditions.stage_rows(ran)
    assert [r[0] for r in rows] == graph
    by = {r[0]: r for r in rows}
    for s, m in ran.items():      # each row is its own stage's record, not a neighbour's
        assert by[s][1:3] == [m["created_at"], m["duration_s"]] and by[s][5] == m["config_sha256"][:12]
        assert by[s][6] == m["git"]["commit"]
    assert by["equivalence"][1] == "not run (no manifest)"
    assert by["report"][1] == "this report" and paths.manifest_path("report").as_posix() in by["report"][6]


def test_the_title_names_a_local_models_folder_and_type_and_keeps_a_named_config():
    local = {"name": "local", "kind": "local", "snapshot_dir": "/data/models/my-qwen-0.5b", "path": "../my-qwen-0.5b",
             "model": {"model_type": "qwen2"}}
    assert conditions.model_title(local) == "my-qwen-0.5b (qwen2, model=local)"
    hub = {"name": "hub", "kind": "hub", "hub_id": "Qwen/Qwen2.5-0.5B", "model": {"model_type": "qwen2"}}
    assert conditions.model_title(hub) == "Qwen/Qwen2.5-0.5B (qwen2, model=hub)"
    tiny = {"name": "tiny", "kind": "tiny", "family": "llama", "model": {"model_type": "llama"}}
    assert conditions.model_title(tiny) == "tiny (llama)"
    for named in ({"name": "tiny_qwen2", "kind": "tiny", "family": "qwen2"}, {"name": "qwen2_5_7b", "kind": "hub"},
                  {"name": "mine", "kind": "local", "snapshot_dir": "/x/y"}):
        assert conditions.model_title(named) == named["name"]
