"""Prompt sets (issue 17, items 1, 2 and 7): a `prompts/<name>.jsonl` file read into frozen records, and a
single prompt as a set of one.

Every bad set is one line naming the key, the file, the line number (physical lines: blank lines
count) and what is allowed; the demo set `prompts/concepts.jsonl` parses and holds the reference
prompt exactly as conf/ states it; the configured single prompt and the same prompt read from a
set are the same record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pipeline.config import prompt_set, schema
from pipeline.errors import UserError

REPO = Path(__file__).resolve().parents[2]
REFERENCE = yaml.safe_load((REPO / "conf/prompt/temperature_question.yaml").read_text(encoding="utf-8"))
KEY = "prompt.set"
LINE = prompt_set.LINE
ID_RULE = prompt_set.ID_ALLOWED
GOOD = b'{"id": "a", "text": "one"}\n'


def _read(root: Path, data: bytes, name: str = "s.jsonl", max_size: int = 64) -> prompt_set.PromptSet:
    (root / "prompts").mkdir(exist_ok=True)
    (root / "prompts" / name).write_bytes(data)
    return prompt_set.read_set(KEY, f"prompts/{name}", root, max_size)


def _refused(root: Path, data: bytes, name: str = "s.jsonl", max_size: int = 64) -> str:
    with pytest.raises(UserError) as err:
        _read(root, data, name, max_size)
    message = str(err.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- the good path
def test_a_set_is_read_in_file_order_with_blank_lines_skipped(tmp_path):
    data = ('\n{"id": "b.2", "text": "问题\\n回答：", "expected_token_ids": {"qwen2": [0, 5]}}\r\n'
            '   \n{"id": "A_1", "text": " lead and trail "}\n\n').encode()
    got = _read(tmp_path, data)
    assert got.file == "prompts/s.jsonl" and got.ids == ("b.2", "A_1")
    first, second = got.prompts
    assert first.text == "问题\n回答：" and first.expected_ids_for("qwen2") == [0, 5]
    assert first.expected_ids_for("gemma3") is None
    assert second.text == " lead and trail " and second.expected_token_ids == {}
    assert got.get("A_1") is second


def test_lines_end_at_newline_only(tmp_path):
    """U+2028 and U+2029, legal raw inside a JSON string, end a line for str.splitlines(), not here."""
    data = '{"id": "a", "text": "one\u2028two\u2029three"}\n{"id": "a", "text": "x"}\n'.encode()
    assert " line 2: id='a'" in _refused(tmp_path, data)
    assert _read(tmp_path, data[:data.index(b"\n") + 1]).prompts[0].text == "one\u2028two\u2029three"


def test_records_are_frozen():
    record = prompt_set.PromptRecord(id="a", text="x")
    with pytest.raises(ValidationError):
        record.text = "y"


def test_get_names_the_ids_of_the_set(tmp_path):
    got = _read(tmp_path, GOOD + b'{"id": "b", "text": "two"}\n')
    with pytest.raises(UserError, match=r"^prompt_id='c' is not allowed: an id of this set: a, b$"):
        got.get("c")


def test_exactly_the_limit_is_allowed(tmp_path):
    data = b"".join(b'{"id": "p%d", "text": "x"}\n' % i for i in range(64))
    assert len(_read(tmp_path, data).prompts) == 64


def test_the_limit_is_the_config_key_default_64(tmp_path):
    prompt = schema.load_section({"prompt": REFERENCE}, "prompt")
    assert prompt.max_set_size == schema.MAX_SET_SIZE == 10000
    changed = schema.load_section({"prompt": {**REFERENCE, "max_set_size": 3}}, "prompt")
    assert changed.max_set_size == 3
    with pytest.raises(UserError, match=r"^prompt\.max_set_size=0 is not allowed: an integer >= 1$"):
        schema.load_section({"prompt": {**REFERENCE, "max_set_size": 0}}, "prompt")


# ---------------------------------------------------------------- every bad set, the exact line
BAD = [
    ("duplicate id", b'{"id": "a", "text": "x"}\n\n{"id": "a", "text": "y"}\n',
     "line 3: id='a' is not allowed: an id no other line has, ignoring case (line 1 has 'a')"),
    ("duplicate id, other case", b'{"id": "Intro", "text": "x"}\n{"id": "intro", "text": "y"}\n',
     "line 2: id='intro' is not allowed: an id no other line has, ignoring case (line 1 has 'Intro')"),
    ("id with a space", GOOD + b'{"id": "a b", "text": "x"}\n', f"line 2: id='a b' is not allowed: {ID_RULE}"),
    ("id with a slash", b'{"id": "../x", "text": "x"}\n', f"line 1: id='../x' is not allowed: {ID_RULE}"),
    ("id of 65 characters", b'{"id": "%s", "text": "x"}\n' % (b"a" * 65),
     f"line 1: id='{'a' * 60}...' is not allowed: {ID_RULE}"),        # long values shortened, as in schema
    ("id starting with a dot", b'{"id": ".hidden", "text": "x"}\n', f"line 1: id='.hidden' is not allowed: {ID_RULE}"),
    ("id empty", b'{"id": "", "text": "x"}\n', f"line 1: id='' is not allowed: {ID_RULE}"),
    ("id a number", b'{"id": 7, "text": "x"}\n', f"line 1: id=7 is not allowed: {ID_RULE}"),
    ("empty text", b'{"id": "a", "text": ""}\n', "line 1: text='' is not allowed: a non-empty string"),
    ("white space text", b'{"id": "a", "text": " \\n\\t"}\n',
     "line 1: text=' \\n\\t' is not allowed: a non-empty string"),
    ("text null", b'{"id": "a", "text": null}\n', "line 1: text=None is not allowed: a non-empty string"),
    ("text with an escape", b'{"id": "a", "text": "x\\u001b[1m"}\n',
     "line 1: text='x\\x1b[1m' is not allowed: U+001B at character 1 (line 1); allowed: " + schema.PROMPT_ALLOWED),
    ("invalid UTF-8", GOOD + b'\n{"id": "b", "text": "caf\xe9"}\n',
     "line 3: not UTF-8 (byte 0xe9 at offset 52); allowed: a UTF-8 text file"),
    ("a list, not an object", GOOD + b'["a", "x"]\n', f"line 2: a JSON list, not an object; allowed: {LINE}"),
    ("a string, not an object", b'"just text"\n', f"line 1: a JSON string, not an object; allowed: {LINE}"),
    ("not JSON", GOOD + b"id: a, text: x\n",
     f"line 2: not JSON (Expecting value at column 1); allowed: {LINE}"),
    ("an unterminated string", b'{"id": "a", "text": "x}\n',      # json's message ends in "at": said once
     f"line 1: not JSON (Unterminated string starting at column 21); allowed: {LINE}"),
    ("a raw control character", b'{"id": "a", "text": "x\ty"}\n',
     f"line 1: not JSON (Invalid control character at column 23); allowed: {LINE}"),
    ("two objects on one line", b'{"id": "a", "text": "x"} {"id": "b", "text": "y"}\n',
     f"line 1: not JSON (Extra data at column 26); allowed: {LINE}"),
    ("a key twice", b'{"id": "a", "text": "x", "id": "b"}\n',
     f"line 1: not JSON (key 'id' appears twice in one object); allowed: {LINE}"),
    ("unknown key", b'{"id": "a", "text": "x", "name": "y"}\n',
     "line 1: name='y' is not allowed: a known key: id, text, messages, expected_token_ids"),
    ("missing id", b'{"text": "x"}\n', f"line 1: id is missing; allowed: {LINE}"),
    ("missing text", b'{"id": "a"}\n', f"line 1: text is missing; allowed: {LINE}"),
    ("negative expected id", b'{"id": "a", "text": "x", "expected_token_ids": {"qwen2": [1, -1]}}\n',
     "line 1: expected_token_ids.qwen2=-1 is not allowed: an integer >= 0"),
    ("boolean expected id", b'{"id": "a", "text": "x", "expected_token_ids": {"qwen2": [true]}}\n',
     "line 1: expected_token_ids.qwen2=True is not allowed: an integer >= 0"),
    ("expected ids a list", b'{"id": "a", "text": "x", "expected_token_ids": [1]}\n',
     "line 1: expected_token_ids=[1] is not allowed: a mapping tokenizer family -> list of ids"),
    ("text and messages", b'{"id": "a", "text": "x", "messages": [{"role": "user", "content": "x"}]}\n',
     f"line 1: text and messages are both given; allowed: {LINE}"),
    ("messages empty", b'{"id": "a", "messages": []}\n',
     'line 1: messages=[] is not allowed: a non-empty list of {"role": ..., "content": ...} objects'),
    ("message without content", b'{"id": "a", "messages": [{"role": "user"}]}\n',
     """line 1: messages[0]={'role': 'user'} is not allowed: an object with exactly role and content"""),
    ("message role empty", b'{"id": "a", "messages": [{"role": " ", "content": "x"}]}\n',
     "line 1: messages[0].role=' ' is not allowed: a non-empty string"),
]


@pytest.mark.parametrize(("data", "message"), [(d, m) for _, d, m in BAD], ids=[c for c, _, _ in BAD])
def test_a_bad_line_is_named_with_its_number(tmp_path, data, message):
    assert _refused(tmp_path, data) == f"{KEY}='prompts/s.jsonl' {message}"


def test_line_numbers_count_blank_and_crlf_lines(tmp_path):
    """The number is the physical line an editor shows, whatever blank lines and line ends come before."""
    data = b'\r\n{"id": "a", "text": "x"}\r\n\r\n  \r\n{"id": "a", "text": "y"}\r\n'
    assert " line 5: id='a'" in _refused(tmp_path, data)


def test_more_prompts_than_the_limit(tmp_path):
    data = b'{"id": "p0", "text": "x"}\n\n' + b"".join(b'{"id": "p%d", "text": "x"}\n' % i for i in range(1, 4))
    assert _refused(tmp_path, data, max_size=3) == (
        f"{KEY}='prompts/s.jsonl' line 5: prompt 4 is not allowed: at most prompt.max_set_size=3 prompts in a set "
        "(split the file, or set prompt.max_set_size)")


def test_a_set_without_prompts(tmp_path):
    assert _refused(tmp_path, b"\n  \n\r\n") == (
        f"{KEY}='prompts/s.jsonl' is not allowed: a set with at least one prompt (this file has none): {LINE}")


def test_a_set_that_is_not_jsonl(tmp_path):
    assert _refused(tmp_path, GOOD, name="s.txt") == (
        f"{KEY}='prompts/s.txt' is not allowed: a JSON Lines file named *.jsonl under prompts/ (a prompt set)")


def _outside(resolved: str) -> str:
    """What prompt_path says of a path that resolves outside prompts/ (tmp: the repository)."""
    return (f"a file under prompts/ inside the repository, e.g. prompts/s.jsonl (it resolves to {resolved}, "
            "outside {tmp}/prompts)")


# One rule for every path: where it resolves (so .., absolute paths and ~ need no rule of their own).
@pytest.mark.parametrize(("value", "allowed"), [
    ("../s.jsonl", _outside("{tmp.parent}/s.jsonl")),
    ("/etc/s.jsonl", _outside("/etc/s.jsonl")),
    ("~/s.jsonl", _outside("{tmp}/~/s.jsonl")),
    ("prompts/../../s.jsonl", _outside("{tmp.parent}/s.jsonl")),
    ("conf/s.jsonl", _outside("{tmp}/conf/s.jsonl")),
    ("prompts/none.jsonl", "an existing file under prompts/ inside the repository, relative to its root"),
])
def test_a_path_outside_prompts_or_missing(tmp_path, value, allowed):
    (tmp_path / "prompts").mkdir()
    (tmp_path.parent / "s.jsonl").write_bytes(GOOD)     # what ../s.jsonl would read
    with pytest.raises(UserError) as err:
        prompt_set.read_set(KEY, value, tmp_path, 64)
    assert str(err.value) == f"{KEY}={value!r} is not allowed: {allowed.format(tmp=tmp_path.resolve())}"


def test_a_symlink_out_of_prompts(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "notes.jsonl").write_bytes(GOOD)
    (tmp_path / "prompts/s.jsonl").symlink_to("../notes.jsonl")
    with pytest.raises(UserError, match=r"^prompt\.set='prompts/s\.jsonl' is not allowed: a file under prompts/ "
                                        r"inside the repository, e\.g\. prompts/notes\.jsonl \(it resolves to "
                                        r".*notes\.jsonl, outside "):
        prompt_set.read_set(KEY, "prompts/s.jsonl", tmp_path, 64)


# ---------------------------------------------------------------- the demo set
def test_the_demo_set_parses_and_holds_the_reference_prompt():
    demo = prompt_set.read_set(KEY, "prompts/concepts.jsonl", REPO, schema.MAX_SET_SIZE)
    assert 12 <= len(demo.prompts) <= 20
    reference = demo.get("temperature_question")
    assert reference.text == REFERENCE["text"]
    assert schema.text_sha256(reference.text) == REFERENCE["known"]["text_sha256"]
    assert reference.expected_token_ids == REFERENCE["known"]["expected_token_ids"]
    texts = [p.text for p in demo.prompts]
    assert len(set(texts)) == len(texts)
    cjk = [p.id for p in demo.prompts if re.search(r"[\u4e00-\u9fff]", p.text)]
    assert "capital_china_zh" in cjk and "temperature_question" in cjk
    assert not re.search(r"[^\x00-\x7f]", demo.get("temperature_question_en").text)
    assert re.search(r"[A-Za-z]$", demo.get("midword_beauti").text)           # ends mid-word
    assert demo.get("list_repeat_ones").text.count("1.") >= 3                   # invites a loop


# ---------------------------------------------------------------- a single prompt is a set of one
def test_the_reference_prompt_alone_is_the_demo_sets_record():
    single = prompt_set.for_config(schema.load_section({"prompt": REFERENCE}, "prompt"))
    demo = prompt_set.read_set(KEY, "prompts/concepts.jsonl", REPO, schema.MAX_SET_SIZE)
    assert single.file is None and single.ids == ("temperature_question",)
    assert single.prompts[0] == demo.get("temperature_question")


def test_a_prompt_file_and_a_one_line_set_give_the_same_record(tmp_path):
    text = "Hello\tworld\n问题"
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/hello.txt").write_text(text, encoding="utf-8")
    config = {**REFERENCE, "text": None, "file": "prompts/hello.txt"}
    single = prompt_set.for_config(schema.load_section({"prompt": config}, "prompt", tmp_path))
    assert single.ids == (f"hello-{schema.text_sha256(text)[:8]}",)     # the run's prompt name
    line = json.dumps({"id": single.ids[0], "text": text}).encode()
    assert single.prompts == _read(tmp_path, line).prompts


def test_a_named_prompt_keeps_its_name_and_no_expected_ids():
    config = {**REFERENCE, "text": "The capital of France is", "name": "capital_france"}
    single = prompt_set.for_config(schema.load_section({"prompt": config}, "prompt"))
    assert single.prompts == (prompt_set.PromptRecord(id="capital_france", text="The capital of France is"),)


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("temperature_question", "t", "temperature_question"),
    (None, "问题：实践中？\n回答：", "prompt-{sha}"),          # derived from Chinese words
    (None, "问题：LLM 的 temperature", "llm-{sha}"),            # 问题_llm_的: the ASCII part kept
    ("my prompt!", "t", "my_prompt-{sha}"),
    ("../up", "t", "up-{sha}"),
    ("x" * 80, "t", "x" * 55 + "-{sha}"),
    ("été", "t", "t-{sha}"),
])
def test_a_name_that_is_not_an_id_becomes_one(name, text, expected):
    config = {**REFERENCE, "text": text, "name": name}
    prompt = schema.load_section({"prompt": config}, "prompt")
    got = prompt_set.for_config(prompt).ids[0]
    assert got == expected.format(sha=schema.text_sha256(text)[:8])
    assert re.fullmatch(prompt_set.ID_PATTERN, got)


# ---------------------------------------------------------------- the key prompt.set
def test_prompt_set_key_reads_the_set_and_names_the_run_after_the_file(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/two.jsonl").write_bytes(GOOD + b'{"id": "b", "text": "two"}\n')
    config = {**REFERENCE, "text": None, "set": "prompts/two.jsonl"}
    prompt = schema.load_section({"prompt": config}, "prompt", tmp_path)
    assert prompt.name == "two" and prompt.text is None
    got = prompt_set.for_config(prompt, tmp_path)
    assert got.file == "prompts/two.jsonl" and got.ids == ("a", "b")
    assert prompt_set.resolved(prompt, tmp_path) == {
        "text": None, "prompts": [{"id": "a", "text": "one", "expected_token_ids": {}},
                                  {"id": "b", "text": "two", "expected_token_ids": {}}]}


def test_a_single_prompt_resolves_to_its_text_alone():
    prompt = schema.load_section({"prompt": REFERENCE}, "prompt")
    assert prompt_set.resolved(prompt) == {"text": REFERENCE["text"]}     # what validate wrote before sets


def test_the_set_limit_is_the_configured_one(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/two.jsonl").write_bytes(GOOD + b'{"id": "b", "text": "two"}\n')
    config = {**REFERENCE, "text": None, "set": "prompts/two.jsonl", "max_set_size": 1}
    with pytest.raises(UserError, match=r"line 2: prompt 2 is not allowed: at most prompt.max_set_size=1"):
        prompt_set.for_config(schema.load_section({"prompt": config}, "prompt", tmp_path), tmp_path)


def test_prompt_concepts_composes_to_the_demo_set():
    option = yaml.safe_load((REPO / "conf/prompt/concepts.yaml").read_text(encoding="utf-8"))
    prompt = schema.load_section({"prompt": option}, "prompt", REPO)
    assert prompt.name == "concepts"
    assert prompt_set.for_config(prompt, REPO) == prompt_set.read_set(KEY, "prompts/concepts.jsonl", REPO, 64)
