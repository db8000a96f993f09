"""Chat prompts (issue 26 item 4): `prompt.chat=true` or `messages` in a set record render the prompt
with the tokenizer's own template; tokenize.json records the rendered text and the messages; a check
compares the ids with `apply_chat_template(tokenize=True)`; the report shows the rendered text."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from transformers import AutoTokenizer

from pipeline.config.prompt_set import PromptRecord
from pipeline.errors import UserError
from pipeline.model import tokenization
from pipeline.store import paths
from tests.conftest import TEST_STEPS, make_workspace, run_module
from tests.helpers.inprocess import run_chain
from tests.helpers.partitions import part

pytestmark = pytest.mark.slow


def _tokenizer(ws):
    return AutoTokenizer.from_pretrained(ws / "artifacts/prepare_model", local_files_only=True)


def _failing_errors(ws) -> pd.DataFrame:
    checks = pd.read_parquet(ws / "artifacts/checks/checks.parquet")
    return checks[(checks.severity == "error") & (checks.verdict != "pass")]


def test_chat_prompt_runs_and_the_report_shows_the_rendered_text(tmp_path):
    ws = make_workspace(tmp_path / "ws", ["model=tiny_qwen2", "prompt.chat=true", "--prompt", "Why is the sky blue?"])
    run_chain(ws)
    summary = json.loads(part(paths.TOKENIZE_SUMMARY, ws).read_text())
    rendered = summary["prompt"]
    assert summary["chat"] is True and summary["messages"] == [{"role": "user", "content": "Why is the sky blue?"}]
    assert rendered.startswith("<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n")
    assert summary["add_special_tokens"] is False and summary["round_trip_ok"] is True
    tok = _tokenizer(ws)
    want = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert rendered == want and summary["token_ids"] == tok(want, add_special_tokens=False).input_ids
    checks = pd.read_parquet(ws / "artifacts/checks/checks.parquet")
    assert checks.loc[checks.name == "chat_template_ids", "verdict"].tolist() == ["pass"]
    assert _failing_errors(ws).empty
    report = (ws / "artifacts/report/report.md").read_text()
    assert "rendered by the tokenizer's own chat template" in report and "<|im_start|>assistant" in report
    # the template's special tokens are named with their positions (here <|im_start|> opens the prompt)
    special = summary["special_positions"]
    assert special and special[0] == 0 and f"Special tokens of the template ({len(special)}): " in report
    assert '`"<|im_start|>"` at 0' in report


def test_a_set_with_messages_records(tmp_path):
    ws = make_workspace(tmp_path / "ws", ["model=tiny_qwen2"])
    (ws / "prompts").mkdir()
    lines = [{"id": "plain", "text": "The capital of France is"},
             {"id": "chat", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Capital of France?"}]}]
    (ws / "prompts/mixed.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_module("pipeline.tools.cli", ws, "compose", TEST_STEPS, "model=tiny_qwen2", "capture.device=cpu",
               "--prompt-set", "prompts/mixed.jsonl", check=True)
    run_chain(ws)
    chat = json.loads(paths.partition(paths.TOKENIZE_SUMMARY, "chat", ws).read_text())
    plain = json.loads(paths.partition(paths.TOKENIZE_SUMMARY, "plain", ws).read_text())
    assert chat["chat"] and chat["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert not plain["chat"] and plain["prompt"] == "The capital of France is"
    assert _failing_errors(ws).empty


def test_a_tokenizer_without_a_template_is_refused_in_one_line(tiny_workspace):
    tok = _tokenizer(tiny_workspace)
    tok.chat_template = None
    record = PromptRecord(id="a", text="hi").as_chat()
    with pytest.raises(UserError, match=r"^prompt.text is a chat prompt, but this model's tokenizer has no chat "
                                        r"template .*: give the prompt as plain text"):
        tokenization.prompt_for(tok, record, True)


def test_the_chat_check_fails_on_ids_the_template_does_not_give(tiny_workspace):
    from pipeline.checks import suite
    tok = _tokenizer(tiny_workspace)
    record = PromptRecord(id="a", text="hi").as_chat()
    good = tokenization.chat_template_ids(tok, record)
    assert suite.chat_template(tok, record, good)[0].passed
    assert not suite.chat_template(tok, record, good[:-1] + [good[-1] + 1])[0].passed
    assert suite.chat_template(tok, PromptRecord(id="a", text="hi"), good) == []
