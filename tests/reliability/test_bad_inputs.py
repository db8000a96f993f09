"""Bad input matrix: every config key and CLI argument, wrong in every way we could think of.

Each bad input ends with one line naming the key, the value and what is allowed, exit
status 2, and nothing changed under artifacts/ or in params.yaml. The matrix is built from
the real conf/ (tiny_qwen2): for every key, values of the wrong type (generated from the
type of its value), then out-of-range values, unknown names, unknown and missing keys,
paths that leave the repository, and prompts that are empty, not UTF-8, full of control
characters or longer than the model's context. Most cases go through the validators
directly (`schema.load_section` and `prompt_set.for_run`, as compose and the validate stage call
them, and the library checks stages make against the model);
a representative subset runs the real `nexttoken` CLI and stages as subprocesses in a
workspace with a complete run, whose files must come out byte-identical.
docs/bad_inputs.md lists the matrix; a test keeps it in step.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import compose, prompt_set, schema
from pipeline.errors import UserError
from pipeline.model import capture, lens, loader, trajectories
from pipeline.numerics import probs
from pipeline.store import paths, provenance
from tests.conftest import REPO, copy_ws, run_module, snapshot
from tests.helpers import conf, validated
from tests.reliability.conftest import one_line_error, python_env

DOC = REPO / "docs" / "bad_inputs.md"
DELETE = object()    # a change that removes the key


# ---------------------------------------------------------------- the base config
def base_params() -> dict:
    """conf/ with model=tiny_qwen2, read from the YAML files (test_base_is_the_composition checks it)."""
    defaults = yaml.safe_load((REPO / "conf/config.yaml").read_text())["defaults"]
    groups = {k: v for d in defaults if isinstance(d, dict) for k, v in d.items()} | {"model": "tiny_qwen2"}
    return {g: conf.option(g, o) for g, o in groups.items()}


def set_key(params: dict, key: str, value: Any) -> dict:
    """A deep copy of params with dotted `key` (list items as [i]) set to value, or removed."""
    out = copy.deepcopy(params)
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", key)
    node = out
    for part in parts[:-1]:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    last = parts[-1]
    if last.startswith("["):
        node[int(last[1:-1])] = value
    elif value is DELETE:
        del node[last]
    else:
        node[last] = value
    return out


# ---------------------------------------------------------------- matrix
@dataclass(frozen=True)
class Case:
    id: str
    key: str                 # the key the message must name (as it appears before '=' or ' is missing')
    value: Any               # the value the message must show (repr), or DELETE for a missing key
    kind: str                # type | range | name | key | path | prompt | model (checked against the model)
    change: dict | None = None          # dotted key -> value, applied to the base params
    check: Callable[[Path], None] | None = None   # for cases that are not a params change


def _wrong_types(key: str, value: Any) -> list[Any]:
    if key in ("checks.prompts", "sampling.step_logits"):          # a name or a count: 5 is allowed
        return ["", 1.5, True]
    if isinstance(value, bool):
        return ["yes", 1]
    if isinstance(value, int):
        return ["x", 1.5, True]
    if isinstance(value, float):
        return ["x", math.nan, True]
    if isinstance(value, str):
        return [5, ""]
    if value is None or isinstance(value, (list, dict)):
        return [5]
    raise AssertionError(key)


def _leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of every key: mappings are walked, a list is a key and so is its first item."""
    out = [(prefix, node)]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _leaves(v, f"{prefix}.{k}")
    elif isinstance(node, list) and node:
        out += _leaves(node[0], f"{prefix}[0]")
    return out


def _message_key(key: str, params: dict) -> str:
    """The key a message names: a list item by its list, an item with keys by its index."""
    return re.sub(r"\[\d+\]$", "", key)


def type_cases(params: dict) -> list[Case]:
    cases = []
    for section in schema.SECTIONS:
        for key, value in _leaves(params[section], section):
            for bad in _wrong_types(key, value):
                cases.append(Case(f"type:{key}={bad!r}", _message_key(key, params), bad, "type", {key: bad}))
    return cases


def _r(key: str, value: Any, kind: str = "range", shown: Any = DELETE, shown_key: str | None = None,
       label: str | None = None, **more: Any) -> Case:
    """A params change: key=value (plus more changes), whose message names shown_key=shown."""
    change = {key: value, **{k.replace("__", "."): v for k, v in more.items()}}
    extra = label if label is not None else "".join(f",{k}={v!r}" for k, v in list(change.items())[1:])
    return Case(f"{kind}:{key}={value!r}{extra}",
                shown_key or _message_key(key, BASE), value if shown is DELETE else shown, kind, change)


def _missing(key: str) -> Case:
    return Case(f"key:missing {key}", key, DELETE, "key", {key: DELETE})


HUB = {"model.source.kind": "hub", "model.source.package": None, "model.source.pip": None,
       "model.source.seed": None, "model.source.architecture": None, "model.source.family": None}


def range_cases() -> list[Case]:
    arch = "model.source.architecture"
    return [
        # model
        _r("model.source.kind", "s3", "name"),
        _r("model.source.seed", -1),
        _r(f"{arch}.num_hidden_layers", 0),
        _r(f"{arch}.vocab_size", -5),
        _r(f"{arch}.rope_theta", 0.0),
        _r(f"{arch}.lm_head_std", -0.5),
        _r(f"{arch}.rms_norm_eps", math.inf),
        _r(f"{arch}.hidden_size", 66, shown=4, shown_key=f"{arch}.num_attention_heads"),
        _r(f"{arch}.num_key_value_heads", 3),
        _r(f"{arch}.head_dim", 16, "key"),
        _missing(f"{arch}.vocab_size"),
        _r("model.source.package", None),
        _r("model.source.hub_id", "o/n", "key", label=" (kind=tiny: a key of kind=hub)"),
        _r("model.source.kind", "hub", shown=None, shown_key="model.source.hub_id", label=" (no hub_id)",
           **{k.replace(".", "__"): v for k, v in HUB.items() if k != "model.source.kind"}),
        *[_r("model.source.hub_id", p, "path", label=" (kind=hub)", **{k.replace(".", "__"): v for k, v in HUB.items()})
          for p in ("../outside", "/abs/models/qwen", "~/models/qwen", "models/../../qwen", "C:\\models\\qwen")],
        *[_r("model.reference_figures", n, "path") for n in ("../seed_article", "reference/seed_article",
                                                              "seed_article.yaml", "", ".hidden")],
        _r("model.tokenizer.chat_template", True, "range"),
        _r("model.nope", 1, "key"),
        _r("model.source.nope", 1, "key"),
        _r("model.tokenizer.nope", 1, "key"),
        _missing("model.name"),
        _missing("model.tokenizer.family"),
        # prompt
        *[_r("prompt.text", t, "prompt") for t in ("", "   \n\t", None)],
        *[_r("prompt.text", t, "prompt", shown=t) for t in
          ("a\x00b", "\x1b[31mred\x1b[0m", "bell\x07", "del\x7f", "next line\x85", "lone \ud800 surrogate",
           "form\x0cfeed", "ok line\nthen \x08 backspace")],
        _r("prompt.file", "prompts/p.txt", "prompt"),                      # text is set too
        _r("prompt.set", "prompts/s.jsonl", "prompt"),                     # text is set too
        _r("prompt.set", "prompts/s.jsonl", "prompt", prompt__text=None, prompt__file="prompts/p.txt"),
        *[_r("prompt.set", p, "path", prompt__text=None) for p in ("../s.jsonl", "/etc/s.jsonl", "s.jsonl")],
        _r("prompt.set", "prompts/s.txt", "name", prompt__text=None),
        *[_r("prompt.file", p, "path", prompt__text=None) for p in
          ("../p.txt", "/etc/hostname", "~/p.txt", "prompts/../../p.txt", "C:\\p.txt", "conf/prompt/p.txt",
           "p.txt", "prompts")],
        _r("prompt.known.expected_token_ids", {"qwen2": [-1]}, shown=-1,
           shown_key="prompt.known.expected_token_ids.qwen2"),
        _r("prompt.known.expected_token_ids", {"qwen2": [True]}, shown=True,
           shown_key="prompt.known.expected_token_ids.qwen2"),
        *[_r("prompt.known.text_sha256", h, "name") for h in ("abc", "0B79" + "0" * 60, "sha256:" + "0" * 64)],
        _r("prompt.name", "", "name"),
        _r("prompt.nope", "x", "key"),
        _r("prompt.known.nope", "x", "key"),
        _missing("prompt.known.name"),
        _missing("prompt.known.text_sha256"),
        _r("prompt.max_set_size", 0),
        _r("prompt.max_set_size", True),
        # capture
        _r("capture.dtype", "float8", "name"),
        _r("capture.dtype", "float64", "name"),
        _r("capture.device", "tpu", "name"),
        _r("capture.device", "cuda:x", "name"),
        _r("capture.device", "cuda:-1", "name"),
        _r("capture.attn_implementation", "sdpa", "name"),
        _r("capture.attn_implementation", "flash_attention_2", "name"),
        _r("capture.positions", "first", "name"),
        _r("capture.kernels", "fast", "name"),
        _r("capture.nope", 1, "key"),
        _missing("capture.dtype"),
        # probs
        _r("probs.positions", []),
        _r("probs.temperatures", []),
        _r("probs.temperatures", [0.0], shown=0.0),
        _r("probs.temperatures", [-1.0], shown=-1.0),
        _r("probs.temperatures", [math.inf], shown=math.inf),
        _r("probs.temperatures", [1.0, 1.0]),
        _r("probs.fp32_sum_tolerance", -1e-6),
        _r("probs.fp64_sum_tolerance", math.inf),
        _r("probs.top_n", 0),
        _r("probs.extra_filters[0].top_k", -1),
        _r("probs.extra_filters[0].top_p", 0.0),
        _r("probs.extra_filters[0].top_p", 1.5),
        _r("probs.extra_filters[0].temperature", -1.0),
        _r("probs.extra_filters[0].nope", 1, "key"),
        _r("probs.nope", 1, "key"),
        _missing("probs.temperatures"),
        # sampling
        _r("sampling.temperature", -0.5),
        _r("sampling.temperature", math.inf),
        _r("sampling.top_k", -1),
        _r("sampling.top_p", 0.0),
        _r("sampling.top_p", 1.5),
        _r("sampling.seed", -1),
        _r("sampling.seed", 2**64),
        _r("sampling.max_new_tokens", -1),
        _r("sampling.branches", []),
        _r("sampling.branches", ["beam"], "name", shown="beam"),
        _r("sampling.branches", ["greedy", "greedy"]),       # was accepted, then failed generate parity 44 s later
        _r("sampling.kv_cache", [True, True]),
        _r("sampling.kv_cache", []),
        _r("sampling.top_n", 0),
        _r("sampling.nope", 1, "key"),
        _missing("sampling.seed"),
        _r("sampling.step_logits", 0),
        _r("sampling.step_logits", "some", "name"),
        _r("sampling.what_if", -1),
        _r("sampling.what_if", 5),                           # > top_n - 1: not among the recorded alternatives
        _r("sampling.what_if", 2, sampling__top_n=2),
        _r("sampling.what_if_depth", 0),
        _r("sampling.what_if_depth", 3),
        # checks
        _r("checks.kv_cache_atol", -0.01),
        _r("checks.kv_cache_atol", math.nan),
        _r("checks.prompts", 0),
        _r("checks.prompts", "some", "name"),
        _r("checks.nope", 1, "key"),
        _missing("checks.kv_cache_atol"),
        # lens (whether top_k fits the model's output size: the lens stage, model_cases)
        _r("lens.top_k", 0),
        _r("lens.nope", 1, "key"),
        _missing("lens.top_k"),
        # attribution (whether top_k fits the model and the prompts are the run's: the attribution stage, below)
        _r("attribution.top_k", 0),
        _r("attribution.ig_steps", 1),
        _r("attribution.prompts", ["../x"], "name", shown="../x"),
        _r("attribution.prompts", ["a", "a"]),
        _r("attribution.nope", 1, "key"),
        _missing("attribution.ig_steps"),
        # report (whether an id is one of the run's is known from the artifacts: the report stage, below)
        _r("report.prompt_id", "a b", "name"),
        _r("report.prompt_id", "../x", "name"),
        _r("report.nope", 1, "key"),
        # equivalence (whether a prompt id is one of the run's: the equivalence stage, against the artifacts)
        _r("equivalence.variations", []),
        _r("equivalence.variations", ["bf8"], "name", shown="bf8"),
        _r("equivalence.variations", ["sdpa", "sdpa"]),
        _r("equivalence.exact", ["threads_2"], "name", shown="threads_2"),
        _r("equivalence.rederive", "kv", "name"),
        _r("equivalence.rederive", "kernels", "name"),                       # no forward the check can write out
        _r("equivalence.rederive", "sdpa", "range", equivalence__variations=["float32"]),
        _r("equivalence.exact", ["sdpa"], "range", shown="sdpa", equivalence__variations=["float32"]),
        _r("equivalence.fillers", []),
        _r("equivalence.fillers", [""], shown=""),
        _r("equivalence.prompts", ["../x"], "name", shown="../x"),
        _r("equivalence.nope", 1, "key"),
        _missing("equivalence.fillers"),
        # executor (where the per-prompt work runs; whether a cluster answers: tests/integration/test_ray_executor.py)
        _r("executor.kind", "dask", "name"),
        _r("executor.address", "auto", "range", shown="auto"),              # a cluster address with kind=serial
        _r("executor.address", "", executor__kind="ray"),
        _r("executor.workers", 0),
        _r("executor.cpus_per_worker", 0.0),
        _r("executor.gpus_per_worker", -1.0),
        _r("executor.torch_threads", 0),
        _r("executor.max_retries", -1),
        _r("executor.prompt_timeout_s", 0.0),
        _r("executor.nope", 1, "key"),
    ]


# Cases checked against the model or the stored run (what stages do after reading the config).
def _attention_layer(root: Path, layer: int) -> None:
    capture.CaptureSpec(attention_layers=(layer,), positions="all").resolve_layers(2)


def _position(root: Path, pos: int, available: list[int]) -> None:
    probs.resolve_positions((pos,), 25, available)


def _device(root: Path) -> None:
    loader.resolve_device("cuda:99")


def _memory(root: Path) -> None:
    """Qwen2.5-7B's shape (config only) at 20000 tokens against 16 GiB free, as the forward stage checks it."""
    from pipeline.model import memory
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
                                                  "intermediate_size": 18944, "num_attention_heads": 28,
                                                  "num_key_value_heads": 4, "vocab_size": 152064}))
    need = memory.estimate(root, loader.resolve_dtype("bfloat16"), 20000, capture.CaptureSpec((0, -1), "all"))
    memory.guard(need, loader.resolve_device("cuda", gpus=1), free=lambda place, spread: 16 * 2**30)


def _duplicate_filter(root: Path, name: str) -> None:
    p = set_key(base_params(), "probs.extra_filters[1].name", name)
    probs.filters(schema.load_section(p, "probs"), schema.load_section(p, "sampling"))


def _reference_name(root: Path) -> None:
    from pipeline.checks import reference
    reference.load_reference("nope")


def _no_section(root: Path) -> None:
    p = base_params()
    del p["sampling"]
    schema.load_section(p, "sampling")


def _params_file(root: Path, text: str | None) -> None:
    if text is not None:
        (root / "params.yaml").write_text(text)
    schema.read_params(root / "params.yaml")


def _prompt_file(root: Path, name: str, data: bytes | None, link: str | None = None) -> None:
    (root / "prompts").mkdir(exist_ok=True)
    if link:
        (root / "prompts" / name).symlink_to(link)
    elif data is not None:
        (root / "prompts" / name).write_bytes(data)
    p = set_key(set_key(base_params(), "prompt.file", f"prompts/{name}"), "prompt.text", None)
    schema.load_section(p, "prompt", root)


TINY_LARGEST_LOGIT = 19.125     # max |logit| of tiny_qwen2 at the reference prompt's last position


def _overflowing_temperature(root: Path, key: str, value: Any) -> None:
    p = set_key(base_params(), key, value)
    probs_cfg, sampling_cfg = schema.load_section(p, "probs"), schema.load_section(p, "sampling")
    probs.check_temperatures(probs_cfg, probs.filters(probs_cfg, sampling_cfg), TINY_LARGEST_LOGIT)


def model_cases() -> list[Case]:
    return [
        *[Case(f"model:{key}={value!r} (logits up to {TINY_LARGEST_LOGIT}: overflows float32)", shown_key, 1e-40,
               "model", check=lambda r, k=key, v=value: _overflowing_temperature(r, k, v))
          for key, value, shown_key in (("sampling.temperature", 1e-40, "sampling.temperature"),
                                        ("probs.extra_filters[1].temperature", 1e-40,
                                         "probs.extra_filters.top_p_0.9.temperature"),
                                        ("probs.temperatures", [1.0, 1e-40], "probs.temperatures"))],
        Case("model:capture.attention_layers=[2] (2 layers)", "capture.attention_layers", 2, "model",
             check=lambda r: _attention_layer(r, 2)),
        Case("model:capture.attention_layers=[-3] (2 layers)", "capture.attention_layers", -3, "model",
             check=lambda r: _attention_layer(r, -3)),
        Case("model:probs.positions=[25] (25 tokens)", "probs.positions", 25, "model",
             check=lambda r: _position(r, 25, list(range(25)))),
        Case("model:probs.positions=[-26] (25 tokens)", "probs.positions", -26, "model",
             check=lambda r: _position(r, -26, list(range(25)))),
        Case("model:probs.positions=[0] with capture.positions=last", "probs.positions", 0, "model",
             check=lambda r: _position(r, 0, [24])),
        Case("model:sampling.max_new_tokens=32745 (25-token prompt, context 32768)", "sampling.max_new_tokens",
             32745, "model", check=lambda r: trajectories.check_room(25, 32745, 32768)),
        Case("model:sampling.max_new_tokens=32745 (a set's longest prompt, 25 tokens, context 32768)",
             "sampling.max_new_tokens", 32745, "model",
             check=lambda r: trajectories.check_room(25, 32745, 32768, "b_long")),
        Case("model:lens.top_k=152065 (output size 152064)", "lens.top_k", 152065, "model",
             check=lambda r: lens.check_top_k(152065, 152064)),
        Case("model:capture.device=cuda:99 (no such GPU)", "capture.device", "cuda:99", "model", check=_device),
        Case("model:capture.device=multi with no GPU", "capture.device", "multi", "model",
             check=lambda r: loader.resolve_device("multi", gpus=0)),
        Case("model:a forward pass larger than the free memory (20000 tokens, 16 GiB)", "not enough memory for the "
             "forward pass of this 20000-token prompt", DELETE, "model", check=_memory),
        Case("name:probs.extra_filters duplicate name", "probs.extra_filters", ["sampling", "top_k_2", "top_k_2"],
             "name", check=lambda r: _duplicate_filter(r, "top_k_2")),
        Case("name:probs.extra_filters name 'sampling'", "probs.extra_filters",
             ["sampling", "top_k_2", "sampling"], "name", check=lambda r: _duplicate_filter(r, "sampling")),
        Case("name:model.reference_figures=nope (no such file)", "model.reference_figures='nope'", DELETE, "name",
             check=_reference_name),
        Case("key:params.yaml without a sampling section", "params.yaml has no `sampling` section", DELETE, "key",
             check=_no_section),
        Case("key:params.yaml missing", "params.yaml not found", DELETE, "key", check=lambda r: _params_file(r, None)),
        Case("key:params.yaml not YAML", "params.yaml is not valid YAML", DELETE, "key",
             check=lambda r: _params_file(r, "model: [unclosed\n")),
        Case("key:params.yaml a list", "params.yaml", DELETE, "key", check=lambda r: _params_file(r, "- 1\n- 2\n")),
        Case("key:params.yaml with an unknown section foo: 1", "foo", 1, "key",
             check=lambda r: _params_file(r, yaml.safe_dump(BASE) + "foo: 1\n")),
        Case("prompt:prompt.file not UTF-8 (Latin-1)", "prompt.file", "prompts/latin1.txt", "prompt",
             check=lambda r: _prompt_file(r, "latin1.txt", "café".encode("latin-1"))),
        Case("prompt:prompt.file not UTF-8 (UTF-16)", "prompt.file", "prompts/utf16.txt", "prompt",
             check=lambda r: _prompt_file(r, "utf16.txt", "hello".encode("utf-16"))),
        Case("prompt:prompt.file with control characters", "prompt.file", "prompts/ansi.txt", "prompt",
             check=lambda r: _prompt_file(r, "ansi.txt", b"plain\n\x1b[1mbold\x1b[0m")),
        Case("prompt:prompt.file with a NUL byte", "prompt.file", "prompts/nul.txt", "prompt",
             check=lambda r: _prompt_file(r, "nul.txt", b"a\x00b")),
        Case("prompt:prompt.file empty", "prompt.file", "prompts/empty.txt", "prompt",
             check=lambda r: _prompt_file(r, "empty.txt", b"")),
        Case("prompt:prompt.file white space only", "prompt.file", "prompts/blank.txt", "prompt",
             check=lambda r: _prompt_file(r, "blank.txt", b" \n\t\r\n")),
        Case("path:prompt.file does not exist", "prompt.file", "prompts/none.txt", "path",
             check=lambda r: _prompt_file(r, "none.txt", None)),
        Case("path:prompt.file is a folder", "prompt.file", "prompts/dir", "path",
             check=lambda r: ((r / "prompts/dir").mkdir(parents=True), _prompt_file(r, "dir", None))),
        Case("path:prompt.file a symlink out of the repository", "prompt.file", "prompts/link.txt", "path",
             check=lambda r: _prompt_file(r, "link.txt", None, link="/etc/hostname")),
        Case("path:prompt.file a symlink to a file outside prompts/", "prompt.file", "prompts/elsewhere.txt", "path",
             check=lambda r: ((r / "notes.txt").write_text("in the repository, not under prompts/"),
                              _prompt_file(r, "elsewhere.txt", None, link="../notes.txt"))),
    ]


def _prompt_set(root: Path, name: str, data: bytes | None = None, link: str | None = None) -> None:
    """prompts/<name> read as a prompt set, with the limit prompt.max_set_size of the base config."""
    (root / "prompts").mkdir(exist_ok=True)
    if link:
        (root / "prompts" / name).symlink_to(link)
    elif data is not None:
        (root / "prompts" / name).write_bytes(data)
    limit = schema.load_section(base_params(), "prompt", root).max_set_size
    prompt_set.read_set("prompt.set", f"prompts/{name}" if "/" not in name else name, root, limit)


_P = b'{"id": "a", "text": "x"}\n'
# A bad line: (kind, what is wrong, the file's bytes, its line number and the start of the problem).
SET_LINES = [
    ("prompt", "a duplicate id", _P + b'\n{"id": "a", "text": "y"}\n', "3: id='a' is not allowed"),
    ("prompt", "an id with a space", b'{"id": "a b", "text": "x"}\n', "1: id='a b' is not allowed"),
    ("prompt", "an id starting with a dot", b'{"id": ".a", "text": "x"}\n', "1: id='.a' is not allowed"),
    ("prompt", "an empty text", _P + b'{"id": "b", "text": ""}\n', "2: text='' is not allowed"),
    ("prompt", "a text with an escape", b'{"id": "a", "text": "\\u001b[1m"}\n', "1: text='\\x1b[1m' is not allowed"),
    ("prompt", "not UTF-8", _P + b'{"id": "b", "text": "caf\xe9"}\n', "2: not UTF-8 (byte 0xe9 at offset 49)"),
    ("prompt", "a line that is a list", _P + b'["b", "y"]\n', "2: a JSON list, not an object"),
    ("prompt", "a line that is not JSON", b"id: a\n", "1: not JSON (Expecting value at column 1)"),
    ("key", "an unknown key", b'{"id": "a", "text": "x", "name": "n"}\n', "1: name='n' is not allowed"),
    ("key", "a line without text", b'{"id": "a"}\n', "1: text is missing"),
    ("range", "a negative expected id", b'{"id": "a", "text": "x", "expected_token_ids": {"qwen2": [-1]}}\n',
     "1: expected_token_ids.qwen2=-1 is not allowed"),
    ("range", f"{schema.MAX_SET_SIZE + 1} prompts (prompt.max_set_size={schema.MAX_SET_SIZE})",
     b"".join(b'{"id": "p%d", "text": "x"}\n' % i for i in range(schema.MAX_SET_SIZE + 1)),
     f"{schema.MAX_SET_SIZE + 1}: prompt {schema.MAX_SET_SIZE + 1} is not allowed: at most "
     f"prompt.max_set_size={schema.MAX_SET_SIZE}"),
]


def prompt_set_cases() -> list[Case]:
    """Bad prompt sets (pipeline/config/prompt_set.py; issue 17: not yet a params key, read by no stage)."""
    return [
        *[Case(f"{kind}:prompt.set with {what}", f"prompt.set='prompts/s.jsonl' line {line}", DELETE, kind,
               check=lambda r, d=data: _prompt_set(r, "s.jsonl", d)) for kind, what, data, line in SET_LINES],
        Case("prompt:prompt.set with no prompts (blank lines only)", "prompt.set", "prompts/s.jsonl", "prompt",
             check=lambda r: _prompt_set(r, "s.jsonl", b"\n  \n")),
        Case("name:prompt.set='prompts/s.txt' (not .jsonl)", "prompt.set", "prompts/s.txt", "name",
             check=lambda r: _prompt_set(r, "s.txt", _P)),
        Case("path:prompt.set='../s.jsonl'", "prompt.set", "../s.jsonl", "path",
             check=lambda r: _prompt_set(r, "../s.jsonl")),
        Case("path:prompt.set does not exist", "prompt.set", "prompts/none.jsonl", "path",
             check=lambda r: _prompt_set(r, "none.jsonl")),
        Case("path:prompt.set a symlink to a file outside prompts/", "prompt.set", "prompts/link.jsonl", "path",
             check=lambda r: ((r / "notes.jsonl").write_bytes(_P),
                              _prompt_set(r, "link.jsonl", link="../notes.jsonl"))),
    ]


BASE = base_params()
MATRIX = type_cases(BASE) + range_cases() + model_cases() + prompt_set_cases()


def _expect(case: Case, message: str) -> None:
    assert "\n" not in message, message
    if case.value is DELETE:
        assert message.startswith(case.key) or case.key in message, message
        return
    prefix = f"{case.key}={case.value!r} is not allowed: "
    if isinstance(case.value, str) and len(case.value) > 60:
        prefix = f"{case.key}="
    assert message.startswith(prefix), f"{message!r} does not start with {prefix!r}"
    assert len(message) > len(prefix) + 5, message        # says what is allowed


def _outside_files(root: Path) -> None:
    """Readable prompts at the places a leaving path points to: only the path rule can refuse them."""
    for path in (root.parent / "p.txt", root / "~" / "p.txt", root / "C:\\p.txt"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a prompt that must not be read", encoding="utf-8")


@pytest.mark.parametrize("case", MATRIX, ids=[c.id for c in MATRIX])
def test_bad_input_is_named(case, tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _outside_files(root)
    with pytest.raises(UserError) as err:
        if case.check is not None:
            case.check(root)
        else:
            params = BASE
            for key, value in case.change.items():
                params = set_key(params, key, value)
            # as compose and the validate stage do: every section, then the prompt set read where it is used
            prompt_set.for_run({s: schema.load_section(params, s, root) for s in schema.SECTIONS}, root)
    _expect(case, str(err.value))
    if case.kind == "path":
        assert "inside the repository" in str(err.value) or "plain name" in str(err.value), err.value


def test_matrix_covers_every_key_of_every_section():
    keys = {k for s in schema.SECTIONS for k, _ in _leaves(BASE[s], s)}
    covered = {k for c in MATRIX if c.change for k in c.change}
    assert keys - covered == set()
    assert set(schema.SECTIONS) == {"model", "prompt", "capture", "probs", "sampling", "checks", "report",
                                    "equivalence", "lens", "attribution", "executor"}


def test_base_is_the_composition_of_conf(tmp_path):
    composed = compose.compose_to(tmp_path / "params.yaml", ["model=tiny_qwen2"], REPO)
    assert composed == BASE


def test_good_prompt_file_is_read_and_its_text_used(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts/p.txt").write_text("Hello\tworld\r\n问题", encoding="utf-8")
    p = set_key(set_key(BASE, "prompt.file", "prompts/p.txt"), "prompt.text", None)
    prompt = schema.load_section(p, "prompt", tmp_path)
    assert prompt.text == "Hello\tworld\r\n问题" and prompt.file == "prompts/p.txt"


def test_doc_lists_the_matrix():
    doc = DOC.read_text(encoding="utf-8")
    missing = [c.id for c in MATRIX if c.kind != "type" and f"`{_doc_id(c)}`" not in doc]
    assert not missing, f"docs/bad_inputs.md does not list: {missing}"
    count = re.search(r"(\d+) bad inputs", doc)
    assert count and int(count.group(1)) == len(MATRIX) + len(SUBPROCESS) + len(CLI_USAGE), \
        f"docs/bad_inputs.md should say {len(MATRIX) + len(SUBPROCESS) + len(CLI_USAGE)} bad inputs"


def _doc_id(case: Case) -> str:
    return case.id.split(":", 1)[1].replace("|", "\\|")


# ---------------------------------------------------------------- the real CLI and stages
@dataclass(frozen=True)
class Run:
    id: str
    argv: tuple[str, ...]            # ("nexttoken", ...) or ("stage", name)
    needles: tuple[str, ...]         # what the one line must name
    params: dict | None = None       # params.yaml changes (written before the run, as if by hand)
    setup: Callable[[Path], Callable[[], None] | None] | None = None
    env: dict | None = None          # environment variables added for the run


LOCAL = {"model.source.kind": "local", "model.source.path": "no/such/dir", "model.source.package": None,
         "model.source.pip": None, "model.source.seed": None, "model.source.architecture": None,
         "model.source.family": None}


def _folder(files: dict[str, str]):
    """A model folder `mine/` in the workspace holding `files` (name -> text)."""
    def setup(ws: Path):
        (ws / "mine").mkdir()
        for name, text in files.items():
            (ws / "mine" / name).write_text(text)
        return lambda: shutil.rmtree(ws / "mine")
    return setup


def _latin1_prompt(ws: Path):
    (ws / "prompts").mkdir(exist_ok=True)
    (ws / "prompts/latin1.txt").write_bytes("café".encode("latin-1"))
    return lambda: shutil.rmtree(ws / "prompts")


def _duplicate_id_set(ws: Path):
    (ws / "prompts").mkdir(exist_ok=True)
    (ws / "prompts/dup.jsonl").write_bytes(b'{"id": "a", "text": "x"}\n{"id": "A", "text": "y"}\n')
    return lambda: (ws / "prompts/dup.jsonl").unlink()


def _long_prompt_in_set(ws: Path):
    """A two-prompt set whose second prompt (25 tokens) does not fit a context of 8 positions."""
    restore = _small_context(ws)
    (ws / "prompts").mkdir(exist_ok=True)
    (ws / "prompts/two.jsonl").write_text(json.dumps({"id": "a_short", "text": "Hi"}) + "\n"
                                          + json.dumps({"id": "b_long", "text": BASE["prompt"]["text"]}) + "\n")

    def undo():
        restore()
        (ws / "prompts/two.jsonl").unlink()
    return undo


def _small_context(ws: Path):
    """A prepared model whose context is 8 positions (the prompt has 25 tokens).

    config.json says so, and prepare_model's manifest records that config.json, as if
    prepare_model had made it (else the stage would refuse the edited file as foreign).
    """
    cfg, manifest = ws / "artifacts/prepare_model/config.json", paths.manifest_path("prepare_model", ws)
    originals = {p: p.read_bytes() for p in (cfg, manifest)}
    data = json.loads(originals[cfg])
    data["max_position_embeddings"] = 8
    cfg.unlink()
    cfg.write_text(json.dumps(data))
    m = json.loads(originals[manifest])
    for out in m["outputs"]:
        if out["path"] == "artifacts/prepare_model/config.json":
            out["sha256"] = provenance.sha256_file(cfg)
    manifest.unlink()
    manifest.write_text(json.dumps(m))

    def restore():
        for p, data in originals.items():
            p.unlink()
            p.write_bytes(data)
    return restore


def _hide_snapshot(ws: Path):
    """The run's prepared model folder moved out of the workspace (as after a `dvc gc` or a lost cache)."""
    hidden = ws.parent / f"{ws.name}-hidden-snapshot"
    paths.stage_dir("prepare_model", ws).rename(hidden)
    return lambda: hidden.rename(paths.stage_dir("prepare_model", ws))


SUBPROCESS = [
    Run("compose sampling.top_k=-1", ("nexttoken", "compose", "model=tiny_qwen2", "sampling.top_k=-1"),
        ("sampling.top_k=-1 is not allowed: an integer >= 0",)),
    Run("compose model=nope", ("nexttoken", "compose", "model=nope"),
        ("model='nope' is not allowed: one of gemma3_270m, gguf, hub, local, ollama, qwen2_5_7b, "
         "smollm2_135m_instruct, tiny, tiny_qwen2",)),
    Run("compose sampling.nope=1", ("nexttoken", "compose", "model=tiny_qwen2", "sampling.nope=1"),
        ("sampling.nope='1' is not allowed: a known key:", "top_p")),
    Run("compose capture.dtype=float8", ("nexttoken", "compose", "model=tiny_qwen2", "capture.dtype=float8"),
        ("capture.dtype='float8' is not allowed: one of bfloat16, float16, float32",)),
    Run("compose prompt.file=../outside.txt", ("nexttoken", "compose", "model=tiny_qwen2",
                                                "prompt.file=../outside.txt", "prompt.text=null"),
        ("prompt.file='../outside.txt' is not allowed: a file under prompts/ inside the repository",)),
    Run("compose prompt.text with a control character", ("nexttoken", "compose", "model=tiny_qwen2",
                                                         "prompt.text=bell\x07"),
        ("override='prompt.text=bell\\x07' is not allowed",)),
    Run("compose sampling.top_k (no value)", ("nexttoken", "compose", "model=tiny_qwen2", "sampling.top_k"),
        ("override='sampling.top_k' is not allowed: key=value",)),
    Run("compose --check with overrides", ("nexttoken", "compose", "--check", "model=tiny_qwen2"),
        ("--check takes no overrides",)),
    # Prompt text Hydra reads as syntax: the line says how to quote it, and offers --prompt.
    Run("compose prompt.text=Hello! (unquoted)", ("nexttoken", "compose", "model=tiny_qwen2", "prompt.text=Hello!"),
        ("override='prompt.text=Hello!' is not allowed", "quote the value for Hydra: prompt.text='Hello!'",
         "--prompt TEXT")),
    Run("compose prompt.text=x, y (a sweep to Hydra)", ("nexttoken", "compose", "model=tiny_qwen2", "prompt.text=x, y"),
        ("override='prompt.text=x, y' is not allowed", "\"prompt.text='x, y'\"", "dvc exp run -S")),
    Run("compose --prompt with an unclosed ${", ("nexttoken", "compose", "model=tiny_qwen2", "--prompt", "a ${ b"),
        ("--prompt='a ${ b' is not allowed", "--prompt-file")),
    Run("compose --prompt with empty text", ("nexttoken", "compose", "model=tiny_qwen2", "--prompt", ""),
        ("--prompt='' is not allowed: a non-empty string",)),
    Run("compose --prompt with a control character",
        ("nexttoken", "compose", "model=tiny_qwen2", "--prompt", "bell\x07"),
        ("--prompt='bell\\x07' is not allowed: U+0007 at character 4",)),
    Run("compose --prompt and a prompt.text override", ("nexttoken", "compose", "--prompt", "a", "prompt.text=b"),
        ("--prompt / --prompt-file / --prompt-set set the prompt, and so does 'prompt.text=b'",)),
    Run("compose =3 (no key)", ("nexttoken", "compose", "=3"), ("override='=3' is not allowed: key=value",)),
    Run("audit --rev of a revision that does not exist", ("nexttoken", "audit", "--rev", "no-such-rev"),
        ("no-such-rev",)),
    Run("stage validate: prompt.text with an escape sequence", ("stage", "validate"),
        ("nexttoken validate: error: prompt.text='\\x1b[31mred' is not allowed: U+001B at character 0",),
        params={"prompt.text": "\x1b[31mred"}),
    Run("compose prompt.set with a duplicate id",
        ("nexttoken", "compose", "model=tiny_qwen2", "prompt.set=prompts/dup.jsonl", "prompt.text=null"),
        ("prompt.set='prompts/dup.jsonl' line 2: id='A' is not allowed: an id no other line has, ignoring case",),
        setup=_duplicate_id_set),
    Run("compose report.prompt_id=nope (not a prompt of the run)",
        ("nexttoken", "compose", "model=tiny_qwen2", "report.prompt_id=nope"),
        ("report.prompt_id='nope' is not allowed: null or one of the run's prompt ids: temperature_question",)),
    Run("stage validate: report.prompt_id=nope (not a prompt of the run)", ("stage", "validate"),
        ("nexttoken validate: error: report.prompt_id='nope' is not allowed: null or one of the run's prompt ids: "
         "temperature_question",), params={"report.prompt_id": "nope"}),
    Run("stage validate: a prompt set with a duplicate id", ("stage", "validate"),
        ("nexttoken validate: error: prompt.set='prompts/dup.jsonl' line 2: id='A' is not allowed",),
        params={"prompt.text": None, "prompt.set": "prompts/dup.jsonl"}, setup=_duplicate_id_set),
    Run("stage tokenize: prompt.file not UTF-8", ("stage", "tokenize"),
        ("prompt.file='prompts/latin1.txt' is not allowed: not UTF-8 (byte 0xe9 at offset 3)",),
        params={"prompt.text": None, "prompt.file": "prompts/latin1.txt"}, setup=_latin1_prompt),
    Run("stage tokenize: prompt longer than the model's context", ("stage", "tokenize"),
        ("prompt.text is 25 tokens long: the model's context allows at most 8",), setup=_small_context),
    Run("stage tokenize: a set's prompt longer than the model's context", ("stage", "tokenize"),
        ("prompt.set='prompts/two.jsonl' id='b_long' is 25 tokens long: the model's context allows at most 8",),
        params={"prompt.text": None, "prompt.set": "prompts/two.jsonl"}, setup=_long_prompt_in_set),
    Run("stage forward: capture.attention_layers=[5] (2 layers)", ("stage", "forward"),
        ("capture.attention_layers=5 is not allowed: integers in [-2, 1]",),
        params={"capture.attention_layers": [0, 5]}),
    Run("stage lens: lens.top_k=152065 (output size 152064)", ("stage", "lens"),
        ("lens.top_k=152065 is not allowed: an integer in [1, 152064] (this model's output size)",),
        params={"lens.top_k": 152065}),
    Run("stage probs: probs.positions=[100] (25 tokens)", ("stage", "probs"),
        ("probs.positions=100 is not allowed: a prompt position in [-25, 24]",), params={"probs.positions": [100]}),
    Run("stage prepare_model: model.source.hub_id=../outside", ("stage", "prepare_model"),
        ("model.source.hub_id='../outside' is not allowed",),
        params={**HUB, "model.source.hub_id": "../outside"}),
    Run("stage validate: model.source.family=nope (kind=tiny)", ("stage", "validate"),
        ("nexttoken validate: error: model.source.family='nope' is not allowed: one of llama, mistral, qwen2",),
        params={"model.source.kind": "tiny", "model.source.family": "nope"}),
    Run("stage validate: model.source.path names no folder (kind=local)", ("stage", "validate"),
        ("model.source.path='no/such/dir': no such folder",), params=LOCAL),
    Run("stage validate: a local folder with pickle weights only", ("stage", "validate"),
        ("model.source.path='mine': pickle weights only (pytorch_model.bin): nexttoken loads safetensors only",),
        params={**LOCAL, "model.source.path": "mine"}, setup=_folder({"pytorch_model.bin": "", "config.json": "{}"})),
    Run("stage validate: a local folder without tokenizer files", ("stage", "validate"),
        ("model.source.path='mine':", "has no tokenizer files"),
        params={**LOCAL, "model.source.path": "mine"},
        setup=_folder({"model.safetensors": "", "config.json": '{"model_type": "llama"}'})),
    Run("stage validate: a local folder of a model with no attention layers (mamba)", ("stage", "validate"),
        ("model_type='mamba' (mine/config.json) cannot be captured: it has no attention layers",),
        params={**LOCAL, "model.source.path": "mine"},
        setup=_folder({"model.safetensors": "", "tokenizer.json": "{}",
                       "config.json": '{"model_type": "mamba", "num_hidden_layers": 2}'})),
    Run("stage validate: a local folder of a decoder the capture cannot read (openai-gpt, post-LN)",
        ("stage", "validate"),
        ("model_type='openai-gpt' (mine/config.json) cannot be captured: its layers normalise after each "
         "residual add",),
        params={**LOCAL, "model.source.path": "mine"},
        setup=_folder({"model.safetensors": "", "tokenizer.json": "{}",
                       "config.json": '{"model_type": "openai-gpt", "n_head": 2, "n_layer": 2}'})),
    Run("stage validate: a local folder with sizes per layer (gemma4_text)", ("stage", "validate"),
        ("model_type='gemma4_text' (mine/config.json) cannot be captured yet: its config sets head_dim and other "
         "sizes per layer",),
        params={**LOCAL, "model.source.path": "mine"},
        setup=_folder({"model.safetensors": "", "tokenizer.json": "{}",
                       "config.json": '{"model_type": "gemma4_text", "num_attention_heads": 2, '
                                      '"num_hidden_layers": 2, "per_layer_config": {}}'})),
    Run("stage validate: model=gguf on a file that is not GGUF", ("stage", "validate"),
        ("mine/fake.gguf: not a readable GGUF file",),
        params={**LOCAL, "model.source.kind": "gguf", "model.source.path": "mine/fake.gguf",
                "model.source.file": None, "model.source.files": "mine/fake.gguf"},
        setup=_folder({"fake.gguf": "PK not a gguf at all"})),
    Run("stage trajectories: sampling.top_p=0", ("stage", "trajectories"),
        ("sampling.top_p=0 is not allowed: a number in (0.0, 1.0]",), params={"sampling.top_p": 0}),
    Run("stage forward: capture.kernels=fast", ("stage", "forward"),
        ("capture.kernels='fast' is not allowed: one of native, portable",), params={"capture.kernels": "fast"}),
    Run("stage forward: capture.kernels=portable with the kernels capped below AVX2", ("stage", "forward"),
        ("capture.kernels='portable' is not allowed on this machine:", "use native"),
        params={"capture.kernels": "portable"}, env={"ATEN_CPU_CAPABILITY": "default"}),
    Run("verify --rev of a revision that does not exist", ("nexttoken", "verify", "--rev", "no-such-rev"),
        ("no-such-rev",)),
    Run("verify of a run whose model snapshot is missing", ("nexttoken", "verify"),
        ("the run's model snapshot is missing",), setup=_hide_snapshot),
    Run("verify --stages tokenize", ("nexttoken", "verify", "--stages", "tokenize"),
        ("--stages='tokenize' is not allowed: stages that compute:",)),
    *[Run(f"stage {stage}: sampling.temperature=1e-40 (overflows float32)", ("stage", stage),
          ("sampling.temperature=1e-40 is not allowed: 0 (greedy) or at least ", "overflows float32"),
          params={"sampling.temperature": 1e-40}) for stage in ("probs", "trajectories")],
    Run("stage validate: sampling.top_p=2", ("stage", "validate"),
        ("nexttoken validate: error: sampling.top_p=2 is not allowed: a number in (0.0, 1.0]",),
        params={"sampling.top_p": 2}),
    Run("stage validate: an unknown section foo: 1", ("stage", "validate"),
        ("foo=1 is not allowed: a known section: model, prompt",), params={"foo": 1}),
    Run("stage equivalence: equivalence.prompts=[nope] (not a prompt of the run)", ("stage", "equivalence"),
        ("nexttoken equivalence: error: equivalence.prompts='nope' is not allowed: null or a list of the run's "
         "prompt ids: temperature_question",), params={"equivalence.prompts": ["nope"]}),
    Run("stage attribution: attribution.prompts=[nope] (not a prompt of the run)", ("stage", "attribution"),
        ("nexttoken attribution: error: attribution.prompts='nope' is not allowed: null or a list of the run's "
         "prompt ids: temperature_question",), params={"attribution.prompts": ["nope"]}),
    Run("stage attribution: attribution.top_k=152065 (output size 152064)", ("stage", "attribution"),
        ("attribution.top_k=152065 is not allowed: an integer in [1, 152064] (this model's output size)",),
        params={"attribution.top_k": 152065}),
    Run("stage prepare_model: model.source.architecture.vocab_size=1000", ("stage", "prepare_model"),
        ("model.source.architecture.vocab_size=1000 is not allowed: an integer >= 151669",),
        params={"model.source.architecture.vocab_size": 1000}),
]

# argparse's own errors (pipeline/tools/cli.py prints them as one line too).
CLI_USAGE = [
    Run("nexttoken (no command)", ("nexttoken",), ("required: command",)),
    Run("nexttoken nope", ("nexttoken", "nope"), ("invalid choice: 'nope'",)),
    Run("compose --nope", ("nexttoken", "compose", "--nope"), ("unrecognized arguments: --nope",)),
    Run("compose --prompt and --prompt-file", ("nexttoken", "compose", "--prompt", "a", "--prompt-file", "p.txt"),
        ("argument --prompt-file: not allowed with argument --prompt",)),
    Run("bench outside a checkout", ("nexttoken", "bench", "--lengths", "abc"),
        ("nexttoken bench runs in a checkout of the nexttoken repository",)),
    Run("diff with one revision", ("nexttoken", "diff", "HEAD"), ("required: rev_b",)),
]


@pytest.fixture(scope="module")
def victim(chain_ws, tmp_path_factory) -> Path:
    """A workspace with a complete tiny_qwen2 run, which every bad input must leave as it is."""
    return copy_ws(chain_ws, tmp_path_factory.mktemp("bad_inputs") / "ws")


def _run(run: Run, ws: Path) -> subprocess.CompletedProcess:
    original = (ws / paths.PARAMS).read_bytes()
    if run.params:
        params = yaml.safe_load(original)
        for key, value in run.params.items():
            params = set_key(params, key, value)
        (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    restore = run.setup(ws) if run.setup else None
    try:
        before = snapshot(ws)
        if run.argv[0] == "stage":
            # as dvc repro: validate first; a value it accepts, its files say so (then the stage decides)
            proc = validated.ensure(ws, env=run.env) if run.argv[1] != "validate" else None
            if proc is None or proc.returncode == 0:
                before = snapshot(ws)
                proc = run_module(f"stages.{run.argv[1]}", ws, env=run.env)
        else:
            proc = subprocess.run(list(run.argv), cwd=ws, capture_output=True, text=True, timeout=300,
                                  env=python_env(**(run.env or {})))
        assert snapshot(ws) == before, "a failed run changed artifacts/ or params.yaml"
        assert not (ws / paths.STAGING).exists() or not any((ws / paths.STAGING).iterdir())
    finally:
        if restore:
            restore()
        (ws / paths.PARAMS).write_bytes(original)
    return proc


@pytest.mark.parametrize("run", SUBPROCESS, ids=[r.id for r in SUBPROCESS])
def test_real_cli_and_stages_refuse_bad_input(run, victim):
    proc = _run(run, victim)
    one_line_error(proc, *run.needles)


@pytest.mark.parametrize("run", CLI_USAGE, ids=[r.id for r in CLI_USAGE])
def test_argparse_errors_are_one_line_naming_the_argument(run, victim):
    one_line_error(_run(run, victim), "error: ", *run.needles)
