"""Prompt sets: `prompts/<name>.jsonl` read into typed, frozen records; a single prompt as a set of one.

A set file is JSON Lines, UTF-8: one object per line, `{"id": ..., "text": ...}` and optionally
`"expected_token_ids": {"<tokenizer family>": [ids]}`. Lines holding only white space are
skipped; line numbers count physical lines (split at `\\n` only, a trailing `\\r` dropped), so
the number in an error is the one an editor shows. The first problem becomes one `UserError`
line naming the key, the file, the line and what is allowed (`schema`'s style, pydantic's
first error for a field's value); nothing is written. An id names the prompt's partition
(`prompt_id=<id>`) and files, so it is 1-64 of `A-Z a-z 0-9 _ . -`, not starting with `.` or
`-`, and unique ignoring case (partition folders must differ on case-insensitive file systems).

`for_config` is the one code path later stages take: today it gives the configured single prompt
(`prompt.text` / `prompt.file`) as a set of one whose id is the run's prompt name.
With `prompt.set` it reads that file (`read_set`); `nexttoken compose` and the validate stage call it,
so a bad set stops a run before anything is written. The tokenize stage records the prompt id in
tokenize.json (`prompt_id`), the key the per-prompt tables join on; tokenize loops over what
`for_config` returns, each later stage over its input's per-prompt partitions. See docs/prompt_sets.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from pipeline.config.schema import (
    CHECKED_AUTO,
    PromptConfig,
    RuleError,
    Section,
    items,
    parse,
    prompt_path,
    prompt_problem,
    rule,
    text_sha256,
)
from pipeline.config.schema import PROMPT_ID_ALLOWED as ID_ALLOWED  # the id rule is schema's (report.prompt_id too)
from pipeline.config.schema import PROMPT_ID_PATTERN as ID_PATTERN
from pipeline.errors import UserError, bad_value

KEYS = ("id", "text", "messages", "expected_token_ids")
LINE = ('one JSON object per line, {"id": ..., "text": ...} or {"id": ..., "messages": [{"role": ..., '
        '"content": ...}]} (optional "expected_token_ids"); blank lines are skipped')
SUFFIX = ".jsonl"
MESSAGES = 'a non-empty list of {"role": ..., "content": ...} objects'


class ChatMessage(Section):
    """One turn of a chat prompt, as the tokenizer's chat template takes it."""

    role: Annotated[str, rule(lambda r: not r.strip() and "a non-empty string")] = Field(
        description="a role the model's chat template knows, e.g. system, user, assistant")
    content: Annotated[str, rule(prompt_problem)] = Field(description="a non-empty string")


class PromptRecord(Section):
    """One prompt of a set: its id, its text or its chat messages, and per tokenizer family the ids it
    is known to tokenize to. With `messages` the prompt is rendered by the tokenizer's own chat template
    (`tokenization.prompt_for`); `text` is then the plain text it was made from, if any."""

    id: str = Field(pattern=ID_PATTERN, description=ID_ALLOWED)
    text: Annotated[str | None, rule(prompt_problem)] = Field(None, description="a non-empty string")
    messages: items(ChatMessage, MESSAGES) | None = None
    expected_token_ids: dict[str, list[Annotated[int, Field(ge=0)]]] = Field(
        default_factory=dict, description="a mapping tokenizer family -> list of ids")

    @model_validator(mode="after")
    def _text_or_messages(self):
        if self.text is None and self.messages is None:
            raise RuleError("text", None, f"a value, or messages instead: {LINE}")
        return self

    def expected_ids_for(self, family: str) -> list[int] | None:
        return self.expected_token_ids.get(family)

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def as_chat(self) -> PromptRecord:
        """The record as a one-turn user chat (prompt.chat=true), its text kept."""
        if self.messages is not None:
            return self
        return self.model_copy(update={"messages": (ChatMessage(role="user", content=self.text),)})


class PromptSet(Section):
    """The prompts a run covers, in file order; `file` is the set file, null for a single prompt."""

    file: str | None
    prompts: tuple[PromptRecord, ...] = Field(min_length=1)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.prompts)

    def get(self, prompt_id: str) -> PromptRecord:
        for p in self.prompts:
            if p.id == prompt_id:
                return p
        raise bad_value("prompt_id", prompt_id, "an id of this set: " + ", ".join(self.ids))


# ---------------------------------------------------------------- a set file
def read_set(key: str, value: str, root: Path | str, max_size: int) -> PromptSet:
    """The set in the file `value` (a path under prompts/, relative to root), checked line by line."""
    path = prompt_path(key, value, root)
    if not value.endswith(SUFFIX):
        raise bad_value(key, value, f"a JSON Lines file named *{SUFFIX} under prompts/ (a prompt set)")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _at(key, value, data.count(b"\n", 0, e.start) + 1,
                  f"not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); allowed: a UTF-8 text file") from None
    records: list[PromptRecord] = []
    seen: dict[str, tuple[str, int]] = {}        # id, case folded -> (id, line)
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if len(records) == max_size:
            raise _at(key, value, n, f"prompt {max_size + 1} is not allowed: at most prompt.max_set_size="
                      f"{max_size} prompts in a set (split the file, or set prompt.max_set_size)")
        record = _record(key, value, n, line)
        first = seen.setdefault(record.id.casefold(), (record.id, n))
        if first[1] != n:
            raise _at(key, value, n, f"id={record.id!r} is not allowed: an id no other line has, ignoring case "
                      f"(line {first[1]} has {first[0]!r})")
        records.append(record)
    if not records:
        raise bad_value(key, value, f"a set with at least one prompt (this file has none): {LINE}")
    return PromptSet(file=value, prompts=tuple(records))


def _at(key: str, value: str, line: int, problem: str) -> UserError:
    """One line: the key, the file, the line number, then the problem and what is allowed."""
    return UserError(f"{key}={value!r} line {line}: {problem}")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise ValueError(f"key {k!r} appears twice in one object")
    return dict(pairs)


def _record(key: str, value: str, n: int, line: str) -> PromptRecord:
    try:
        obj = json.loads(line, object_pairs_hook=_unique_keys)
    except ValueError as e:      # json.JSONDecodeError is a ValueError, and so is a repeated key
        # json's own messages for a string or character end in "at" ("Unterminated string starting at"): one "at"
        problem = f"{e.msg.removesuffix(' at')} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise _at(key, value, n, f"not JSON ({problem}); allowed: {LINE}") from None
    if not isinstance(obj, dict):
        raise _at(key, value, n, f"a JSON {_json_kind(obj)}, not an object; allowed: {LINE}")
    for k in obj:
        if k not in KEYS:
            raise _at(key, value, n, f"{k}={obj[k]!r} is not allowed: a known key: {', '.join(KEYS)}")
    if "id" not in obj:
        raise _at(key, value, n, f"id is missing; allowed: {LINE}")
    if ("text" in obj) == ("messages" in obj):
        raise _at(key, value, n, ("text and messages are both given" if "text" in obj else "text is missing")
                  + f"; allowed: {LINE}")
    if "text" in obj and obj["text"] is None:
        raise _at(key, value, n, "text=None is not allowed: a non-empty string")
    messages = obj.get("messages", [None])
    if not isinstance(messages, list) or not messages:
        raise _at(key, value, n, f"messages={messages!r} is not allowed: {MESSAGES}")
    for i, m in enumerate(messages if "messages" in obj else []):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise _at(key, value, n, f"messages[{i}]={m!r} is not allowed: an object with exactly role and content")
    try:
        return parse(PromptRecord, obj, "")
    except UserError as e:
        raise _at(key, value, n, str(e)) from None


def _json_kind(obj: object) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}[type(obj)]


# ---------------------------------------------------------------- any prompt config
def for_config(prompt: PromptConfig, root: Path | str = ".") -> PromptSet:
    """The prompts a run covers, for a prompt section from `schema.load_section` (text read, name resolved):
    the one code path every stage takes. `prompt.set`: the set file's prompts (`read_set`, checked line by
    line). Otherwise the single prompt (`prompt.text` or `prompt.file`) as a set of one whose id is the run's
    prompt name (`single_id`), with the ids `prompt.known` gives for its text.
    """
    if prompt.set is not None:
        found = read_set("prompt.set", prompt.set, root, prompt.max_set_size)
        return found if not prompt.chat else found.model_copy(
            update={"prompts": tuple(p.as_chat() for p in found.prompts)})
    if prompt.text is None or prompt.name is None:
        raise ValueError("for_config takes the prompt section from schema.load_section (text and name resolved)")
    known = prompt.known_here
    record = PromptRecord(id=single_id(prompt.name, prompt.text), text=prompt.text,
                          expected_token_ids=known.expected_token_ids if known else {})
    return PromptSet(file=None, prompts=(record.as_chat() if prompt.chat else record,))


def for_run(sections: dict, root: Path | str = ".") -> PromptSet:
    """The run's prompts (`for_config` of the prompt section), with the keys that name one of them checked
    against them: `report.prompt_id` (compose and the validate stage refuse a typo before any stage runs;
    the report stage checks it again against the artifacts)."""
    prompts = for_config(sections["prompt"], root)
    detailed(sections["report"].prompt_id, prompts.ids)
    return prompts


def detailed(wanted: str | None, ids: Sequence[str]) -> str:
    """The prompt the report details: `report.prompt_id`, or the run's first (its ids sorted: the run's order)
    when null. An id the run does not hold is refused in one line naming the run's ids: by compose and the
    validate stage before the run (`for_run`), by the report stage against the artifacts it reads."""
    ids = sorted(ids)
    if wanted is None:
        return ids[0]
    if wanted not in ids:
        raise bad_value("report.prompt_id", wanted, "null or one of the run's prompt ids: " + ", ".join(ids))
    return wanted


def fixed_sample(setting: str | int, prompt_ids: Sequence[str], must: Sequence[str] = ()) -> list[str]:
    """The prompts of a run a per-prompt choice (`checks.prompts`, `sampling.step_logits`) takes, in the run's
    order: every one for `all`, and for `auto` when the run has at most `schema.CHECKED_AUTO`; else a fixed sample
    of that many in all (`auto`: CHECKED_AUTO): `must` (in its order, as room allows), then the run's first
    prompt (its ids sorted: the one the report details by default), then the prompts with the lowest sha256 of
    their id. So the choice is the same in every run, audit and verify of the set and does not follow the ids'
    order; the checks' sample and the stored step logits' are the same prompts when `must` is."""
    n = len(prompt_ids)
    k = n if setting == "all" else min(n, CHECKED_AUTO if setting == "auto" else int(setting))
    if k >= n:
        return list(prompt_ids)
    first = min(prompt_ids)
    chosen = list(dict.fromkeys([*(p for p in must if p in prompt_ids), first]))[:k]
    taken = set(chosen)
    rest = sorted((p for p in prompt_ids if p not in taken), key=lambda p: hashlib.sha256(p.encode()).digest())
    taken |= set(rest[:k - len(chosen)])
    return [p for p in prompt_ids if p in taken]


def where(prompt: PromptConfig, record: PromptRecord) -> str:
    """How an error names one prompt of the run: `prompt.set='prompts/x.jsonl' id='a'`, `prompt.file='...'`
    or `prompt.text`."""
    if prompt.set is not None:
        return f"prompt.set={prompt.set!r} id={record.id!r}"
    return "prompt.text" if prompt.file is None else f"prompt.file={prompt.file!r}"


def resolved(prompt: PromptConfig, root: Path | str = ".") -> dict:
    """What the stages that read the prompt depend on, resolved: the prompt's text, or a set's records
    (so editing the set file re-runs exactly those stages)."""
    if prompt.set is None:
        return {"text": prompt.text}
    # a text record's dump as before chat prompts (no messages key): the stages' resolved configs, hence
    # DVC's view of them, do not change for sets without chat records
    return {"text": None, "prompts": [{k: v for k, v in p.model_dump().items() if k != "messages" or v is not None}
                                      for p in for_config(prompt, root).prompts]}


def single_id(name: str, text: str) -> str:
    """The run's prompt name when it is a valid id; else its letters and digits (other runs of characters as
    `_`, `prompt` when none is left) and the first 8 hex digits of the text's sha256: a name derived from
    Chinese words, `问题_实践中-1a2b3c4d`, becomes `prompt-1a2b3c4d`; `my prompt` becomes `my_prompt-<sha8>`."""
    if re.fullmatch(ID_PATTERN, name):
        return name
    sha = text_sha256(text)[:8]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name.removesuffix(f"-{sha}")).strip("_.-")[:55].strip("_.-")
    return f"{stem or 'prompt'}-{sha}"
