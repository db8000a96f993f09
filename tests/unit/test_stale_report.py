"""A report that is no longer the current run's says so (issue 50): pipeline.store.artifacts.mark_report_stale,
which a stage feeding the report runs when it starts its work, and the note a failing stage's line ends with."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.store import artifacts, paths

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PARAMS_SHA = "fedcba98" * 8
STARTED = "2026-12-05T23:00:00+00:00"
HEAD = '<!doctype html><html><head><title>x &amp; y</title></head><body class="page">'


def _report(root: Path, pages: tuple[str, ...] = ("explorer.html", "explorer-b.html")) -> dict[str, str]:
    folder = paths.stage_dir("report", root)
    folder.mkdir(parents=True)
    paths.manifest_path("report", root).write_text(json.dumps(
        {"stage": "report", "git": {"commit": COMMIT, "dirty": True}, "facts": {"params_sha256": PARAMS_SHA},
         "created_at": "2026-12-05T22:00:00+00:00", "outputs": []}))
    files = {"report.md": "# Next-token report: tiny_qwen2 on prompt q\n\ntext\n"}
    files |= {p: f"{HEAD}<main>{p} <b>page</b></main></body></html>" for p in pages}
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return files


def test_each_page_is_replaced_by_a_new_file_that_says_whose_it_is(tmp_path):
    before = _report(tmp_path)
    folder = paths.stage_dir("report", tmp_path)
    cache = {n: tmp_path / f"cache-{n}" for n in before}          # DVC's cache, hard-linked to the outputs
    for name, link in cache.items():
        os.link(folder / name, link)
    assert artifacts.mark_report_stale("forward", tmp_path, started=STARTED) == folder / "report.md"

    md = (folder / "report.md").read_text(encoding="utf-8")
    first, rest = md.split("\n\n", 1)
    assert first.startswith(artifacts.STALE_MD) and rest == before["report.md"]
    for fact in (f"git commit {COMMIT[:12]} (dirty)", f"params.yaml sha256 {PARAMS_SHA[:12]}",
                 "made 2026-12-05T22:00:00+00:00", f"started {STARTED} in stage forward"):
        assert fact in first, fact
    for name in ("explorer.html", "explorer-b.html"):
        html = (folder / name).read_text(encoding="utf-8")
        banner = f'<div id="{artifacts.STALE_HTML_ID}"'
        assert html.startswith(HEAD + banner)                         # right after <body ...>
        end = html.index("</div>", len(HEAD)) + len("</div>")
        assert html[:len(HEAD)] + html[end:] == before[name]          # the page itself untouched
        assert "stage forward" in html[len(HEAD):end] and COMMIT[:12] in html[len(HEAD):end]
    for name, link in cache.items():                                  # nothing edited in place
        assert link.read_text(encoding="utf-8") == before[name]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*before, paths.MANIFEST])   # no temp file left

    again = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert artifacts.mark_report_stale("probs", tmp_path) == folder / "report.md"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == again   # the first mark stays, once
    note = artifacts.stale_report_note(tmp_path)
    assert note.startswith("; the last good report, of an earlier run (git commit 0123456789ab (dirty)")
    assert note.endswith("is artifacts/report/report.md (marked stale)")


def test_nothing_is_marked_or_noted_without_a_report_and_an_unmarked_one_is_no_note(tmp_path):
    assert artifacts.mark_report_stale("forward", tmp_path) is None
    assert artifacts.stale_report_note(tmp_path) == ""
    _report(tmp_path)
    assert artifacts.stale_report_note(tmp_path) == ""


def test_a_page_that_cannot_be_read_goes_rather_than_look_current(tmp_path):
    _report(tmp_path)
    page = paths.stage_dir("report", tmp_path) / "explorer.html"
    page.write_bytes(b"<body>\xff\xfe not utf-8")
    paths.manifest_path("report", tmp_path).write_text("{not json")
    artifacts.mark_report_stale("logits", tmp_path)
    assert not page.exists()
    first = paths.artifact(paths.REPORT, tmp_path).read_text(encoding="utf-8").splitlines()[0]
    assert "an earlier run (its manifest is unreadable)" in first and "stage logits" in first


@pytest.mark.parametrize("entry, stage, marked", [(None, "probs", False), ("probs", "probs", True),
                                                  ("validate", "validate", False), ("checks", "probs", False)])
def test_stage_run_marks_only_for_its_own_entry_point_and_not_validate(entry, stage, marked, tmp_path, monkeypatch):
    """A stage run from `stage_main` marks the report when its work starts (before it could fail or be killed);
    `nexttoken verify` runs stage bodies through stage_run alone, in a folder whose artifacts/report is the real
    one: it marks nothing."""
    _report(tmp_path)
    monkeypatch.setattr(artifacts, "_entry_stage", entry)
    with pytest.raises(UserError), artifacts.stage_run(stage, {}, tmp_path):
        raise UserError("the stage fails")
    assert bool(artifacts.stale_report_note(tmp_path)) == marked


def test_stage_main_ends_a_failing_stages_line_with_the_last_good_report(tmp_path, monkeypatch, capsys):
    _report(tmp_path)
    monkeypatch.chdir(tmp_path)

    def body():
        with artifacts.stage_run("trajectories", {}, "."):
            raise UserError("input artifacts/tokenize/tokens is missing")
    with pytest.raises(SystemExit) as stop:
        artifacts.stage_main("trajectories", body)
    assert stop.value.code == 2 and artifacts._entry_stage is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nexttoken trajectories: error: input artifacts/tokenize/tokens "
                                                   "is missing; the last good report, of an earlier run (git commit ")
    assert "stage trajectories" in paths.artifact(paths.REPORT, tmp_path).read_text(encoding="utf-8")


def test_a_stage_failing_before_its_work_started_marks_the_report_too(tmp_path, monkeypatch, capsys):
    """Under DVC a stage's outputs are gone before it runs: one that stops before its stage_run (a memory guard,
    a bad setting) leaves a broken chain, so the report is marked then; validate's refusal changes nothing."""
    before = _report(tmp_path)
    monkeypatch.chdir(tmp_path)

    def refuse():
        raise UserError("not enough memory for the forward pass")
    with pytest.raises(SystemExit):
        artifacts.stage_main("validate", refuse)
    assert paths.artifact(paths.REPORT, tmp_path).read_text(encoding="utf-8") == before["report.md"]
    assert capsys.readouterr().err == "nexttoken validate: error: not enough memory for the forward pass\n"
    with pytest.raises(SystemExit):
        artifacts.stage_main("forward", refuse)
    assert "stage forward" in paths.artifact(paths.REPORT, tmp_path).read_text(encoding="utf-8").splitlines()[0]
    assert capsys.readouterr().err.startswith("nexttoken forward: error: not enough memory for the forward pass; "
                                              "the last good report, of an earlier run (git commit 0123456789ab")
