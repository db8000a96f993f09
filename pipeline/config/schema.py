"""Typed, validated config at the stage boundary.

Stages read `params.yaml` (the composition of `conf/`) and turn each section they use into
a frozen dataclass here. Validation happens in `__post_init__` and raises `UserError`
naming the key, the value and what is allowed; nothing else happens there (no seeding, no
I/O). Library code never sees a DictConfig or a raw dict of params.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import yaml

from pipeline.errors import UserError, bad_value

DTYPES = ("bfloat16", "float16", "float32")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
SOURCE_KINDS = ("gguf_package", "tiny_qwen2", "hub")
BRANCHES = ("sample", "greedy")


# ---------------------------------------------------------------- value checks
def _int(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    # bool is an int in Python; a config that says `true` for a count is a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_value(key, value, "an integer" + _range_text(lo, hi))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_value(key, value, "an integer" + _range_text(lo, hi))
    return value


def _float(key: str, value: Any, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_value(key, value, "a finite number" + _range_text(lo, hi, lo_open))
    if (lo is not None and (value < lo or (lo_open and value == lo))) or (hi is not None and value > hi):
        raise bad_value(key, value, "a number" + _range_text(lo, hi, lo_open))
    return float(value)


def _range_text(lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise bad_value(key, value, "one of " + ", ".join(allowed))
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(key, value, "true or false")
    return value


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise bad_value(key, value, "a non-empty string")
    return value


def _optional_text(key: str, value: Any) -> str | None:
    return None if value is None else _text(key, value)


# C0 controls other than tab, newline and carriage return, DEL, C1 controls, lone surrogates:
# invisible in a config file, yet each becomes a token the reader of the record cannot see.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
PROMPT_DIR = "prompts"   # prompt files live here: dvc.yaml lists it as a dependency of the stages that read them
PROMPT_ALLOWED = "text without control characters or lone surrogates (tab, newline, carriage return are fine)"


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _control_char(text: str) -> str | None:
    """Where the first forbidden control character is, or None."""
    bad = _CONTROL.search(text)
    if bad is None:
        return None
    return f"U+{ord(bad.group()):04X} at character {bad.start()} (line {text.count(chr(10), 0, bad.start()) + 1})"


def prompt_text(key: str, value: Any) -> str:
    """A prompt: a string with something besides white space and no control characters."""
    if not isinstance(value, str) or not value.strip():
        raise bad_value(key, value if not isinstance(value, str) else _short(value), "a non-empty string")
    where = _control_char(value)
    if where:
        raise UserError(f"{key}={_short(value)!r} is not allowed: {where}; allowed: {PROMPT_ALLOWED}")
    return value


def repo_relpath(key: str, value: Any, what: str = "a relative path inside the repository") -> str:
    """A path that stays inside the repository, judged from its text alone (no I/O)."""
    _text(key, value)
    posix, win = PurePosixPath(value), PureWindowsPath(value)
    if posix.is_absolute() or win.is_absolute() or win.drive or value.startswith("~") \
            or ".." in posix.parts or ".." in win.parts:
        raise bad_value(key, value, what + " (no absolute paths, no ~, no ..)")
    return value


def inside_repo(key: str, value: str, root: Path | str) -> Path:
    """root/value resolved (symlinks followed); refused when it lands outside the repository."""
    repo_relpath(key, value)
    base = Path(root).resolve()
    path = (base / value).resolve()
    if not path.is_relative_to(base):
        raise bad_value(key, value, f"a path inside the repository (it resolves to {path}, outside {base})")
    return path


def prompt_file_path(key: str, value: Any) -> str:
    """A prompt file's path: relative, under PROMPT_DIR/ (the folder DVC watches), judged from its text."""
    allowed = f"a file under {PROMPT_DIR}/ inside the repository, relative to its root"
    repo_relpath(key, value, allowed)
    parts = PurePosixPath(value.replace("\\", "/")).parts
    if len(parts) < 2 or parts[0] != PROMPT_DIR:
        raise bad_value(key, value, f"{allowed} (e.g. {PROMPT_DIR}/mine.txt): DVC re-runs the stages that read "
                        f"the prompt when a file there changes")
    return value


def read_prompt_file(key: str, value: str, root: Path | str) -> str:
    """The UTF-8 text of a prompt file under PROMPT_DIR/, validated as a prompt."""
    prompt_file_path(key, value)
    path = inside_repo(key, value, root)
    folder = (Path(root) / PROMPT_DIR).resolve()
    if not path.is_relative_to(folder):
        raise bad_value(key, value, f"a file under {PROMPT_DIR}/ inside the repository (it resolves to {path}, "
                        f"outside {folder})")
    if not path.is_file():
        raise bad_value(key, value, f"an existing file under {PROMPT_DIR}/ inside the repository, relative to its root")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{key}={value!r} is not allowed: not UTF-8 (byte 0x{data[e.start]:02x} at offset "
                        f"{e.start}); allowed: a UTF-8 text file") from None
    if not text.strip():
        raise bad_value(key, value, "a file with text in it (this one is empty or white space only)")
    where = _control_char(text)
    if where:
        raise UserError(f"{key}={value!r} is not allowed: its text has {where}; allowed: {PROMPT_ALLOWED}")
    return text


# ---------------------------------------------------------------- sections
@dataclass(frozen=True)
class SourceConfig:
    kind: str
    package: str | None = None
    pip: str | None = None
    hub_id: str | None = None
    revision: str | None = None
    seed: int | None = None
    architecture: dict | None = None

    def __post_init__(self):
        _choice("model.source.kind", self.kind, SOURCE_KINDS)
        for key in ("package", "pip", "hub_id", "revision"):
            _optional_text(f"model.source.{key}", getattr(self, key))
        if self.seed is not None:
            _int("model.source.seed", self.seed, lo=0)
        if self.architecture is not None and not isinstance(self.architecture, dict):
            raise bad_value("model.source.architecture", self.architecture, "a mapping or null")
        if self.kind in ("gguf_package", "tiny_qwen2"):
            _text("model.source.package", self.package)
            _text("model.source.pip", self.pip)
        if self.kind == "hub":
            # A hub id (Qwen/Qwen2.5-7B) or a directory inside the repository: never a path
            # that leaves it (models.prepare also refuses one that resolves outside it).
            repo_relpath("model.source.hub_id", self.hub_id,
                         "a hub id like Qwen/Qwen2.5-7B or a directory inside the repository")
        if self.kind == "tiny_qwen2":
            _int("model.source.seed", self.seed, lo=0)
            _tiny_architecture(self.architecture)


TINY_ARCH_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings")
TINY_ARCH_FLOATS = ("rope_theta", "rms_norm_eps", "lm_head_std")


def _tiny_architecture(arch: Any) -> None:
    key = "model.source.architecture"
    if not isinstance(arch, dict):
        raise bad_value(key, arch, "a mapping of Qwen2Config fields")
    known = TINY_ARCH_INTS + TINY_ARCH_FLOATS
    unknown, missing = sorted(set(arch) - set(known)), [k for k in known if k not in arch]
    if unknown:
        raise bad_value(f"{key}.{unknown[0]}", arch[unknown[0]], "a known key: " + ", ".join(known))
    if missing:
        raise UserError(f"{key}.{missing[0]} is missing: the tiny_qwen2 source needs " + ", ".join(known))
    for name in TINY_ARCH_INTS:
        _int(f"{key}.{name}", arch[name], lo=1)
    for name in TINY_ARCH_FLOATS:
        _float(f"{key}.{name}", arch[name], lo=0.0, lo_open=True)
    if arch["hidden_size"] % arch["num_attention_heads"]:
        raise bad_value(f"{key}.num_attention_heads", arch["num_attention_heads"],
                        f"a divisor of hidden_size={arch['hidden_size']}")
    if arch["num_attention_heads"] % arch["num_key_value_heads"]:
        raise bad_value(f"{key}.num_key_value_heads", arch["num_key_value_heads"],
                        f"a divisor of num_attention_heads={arch['num_attention_heads']}")


@dataclass(frozen=True)
class TokenizerConfig:
    family: str
    add_special_tokens: bool
    chat_template: bool

    def __post_init__(self):
        _text("model.tokenizer.family", self.family)
        _bool("model.tokenizer.add_special_tokens", self.add_special_tokens)
        _bool("model.tokenizer.chat_template", self.chat_template)
        if self.chat_template:
            # The reference experiment scores a raw prompt; a chat template would change
            # what is being measured, and no stage implements it yet.
            raise bad_value("model.tokenizer.chat_template", True, "false (chat templates are not supported)")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    source: SourceConfig
    tokenizer: TokenizerConfig
    trust_remote_code: bool = False
    reference_figures: str | None = None

    def __post_init__(self):
        _text("model.name", self.name)
        _bool("model.trust_remote_code", self.trust_remote_code)
        if self.reference_figures is not None and (not isinstance(self.reference_figures, str)
                                                   or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*",
                                                                       self.reference_figures)):
            raise bad_value("model.reference_figures", self.reference_figures,
                            "null or the plain name of a file in pipeline/reference/ (letters, digits, _ and -)")

    @classmethod
    def from_params(cls, d: dict) -> ModelConfig:
        d = _known("model", d, cls)
        return cls(**{**d, "source": SourceConfig(**_known("model.source", d["source"], SourceConfig)),
                      "tokenizer": TokenizerConfig(**_known("model.tokenizer", d["tokenizer"], TokenizerConfig))})


@dataclass(frozen=True)
class PromptConfig:
    name: str
    text: str | None = None       # the prompt; from `file` when that is set (then text is null in params)
    expected_token_ids: dict = field(default_factory=dict)
    file: str | None = None       # a path under prompts/ whose UTF-8 text is the prompt

    def __post_init__(self):
        _text("prompt.name", self.name)
        if self.file is not None:
            prompt_file_path("prompt.file", self.file)
        if self.text is None and self.file is None:
            raise bad_value("prompt.text", None, "a non-empty string (or null with prompt.file set)")
        prompt_text("prompt.text", self.text)
        if not isinstance(self.expected_token_ids, dict):
            raise bad_value("prompt.expected_token_ids", self.expected_token_ids,
                            "a mapping tokenizer family -> list of ids")
        for fam, ids in self.expected_token_ids.items():
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                    for i in ids):
                raise bad_value(f"prompt.expected_token_ids.{fam}", ids, "a list of non-negative integer ids")

    def expected_ids_for(self, family: str) -> list[int] | None:
        return self.expected_token_ids.get(family)

    @classmethod
    def from_params(cls, d: dict, root: Path | str = ".") -> PromptConfig:
        """The prompt section; with `file` set, its text is read here (relative to root)."""
        d = _known("prompt", d, cls)
        if d.get("file") is not None:
            if d.get("text") is not None:
                raise bad_value("prompt.file", d["file"], "null when prompt.text is set: give the prompt "
                                "as text or as a file, not both (set prompt.text=null to use the file)")
            d["text"] = read_prompt_file("prompt.file", d["file"], root)
        return cls(**d)


@dataclass(frozen=True)
class CaptureConfig:
    dtype: str
    device: str
    attn_implementation: str
    attention_layers: tuple[int, ...]
    positions: str

    def __post_init__(self):
        _choice("capture.dtype", self.dtype, DTYPES)
        if not isinstance(self.device, str) or not (
                self.device in ("auto", "cpu", "cuda") or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise bad_value("capture.device", self.device, "auto, cpu, cuda or cuda:N")
        _choice("capture.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        if not isinstance(self.attention_layers, (list, tuple)):
            raise bad_value("capture.attention_layers", self.attention_layers, "a list of layer indices")
        for i in self.attention_layers:
            _int("capture.attention_layers", i)
        object.__setattr__(self, "attention_layers", tuple(self.attention_layers))
        _choice("capture.positions", self.positions, ("all", "last"))
        if self.attn_implementation != "eager":
            # sdpa never materialises attention weights; the layer-0 recompute check needs them.
            raise bad_value("capture.attn_implementation", self.attn_implementation,
                            "eager (attention weights and the layer-0 recompute need it)")

    @classmethod
    def from_params(cls, d: dict) -> CaptureConfig:
        return cls(**_known("capture", d, cls))


@dataclass(frozen=True)
class FilterConfig:
    name: str
    temperature: float
    top_k: int
    top_p: float

    def __post_init__(self):
        _text("probs.extra_filters.name", self.name)
        _float(f"probs.extra_filters.{self.name}.temperature", self.temperature, lo=0.0)
        _int(f"probs.extra_filters.{self.name}.top_k", self.top_k, lo=0)
        _float(f"probs.extra_filters.{self.name}.top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)


@dataclass(frozen=True)
class ProbsConfig:
    positions: tuple[int, ...]
    temperatures: tuple[float, ...]
    fp32_sum_tolerance: float
    fp64_sum_tolerance: float
    top_n: int
    extra_filters: tuple[FilterConfig, ...]

    def __post_init__(self):
        if not isinstance(self.positions, (list, tuple)) or not self.positions:
            raise bad_value("probs.positions", self.positions, "a non-empty list of prompt positions")
        for p in self.positions:
            _int("probs.positions", p)
        if not isinstance(self.temperatures, (list, tuple)) or not self.temperatures:
            raise bad_value("probs.temperatures", self.temperatures, "a non-empty list of numbers > 0")
        for t in self.temperatures:
            _float("probs.temperatures", t, lo=0.0, lo_open=True)
        if len(set(self.temperatures)) != len(self.temperatures):
            raise bad_value("probs.temperatures", self.temperatures, "distinct values")
        _float("probs.fp32_sum_tolerance", self.fp32_sum_tolerance, lo=0.0)
        _float("probs.fp64_sum_tolerance", self.fp64_sum_tolerance, lo=0.0)
        _int("probs.top_n", self.top_n, lo=1)
        object.__setattr__(self, "positions", tuple(self.positions))
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))

    @classmethod
    def from_params(cls, d: dict) -> ProbsConfig:
        d = _known("probs", d, cls)
        filters = d.get("extra_filters") or []
        if not isinstance(filters, list):
            raise bad_value("probs.extra_filters", filters, "a list of {name, temperature, top_k, top_p}")
        return cls(**{**d, "extra_filters": tuple(FilterConfig(**_known("probs.extra_filters", f, FilterConfig))
                                                  for f in filters)})


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    branches: tuple[str, ...]
    kv_cache: tuple[bool, ...]
    top_n: int

    def __post_init__(self):
        _float("sampling.temperature", self.temperature, lo=0.0)
        _int("sampling.top_k", self.top_k, lo=0)
        _float("sampling.top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _int("sampling.seed", self.seed, lo=0, hi=2**63 - 1)
        _int("sampling.max_new_tokens", self.max_new_tokens, lo=0)
        if not isinstance(self.branches, (list, tuple)) or not self.branches:
            raise bad_value("sampling.branches", self.branches, "a non-empty list of " + ", ".join(BRANCHES))
        for b in self.branches:
            _choice("sampling.branches", b, BRANCHES)
        if not isinstance(self.kv_cache, (list, tuple)) or not self.kv_cache:
            raise bad_value("sampling.kv_cache", self.kv_cache, "a non-empty list of true/false")
        for k in self.kv_cache:
            _bool("sampling.kv_cache", k)
        _int("sampling.top_n", self.top_n, lo=1)
        object.__setattr__(self, "branches", tuple(self.branches))
        object.__setattr__(self, "kv_cache", tuple(self.kv_cache))

    @classmethod
    def from_params(cls, d: dict) -> SamplingConfig:
        return cls(**_known("sampling", d, cls))


@dataclass(frozen=True)
class ChecksConfig:
    kv_cache_atol: float

    def __post_init__(self):
        _float("checks.kv_cache_atol", self.kv_cache_atol, lo=0.0)

    @classmethod
    def from_params(cls, d: dict) -> ChecksConfig:
        return cls(**_known("checks", d, cls))


SECTIONS = {
    "model": ModelConfig,
    "prompt": PromptConfig,
    "capture": CaptureConfig,
    "probs": ProbsConfig,
    "sampling": SamplingConfig,
    "checks": ChecksConfig,
}


def known_keys(section: str) -> list[str]:
    """The keys a (dotted) config section takes, e.g. known_keys("model.source"); [] if none."""
    nested = {"model.source": SourceConfig, "model.tokenizer": TokenizerConfig, "probs.extra_filters": FilterConfig}
    cls = nested.get(section) or SECTIONS.get(section)
    return sorted(f.name for f in fields(cls)) if cls else []


def _known(section: str, d: Any, cls) -> dict:
    """The section as a dict, refusing keys the dataclass does not know (typos)."""
    if not isinstance(d, dict):
        raise bad_value(section, d, "a mapping")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise bad_value(f"{section}.{unknown[0]}", d[unknown[0]], "a known key: " + ", ".join(sorted(names)))
    missing = sorted(n for n in names if n not in d and _required(cls, n))
    if missing:
        raise UserError(f"{section}.{missing[0]} is missing: params.yaml must set it (see conf/)")
    return dict(d)


def _required(cls, name: str) -> bool:
    from dataclasses import MISSING
    f = next(f for f in fields(cls) if f.name == name)
    return f.default is MISSING and f.default_factory is MISSING


def read_params(path: Path) -> dict:
    """params.yaml as a dict; a clear error if it is missing or not YAML."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} not found: run `nexttoken compose` to write it from conf/") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise bad_value(str(path), data, "a YAML mapping of config sections")
    return data


def load_section(params: dict, name: str, root: Path | str = "."):
    """One validated section of params.yaml (root: the repository, for paths in the config)."""
    if name not in params:
        raise UserError(f"params.yaml has no `{name}` section: run `nexttoken compose`")
    if name == "prompt":
        return PromptConfig.from_params(params[name], root)
    return SECTIONS[name].from_params(params[name])


def subset(params: dict, keys: tuple[str, ...]) -> dict:
    """The nested part of params.yaml named by dotted keys (what a stage reads and records)."""
    out: dict = {}
    for key in keys:
        node, dst = params, out
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                raise UserError(f"params.yaml has no `{key}`: run `nexttoken compose`")
            node = node[part]
            if i < len(parts) - 1:
                dst = dst.setdefault(part, {})
        dst[parts[-1]] = node
    return out
