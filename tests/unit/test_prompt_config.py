"""Prompts given verbatim (issue 13, items 3 and 4): Hydra quoting, and names and expected ids that
belong to one exact text.

`nexttoken compose --prompt TEXT` quotes TEXT for Hydra; the composed params.yaml must hold it
unchanged, through Hydra's parser and OmegaConf's interpolation. A prompt's name and expected
ids (`prompt.known`) hold only for the text whose sha256 they record.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.config import compose, schema
from pipeline.errors import UserError
from pipeline.tools import cli

REPO = Path(__file__).resolve().parents[2]
REFERENCE = yaml.safe_load((REPO / "conf/prompt/temperature_question.yaml").read_text(encoding="utf-8"))
HELLO = "Hello! it's (me) = 🍕, ok"
# Each is refused or changed by Hydra or OmegaConf when passed unquoted or quoted naively.
TEXTS = [HELLO, "x, y", "A=B", "Hi (there)", "it's", "a\\b", "end\\", "a\\'b", "x${y}z", "\\${x}", "\\\\${x}",
         "${oc.env:HOME}", "'", "\\", "$", "}", "%", 'say "hi"', "tab\there\nnew line", "问题：实践中\n回答："]


@pytest.mark.parametrize("text", TEXTS, ids=[repr(t) for t in TEXTS])
def test_quoted_prompt_composes_back_verbatim(tmp_path, text):
    params = compose.compose_to(tmp_path / "params.yaml", [f"prompt.text={compose.quote(text)}"], REPO)
    assert params["prompt"]["text"] == text


def test_naive_single_quotes_are_not_enough(tmp_path):
    """Why quote() escapes: the simplest quoting changes these texts or fails (so the test above has teeth)."""
    for text in ("it's", "x${y}z", "end\\"):
        try:
            params = compose.compose_to(tmp_path / "p.yaml", [f"prompt.text='{text}'"], REPO)
        except UserError:
            continue
        assert params["prompt"]["text"] != text, text


def test_compose_prompt_writes_the_text_and_derives_a_name(tmp_path, monkeypatch, capsys):
    _workspace(tmp_path, monkeypatch)
    assert cli.main(["compose", "model=tiny_qwen2", "--prompt", HELLO]) == 0
    out = capsys.readouterr().out
    params = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))
    assert params["prompt"]["text"] == HELLO and params["model"]["name"] == "tiny_qwen2"
    sha = hashlib.sha256(HELLO.encode()).hexdigest()
    assert f"prompt=hello_it_s-{sha[:8]}" in out
    # the printed overrides, run through a shell, are the same prompt for `dvc exp run -S`
    line = next(x for x in out.splitlines() if x.startswith("the same for dvc: dvc exp run -S "))
    words = [subprocess.run(["sh", "-c", f"printf %s {w}"], capture_output=True, text=True, check=True).stdout
             for w in line.split(" -S ")[1:]]
    assert words[0] == "prompt.set=null"            # a single prompt, also over a prompt set
    again = compose.compose_to(tmp_path / "again.yaml", words, tmp_path)
    assert again["prompt"]["text"] == HELLO


def test_compose_prompt_file_sets_file_and_nulls_text(tmp_path, monkeypatch):
    _workspace(tmp_path, monkeypatch)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/Story.txt").write_text("Once upon a time", encoding="utf-8")
    assert cli.main(["compose", "--prompt-file", str(tmp_path / "prompts/Story.txt")]) == 0   # absolute: made relative
    params = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))
    assert (params["prompt"]["text"], params["prompt"]["file"]) == (None, "prompts/Story.txt")
    sha = hashlib.sha256(b"Once upon a time").hexdigest()
    assert schema.load_section(params, "prompt", tmp_path).name == f"story-{sha[:8]}"


def test_unquoted_prompt_override_says_how_to_quote(tmp_path):
    for value, shown in (("Hello!", "prompt.text='Hello!'"), ("x, y", "\"prompt.text='x, y'\""),
                         ("it's", "prompt.text='it\\'s'")):
        with pytest.raises(UserError) as err:
            compose.compose_to(tmp_path / "p.yaml", [f"prompt.text={value}"], REPO)
        assert shown in str(err.value) and "--prompt TEXT" in str(err.value) and "\n" not in str(err.value)


def test_reference_text_keeps_its_name_and_ids():
    prompt = schema.load_section({"prompt": REFERENCE}, "prompt")
    assert prompt.name == "temperature_question"
    assert prompt.known_here.expected_token_ids["qwen2"] == REFERENCE["known"]["expected_token_ids"]["qwen2"]
    assert REFERENCE["known"]["text_sha256"] == hashlib.sha256(REFERENCE["text"].encode()).hexdigest()


@pytest.mark.parametrize("text", ["Hello world", REFERENCE["text"] + " ", REFERENCE["text"].replace("0", "1")])
def test_another_text_inherits_neither_name_nor_ids(text):
    prompt = schema.load_section({"prompt": {**REFERENCE, "text": text}}, "prompt")
    assert prompt.name != "temperature_question" and prompt.name.endswith(
        "-" + hashlib.sha256(text.encode()).hexdigest()[:8])
    assert prompt.known_here is None


def test_a_given_name_is_kept_and_a_file_is_named_after_itself(tmp_path):
    named = schema.load_section({"prompt": {**REFERENCE, "text": "Hello world", "name": "greeting"}}, "prompt")
    assert named.name == "greeting" and named.known_here is None
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/q.txt").write_text(REFERENCE["text"], encoding="utf-8")   # the known text, from a file
    from_file = schema.load_section({"prompt": {**REFERENCE, "text": None, "file": "prompts/q.txt"}}, "prompt",
                                    tmp_path)
    assert from_file.name == "temperature_question" and from_file.known_here is not None
    assert schema.prompt_name(from_file.model_copy(update={"name": None, "known": None})) == \
        f"q-{REFERENCE['known']['text_sha256'][:8]}"


def test_derived_names_are_short_and_fall_back_to_prompt():
    for text, stem in (("!!! ???", "prompt"), ("你好，世界", "你好_世界"),
                       ("Supercalifragilisticexpialidocious and more", "supercalifragilisticexpi")):
        prompt = schema.load_section({"prompt": {"name": None, "text": text, "file": None}}, "prompt")
        assert prompt.name == f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _workspace(tmp_path: Path, monkeypatch) -> None:
    """conf/ copied into tmp_path, made the current directory (`nexttoken compose` composes ./conf)."""
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    monkeypatch.chdir(tmp_path)


def test_overrides_after_prompt_count_and_their_errors_stay_theirs(tmp_path, monkeypatch, capsys):
    _workspace(tmp_path, monkeypatch)
    assert cli.main(["compose", "model=tiny_qwen2", "--prompt", "hi there", "sampling.top_k=3"]) == 0
    params = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))
    assert (params["prompt"]["text"], params["sampling"]["top_k"]) == ("hi there", 3)
    assert cli.main(["compose", "--prompt", "a ${ b", "sampling.top_k=-1"]) == 2
    assert "sampling.top_k=-1 is not allowed" in capsys.readouterr().err     # not blamed on the prompt
    assert cli.main(["compose", "--prompt", "a ${ b"]) == 2
    assert "--prompt='a ${ b' is not allowed" in capsys.readouterr().err
    assert yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8")) == params   # nothing written


def test_prompt_over_a_prompt_set_option_is_a_single_prompt(tmp_path, monkeypatch):
    """`--prompt` / `--prompt-file` give one prompt: over `prompt=concepts` they replace its set."""
    _workspace(tmp_path, monkeypatch)
    assert cli.main(["compose", "model=tiny_qwen2", "prompt=concepts", "--prompt", "hi there"]) == 0
    prompt = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))["prompt"]
    assert (prompt["text"], prompt["set"], prompt["file"]) == ("hi there", None, None)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/mine.txt").write_text("from a file", encoding="utf-8")
    assert cli.main(["compose", "model=tiny_qwen2", "prompt=concepts", "--prompt-file", "prompts/mine.txt"]) == 0
    prompt = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))["prompt"]
    assert (prompt["file"], prompt["set"]) == ("prompts/mine.txt", None)
    assert cli.main(["compose", "prompt.set=prompts/x.jsonl", "--prompt", "hi"]) == 2     # two ways to give it


SET = '{"id": "a", "text": "The capital of France is"}\n{"id": "b", "text": "1, 2, 3,"}\n'


def test_a_set_on_the_command_line_replaces_the_default_text(tmp_path, monkeypatch, capsys):
    """Issue 27: `nexttoken compose model=tiny_qwen2 prompt.set=prompts/mine.jsonl` was refused (`prompt.set=... is
    not allowed: null when prompt.text is set`): the set given there replaces conf/'s text, and --check agrees."""
    _workspace(tmp_path, monkeypatch)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/mine.jsonl").write_text(SET, encoding="utf-8")
    assert cli.main(["compose", "model=tiny_qwen2", "prompt.set=prompts/mine.jsonl"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    prompt = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))["prompt"]
    assert (prompt["set"], prompt["text"], prompt["file"]) == ("prompts/mine.jsonl", None, None)
    assert "prompt=mine" in out
    assert 'the same for dvc: dvc exp run -S "prompt.text=null" -S "prompt.file=null"' in out   # DVC adds none
    assert cli.main(["compose", "--check"]) == 0      # the recorded overrides compose to the same params.yaml
    # a file given there replaces a prompt option's set the same way
    (tmp_path / "prompts/one.txt").write_text("from a file", encoding="utf-8")
    assert cli.main(["compose", "prompt=concepts", "prompt.file=prompts/one.txt"]) == 0
    prompt = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))["prompt"]
    assert (prompt["file"], prompt["text"], prompt["set"]) == ("prompts/one.txt", None, None)


def test_two_prompts_on_the_command_line_are_still_refused(tmp_path, monkeypatch, capsys):
    _workspace(tmp_path, monkeypatch)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/mine.jsonl").write_text(SET, encoding="utf-8")
    assert cli.main(["compose", "prompt.set=prompts/mine.jsonl", "prompt.text=hi"]) == 2
    assert "prompt.set='prompts/mine.jsonl' is not allowed: null when prompt.text is set" in capsys.readouterr().err
    assert not (tmp_path / "params.yaml").exists()


def test_compose_prompt_set_option(tmp_path, monkeypatch, capsys):
    """`--prompt-set PATH`, like --prompt / --prompt-file: a set, over the default text or another option's."""
    _workspace(tmp_path, monkeypatch)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/mine.jsonl").write_text(SET, encoding="utf-8")
    assert cli.main(["compose", "model=tiny_qwen2", "--prompt-set", str(tmp_path / "prompts/mine.jsonl")]) == 0
    out = capsys.readouterr().out
    params = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))
    assert (params["prompt"]["set"], params["prompt"]["text"], params["prompt"]["file"]) == \
        ("prompts/mine.jsonl", None, None)                         # absolute: made relative
    assert 'the same for dvc: dvc exp run -S "prompt.text=null" -S "prompt.file=null" -S ' in out
    assert cli.main(["compose", "--check"]) == 0
    assert cli.main(["compose", "--prompt-set", "prompts/none.jsonl"]) == 2
    assert "prompts/none.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:      # argparse: one of --prompt / --prompt-file / --prompt-set
        cli.main(["compose", "--prompt-set", "prompts/mine.jsonl", "--prompt", "hi"])
    assert stop.value.code == 2 and "not allowed with argument --prompt-set" in capsys.readouterr().err
    assert cli.main(["compose", "--prompt-set", "prompts/mine.jsonl", "prompt.text=hi"]) == 2
    assert "give one of them" in capsys.readouterr().err
