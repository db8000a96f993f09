"""The explorer's what-if data (issue 47 item 4), without a browser: each forced branch reaches the page with the id,
rank and step it forced (the page looks a branch up by that id), and the walk's what-if step names, per branch, the
forced step's own row (not the branch's first) and the text the branch ended with."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.report import explorer, explorer_walk


def _row(branch, step, token, prob, text, forced=None, kv=False):
    f = forced or (None, None, None)
    return {"branch": branch, "kv_cache": kv, "step": step, "token_id": token, "prob": prob, "text_so_far": text,
            "piece": f"p{token}", "rank": 1, "top_ids": [token, token + 1], "top_probs": [prob, prob / 2],
            "stop_reason": None, "forced_step": f[0], "forced_token_id": f[1], "forced_rank": f[2]}


def _inp():
    steps = [_row("greedy", 1, 10, 0.5, "A"), _row("greedy", 2, 11, 0.4, "AB"),
             # forced at step 1 (the bars' position), listed out of step order
             _row("forced_r2", 2, 21, 0.3, "XY", (1, 20, 2), True),
             _row("forced_r2", 1, 20, 0.2, "X", (1, 20, 2), True),
             # what_if_depth 2: the greedy run's first token kept, the second forced
             _row("forced_s2_r3", 1, 10, 0.5, "A", (2, 30, 3), True),
             _row("forced_s2_r3", 2, 30, 0.1, "AZ", (2, 30, 3), True)]
    return SimpleNamespace(steps=steps, vocab={20: {"text": "X"}, 30: {"text": "Z"}}, prompt_metrics=[])


def test_each_forced_branch_reaches_the_page_with_the_id_rank_and_step_it_forced():
    got = {b["branch"]: b["forced"] for b in explorer._trajectories(_inp(), {})}
    assert got == {"greedy": None, "forced_r2": {"step": 1, "id": 20, "rank": 2},
                   "forced_s2_r3": {"step": 2, "id": 30, "rank": 3}}


def test_the_walk_names_each_branch_s_forced_row_and_its_last_text():
    nums = explorer_walk._what_if(_inp(), "steps.parquet")
    assert [n["value"] for n in nums] == ["20 'X' (20.00%) → 'XY'", "30 'Z' (10.00%) → 'AZ'"]
    assert [n["source"] for n in nums] == ["steps.parquet"] * 2
    assert "rank 3, step 2" in nums[1]["label"]["en"] and "排名 3，第 2 步" in nums[1]["label"]["zh"]
    assert explorer_walk._what_if(SimpleNamespace(steps=_inp().steps[:2], vocab={}), "s") == []
