"""Check results of a prompt set (issue 17 item 5): one row per (prompt, check), failures named by prompt."""

from __future__ import annotations

import json

import pytest

from pipeline.checks import verdicts


def check(name: str, prompt_id: str, measured: float = 0, severity: str = "error") -> verdicts.Check:
    return verdicts.Check(name, "w", measured, 0, severity, prompt_id=prompt_id)


def test_a_check_name_repeats_once_per_prompt_never_twice_in_one():
    table = verdicts.to_table([check("a", "p1"), check("a", "p2"), check("b", "p1")])
    assert table.column_names[0] == "prompt_id"
    assert list(zip(table["prompt_id"].to_pylist(), table["name"].to_pylist())) == [("p1", "a"), ("p2", "a"),
                                                                                     ("p1", "b")]
    with pytest.raises(ValueError, match=r"\('p2', 'a'\)"):
        verdicts.to_table([check("a", "p1"), check("a", "p2"), check("a", "p2")])


def test_failures_are_named_per_prompt_in_run_order():
    results = [check("a", "p1"), check("x", "p2", 1), check("y", "p2", 1), check("r", "p1", 1, "report"),
               check("x", "p3", 1), check("b", "p3")]
    assert verdicts.failed_errors_by_prompt(results) == {"p2": ["x", "y"], "p3": ["x"]}
    assert verdicts.failed_line(results) == "x, y (prompt p2); x (prompt p3)"
    assert verdicts.failed_line([check("x", "", 1)]) == "x"                  # a check of the whole run
    assert verdicts.failed_line(results[:1]) == ""
    m = verdicts.metrics(results)
    assert (m["failed_error"], m["failed_report"]) == (3, 1)
    assert m["failing"] == "x, y, r" and m["failing_prompts"] == "p2, p3"   # each name once, errors first
    many = [check("x", f"p{i}", 1) for i in range(5)]
    assert verdicts.metrics(many)["failing_prompts"] == "p0, p1, p2 +2 more"


def test_stored_rows_key_by_prompt_and_name():
    rows = verdicts.stored_rows(verdicts.to_table([check("a", "p1"), check("a", "p2", 1), check("b", "p2")]))
    assert set(rows) == {("p1", "a"), ("p2", "a"), ("p2", "b")} and rows[("p2", "a")]["verdict"] == "fail"
    assert rows[("p1", "a")]["verdict"] == "pass"


def test_reference_figures_apply_once_in_a_set_where_the_prompt_is_the_references():
    from types import SimpleNamespace

    from pipeline.checks import reference, stage
    from pipeline.config.prompt_set import PromptRecord, PromptSet
    ref_text = reference.load_reference("seed_article")["prompt"]
    cfg = {"model": SimpleNamespace(reference_figures="seed_article", tokenizer=SimpleNamespace(family="qwen2"))}
    with_ref = PromptSet(file="s", prompts=(PromptRecord(id="a", text="Hi"), PromptRecord(id="ref", text=ref_text)))
    assert stage.references(cfg, with_ref) == {"a": [], "ref": [("seed_article", "all")]}
    without = PromptSet(file="s", prompts=(PromptRecord(id="b", text="Yo"), PromptRecord(id="a", text="Hi")))
    assert stage.references(cfg, without) == {"a": [("seed_article", "all")], "b": []}   # once, on the first id
    # no figures configured: the tokenizer figures of a reference whose prompt this is (per prompt)
    cfg["model"].reference_figures = None
    assert stage.references(cfg, with_ref) == {"a": [], "ref": [("seed_article", "tokenizer")]}
    one = PromptSet(file=None, prompts=(PromptRecord(id="a", text="Hi"),))
    assert stage.references(cfg, one) == {"a": []}


# ---------------------------------------------------------------- which prompts of a set are checked
def test_checks_prompts_auto_checks_every_prompt_of_a_set_up_to_the_cap_and_a_fixed_sample_beyond():
    from pipeline.checks.stage import checked_prompts
    from pipeline.config.schema import CHECKED_AUTO
    ids = [f"p{i:05d}" for i in range(CHECKED_AUTO)]
    assert checked_prompts("auto", ids, {}) == ids and checked_prompts("all", ids, {}) == ids
    big = [f"p{i:05d}" for i in range(10 * CHECKED_AUTO)]
    picked = checked_prompts("auto", big, {})
    assert len(picked) == CHECKED_AUTO and picked == sorted(picked)          # in the run's order
    assert picked != big[:CHECKED_AUTO] and picked[-1] > big[CHECKED_AUTO]  # spread over the set, not its head
    assert checked_prompts("auto", big[::-1], {}) == picked[::-1]           # by the ids, not their order
    assert picked[0] == big[0]                      # the report's default prompt (the first id) is always checked
    assert len(set(checked_prompts("auto", big + ["new"], {})) & set(picked)) >= CHECKED_AUTO - 1   # one place moves
    assert checked_prompts("all", big, {}) == big
    assert checked_prompts(5, big, {}) == checked_prompts(5, big[::-1], {})[::-1]
    assert len(checked_prompts(5, big, {})) == 5 and set(checked_prompts(5, big, {})) <= set(picked)


def test_the_prompt_the_reference_figures_are_compared_on_is_always_checked():
    from pipeline.checks.stage import checked_prompts
    big = [f"p{i:05d}" for i in range(1000)]
    outside = next(p for p in big[2:] if p not in checked_prompts(3, big, {}))
    got = checked_prompts(3, big, {outside: ["figure"], big[1]: []})       # an empty list forces nothing
    assert outside in got and big[0] in got and len(got) == 3


def test_a_sample_of_n_holds_n_prompts_the_reference_figures_prompt_first():
    from pipeline.checks.stage import checked_prompts
    big = [f"p{i:05d}" for i in range(1000)]
    assert checked_prompts(1, big, {"p00500": ["figure"]}) == ["p00500"]
    assert checked_prompts(2, big, {"p00500": ["figure"]}) == ["p00000", "p00500"]
    assert checked_prompts(1, big, {}) == ["p00000"]


def test_the_stored_step_logits_sample_is_the_checks_sample_without_the_reference_prompt():
    """`sampling.step_logits` (trajectories) and `checks.prompts` pick by one rule (`prompt_set.fixed_sample`): with no
    reference figures in the set, the prompts the checks read are exactly the ones whose rows are stored."""
    from pipeline.checks.stage import checked_prompts
    from pipeline.config.prompt_set import fixed_sample
    big = [f"p{i:05d}" for i in range(1000)]
    for setting in ("auto", "all", 1, 7):
        assert fixed_sample(setting, big) == checked_prompts(setting, big, {})
    assert fixed_sample(1, big) == [big[0]]                     # a sample of one: the run's first prompt
    with_ref = checked_prompts(3, big, {"p00500": [("seed_article", "tokenizer")]})
    assert "p00500" in with_ref and big[0] in with_ref and len(with_ref) == 3
    assert len(set(with_ref) & set(fixed_sample(3, big))) == 2   # the reference prompt displaces one: re-derived


def test_steps_parquet_says_whether_its_step_logits_are_stored_and_a_file_without_the_fact_is_refused(tmp_path):
    """The trajectories stage writes `step_logits` (stored or derived) into every steps.parquet: a file without
    it (or with another value) is no current run's, refused in one line rather than read as stored."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.errors import UserError
    from pipeline.model.trajectories import step_logits_stored
    from pipeline.store.artifacts import PARQUET_META_KEY

    def steps(name: str, facts: dict | None):
        meta = None if facts is None else {PARQUET_META_KEY: json.dumps(facts).encode()}
        pq.write_table(pa.table({"step": [1]}).replace_schema_metadata(meta), tmp_path / name)
        return tmp_path / name

    assert step_logits_stored(steps("stored.parquet", {"step_logits": "stored"}))
    assert not step_logits_stored(steps("derived.parquet", {"step_logits": "derived"}))
    for name, facts in (("none.parquet", None), ("empty.parquet", {}), ("other.parquet", {"step_logits": "yes"})):
        with pytest.raises(UserError, match=rf"{name}: fact step_logits=.* is not allowed: stored or derived"):
            step_logits_stored(steps(name, facts))


# ---------------------------------------------------------------- step logits rows vs their recorded sha256
def _rows_and_record(n_steps: int = 3):
    import numpy as np

    from pipeline.store import logits_io
    rng = np.random.default_rng(0)
    rows, recorded = [], {}
    for branch in ("sample", "greedy"):
        hashes = []
        for step in range(1, n_steps + 1):
            row = rng.standard_normal(64).astype(np.float32)
            rows.append(({"branch": branch, "kv_cache": False, "step": step}, 4 + step, row))
            hashes.append(logits_io.row_sha256(row))
        recorded[branch] = {"branch": branch, "kv_cache": False, "step_logits_sha256": hashes}
    return rows, recorded


def test_step_logits_sha256_passes_the_rows_the_stage_computed_and_fails_one_flipped_bit():
    import numpy as np

    from pipeline.checks.trajectory import step_logits_sha256
    rows, recorded = _rows_and_record()
    (ok,) = step_logits_sha256(rows, recorded, "stored", "error")
    assert ok.passed and ok.measured == 0
    flipped = [(k, p, r.copy()) for k, p, r in rows]
    flipped[4][2].view(np.uint32)[7] ^= 1                       # greedy step 2, one id's lowest bit
    (bad,) = step_logits_sha256(flipped, recorded, "re-derived", "error")
    assert not bad.passed and bad.measured == 1 and "greedy step 2" in bad.detail
    (short,) = step_logits_sha256(rows[:-1], recorded, "stored", "error")   # a row missing
    assert short.measured == 1 and "greedy step 3" in short.detail
    old = {name: {k: v for k, v in run.items() if k != "step_logits_sha256"} for name, run in recorded.items()}
    (none,) = step_logits_sha256(rows, old, "stored", "error")              # no hashes recorded: every row fails
    assert not none.passed and none.measured == len(rows)


def test_row_sha256_of_a_bf16_row_is_that_of_the_row_read_back_from_its_file(tmp_path):
    import torch

    from pipeline.store import logits_io
    row = torch.randn(1000).to(torch.bfloat16)
    logits_io.write_step_logits(tmp_path / "s.parquet", [(3, row)], [{"branch": "greedy", "kv_cache": False,
                                                                     "step": 1}], {})
    ((_, _, back),) = logits_io.read_step_logits(tmp_path / "s.parquet")
    assert logits_io.row_sha256(back) == logits_io.row_sha256(logits_io.widened(row))
    other = row.clone()
    other.view(torch.int16)[0] ^= 1                              # one bf16 ulp on one id
    assert logits_io.row_sha256(logits_io.widened(other)) != logits_io.row_sha256(back)


def test_verify_names_the_first_step_whose_recorded_row_sha256_differs():
    from pipeline.tools.verify import step_hashes_difference
    _, a = _rows_and_record()
    assert step_hashes_difference(a, json.loads(json.dumps(a))) is None
    b = json.loads(json.dumps(a))
    b["greedy"]["step_logits_sha256"][1] = "f" * 64
    got = step_hashes_difference(a, b)
    assert got.startswith("greedy step 2: the row's sha256 differs (then ") and f"now {'f' * 12}" in got
    assert "stored" not in got and "re-derived" not in got      # verify's then/now labels stay whole
    b["greedy"]["step_logits_sha256"].pop()                     # a run with a step fewer
    b["greedy"]["step_logits_sha256"][1] = a["greedy"]["step_logits_sha256"][1]
    assert step_hashes_difference(a, b).startswith("greedy step 3: ") and "now -" in step_hashes_difference(a, b)
