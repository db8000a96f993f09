"""Compose `conf/` (+ Hydra overrides) into `params.yaml`, exactly as `dvc exp run` does.

DVC's Hydra integration (`hydra.enabled = true` in .dvc/config) composes `conf/` into
params.yaml for `dvc exp run -S ...`. `nexttoken compose` calls the same DVC function, so
both paths write the same bytes; every section is validated before anything is written.

`nexttoken compose` also records its overrides in params.overrides.yaml (DVC never reads it),
so `--check` (run by `make repro`) composes conf/ with the same overrides: it then fails only
when conf/ was edited since, or params.yaml was changed some other way (by hand, or by
`dvc exp run -S`, which composes without recording).
"""

from __future__ import annotations

import re
import shlex
import tempfile
from pathlib import Path

import yaml

from pipeline.atomic import write_atomic
from pipeline.config import ollama, prompt_set, schema
from pipeline.config.registry import diff_keys
from pipeline.errors import UserError, bad_value

CONF_DIR = "conf"
# Hydra plugins DVC loads when it composes conf/ (`hydra.plugins_path` in .dvc/config): the resolvers conf/ uses
PLUGINS_PATH = "pipeline/config/plugins"
CONFIG_NAME = "config"
RECORD = "params.overrides.yaml"   # beside params.yaml: the overrides it was composed with
RECORD_HEADER = ("# Written by `nexttoken compose`: the Hydra overrides params.yaml was composed with.\n"
                 "# `nexttoken compose --check` (run by `make repro`) composes conf/ with them and compares.\n")


def compose_to(out_file: Path, overrides: list[str], root: Path) -> dict:
    """Compose conf/ with overrides into out_file; return the validated params dict."""
    from dvc.utils.hydra import compose_and_dump
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    conf = (root / CONF_DIR).resolve()
    ollama.register_resolver()      # also a plugin under PLUGINS_PATH, for DVC's own composition
    try:
        compose_and_dump(out_file, str(conf), None, CONFIG_NAME, str((root / PLUGINS_PATH).resolve()),
                         with_prompt_source(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as e:   # ValueError: Hydra on `=3`
        raise _resolver_error(e) or _explain(e, overrides, conf) from None
    params = schema.read_params(out_file)      # an unknown section is refused there
    sections = {name: schema.load_section(params, name, root) for name in schema.SECTIONS}
    prompt_set.for_run(sections, root)       # a prompt set, read and checked line by line; report.prompt_id
    return params


def local_folder_exists(source: schema.SourceConfig, root: Path) -> None:
    """kind=local: `model.source.path` must name an existing folder (absolute, or relative to the repository
    root), refused here in one line as the validate stage words it; what is in the folder (config.json,
    safetensors, tokenizer, a family that can be captured) the validate stage decides."""
    if not isinstance(source, schema.LocalSource):
        return
    folder = (Path(root) / Path(source.path).expanduser()).resolve()
    if not folder.is_dir():
        raise UserError(f"model.source.path={source.path!r}: no such folder ({folder}); allowed: a folder holding "
                        "config.json, *.safetensors weights and the tokenizer files")


def _resolver_error(err: BaseException) -> UserError | None:
    """A resolver's own one-line refusal (an Ollama name not in the store), which OmegaConf wraps."""
    while err is not None and not isinstance(err, UserError):
        err = err.__cause__ or err.__context__
    return err


def _explain(err: Exception, overrides: list[str], conf: Path) -> UserError:
    """Hydra's multi-line errors as one line naming the override; unknown choices and keys list the options,
    a value Hydra reads as syntax (or as a sweep, `x, y`) says how to quote it."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    first = re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: repr(m.group())[1:-1], first)   # one printable line
    for ov in overrides:
        key, eq, value = ov.partition("=")
        if key.lstrip("+~") and eq and _parses(ov) is None:
            return bad_value("override", ov, f"key=value in Hydra override syntax ({first}); "
                             + quoting_hint(key, value))
        if not key.lstrip("+~") or not _parses(ov):
            return bad_value("override", ov, f"key=value in Hydra override syntax, e.g. sampling.top_k=5 ({first})")
    for ov in overrides:
        key, _, value = ov.partition("=")
        name = key.lstrip("+~")
        group = conf / name
        if name and group.is_dir() and not (group / f"{value}.yaml").exists():
            options = sorted(p.stem for p in group.glob("*.yaml"))
            return bad_value(name, value, "one of " + ", ".join(options))
        if f"Could not override '{name}'" in first:
            parent, _, leaf = name.rpartition(".")
            known = schema.known_keys(parent)
            if leaf in known:     # the schema takes it, conf/ does not set it: Hydra adds keys with +
                return bad_value(name, value, f"a key conf/ sets; add one it does not set as +{name}={value}")
            return bad_value(name, value, "a known key: " + ", ".join(known) if known else "a key that exists in conf/")
    return UserError(f"cannot compose conf/ with overrides {overrides}: {first}")


def _parses(override: str) -> bool | None:
    """True: one value; None: the value is not valid Hydra (or is a sweep); False: not even key=value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    key = override.partition("=")[0]
    try:
        parsed = OverridesParser.create().parse_overrides([override])[0]
    except HydraException:
        return None if key.lstrip("+~") and _parses(f"{key}=x") else False
    return None if parsed.is_sweep_override() else True


def quote(text: str) -> str:
    """text as a Hydra override value that composes back to exactly text: single quotes, a quote inside
    escaped (\\'), backslashes doubled before a quote or at the end (Hydra's rule), `${` as `\\${` (OmegaConf's)."""
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'") + "'"


def quoting_hint(key: str, value: str) -> str:
    """How to pass value verbatim: quoted for Hydra (and for a POSIX shell), or --prompt for a prompt."""
    override = f"{key}={quote(value)}"
    tail = (" or `nexttoken compose --prompt TEXT` / `--prompt-file PATH`, which quote it for you"
            if key.lstrip("+~").startswith("prompt.") else "")
    return f"quote the value for Hydra: {override} (in the shell: {shell_word(override)}; the same with " \
           f"`dvc exp run -S`){tail}"


def shell_word(word: str) -> str:
    """word as one POSIX shell word: in double quotes where nothing in it is special there (an override's
    single quotes then read plainly), else shlex's single-quoted form."""
    return f'"{word}"' if not re.search(r'["$`]|\\\\|![^ ]', word) else shlex.quote(word)


PROMPT_SOURCES = ("prompt.text", "prompt.file", "prompt.set")     # one of them gives the prompt, the others are null


def with_prompt_source(overrides: list[str]) -> list[str]:
    """overrides, plus `=null` for the other two of prompt.text / file / set when the command line gives one of them
    a value and names neither other: the prompt given on the command line replaces conf/'s (the default text, or a
    prompt option's set), as `--prompt`, `--prompt-file` and `--prompt-set` do. Two given values stay both, and
    the prompt section refuses them, naming both."""
    named = {ov.partition("=")[0].lstrip("+~"): ov.partition("=")[2].strip() for ov in overrides
             if not ov.startswith("~")}
    given = [k for k in PROMPT_SOURCES if k in named and named[k] != "null"]
    if len(given) != 1 or any(k in named for k in PROMPT_SOURCES if k != given[0]):
        return list(overrides)
    return [*overrides, *(f"{k}=null" for k in PROMPT_SOURCES if k != given[0])]


def prompt_overrides(overrides: list[str], text: str | None, file: str | None, root: Path,
                     set_file: str | None = None) -> list[str]:
    """overrides plus the ones that set the prompt verbatim: `--prompt TEXT`, `--prompt-file PATH` (a single
    prompt, so `prompt.set` is null, also over `prompt=concepts`) or `--prompt-set PATH` (a set: text and file null)."""
    if text is None and file is None and set_file is None:
        return list(overrides)
    given = [ov for ov in overrides if ov.partition("=")[0].lstrip("+~") in PROMPT_SOURCES]
    if given:
        raise UserError(f"--prompt / --prompt-file / --prompt-set set the prompt, and so does {given[0]!r}: "
                        f"give one of them")
    if text is not None:
        if problem := schema.prompt_problem(text):      # the text's own fault, before Hydra reads it
            raise bad_value("--prompt", text, problem)
        return [*overrides, "prompt.set=null", f"prompt.text={quote(text)}"]
    path = Path(file if file is not None else set_file)
    if path.is_absolute() and path.resolve().is_relative_to(root.resolve()):
        path = path.resolve().relative_to(root.resolve())      # the config records a path inside the repository
    if file is not None:
        return [*overrides, "prompt.text=null", "prompt.set=null", f"prompt.file={quote(path.as_posix())}"]
    return [*overrides, "prompt.text=null", "prompt.file=null", f"prompt.set={quote(path.as_posix())}"]


def compose(overrides: list[str], root: Path, params_file: Path, prompt_text: str | None = None) -> dict:
    """Write params_file atomically from conf/ + overrides, and record the overrides beside it
    (nothing is written when invalid, nor when a local model's folder does not exist); prompt_text: what
    prompt.text must come out as (--prompt), verified before writing."""
    def write(tmp: Path) -> dict:
        try:
            params = compose_to(tmp, overrides, root)
            verbatim = prompt_text is None or params["prompt"]["text"] == prompt_text
        except UserError:
            if prompt_text is None:
                raise
            plain = [ov if ov != f"prompt.text={quote(prompt_text)}" else "prompt.text=x" for ov in overrides]
            compose_to(tmp, plain, root)    # another override's error is that one's, not the prompt's
            verbatim = False    # OmegaConf refuses what it reads as an unclosed interpolation, `${`
        if not verbatim:
            raise bad_value("--prompt", prompt_text, "text that passes through Hydra's composition unchanged "
                            "(this one does not): put it in a file under prompts/ and use --prompt-file")
        local_folder_exists(schema.load_section(params, "model", root).source, root)
        return params
    params = write_atomic(params_file, write)
    write_atomic(params_file.with_name(RECORD), lambda tmp: tmp.write_text(
        RECORD_HEADER + yaml.safe_dump({"overrides": list(overrides)}, allow_unicode=True), encoding="utf-8"))
    return params


def recorded_overrides(params_file: Path) -> list[str]:
    """The overrides `nexttoken compose` recorded for params_file ([] without a record)."""
    record = params_file.with_name(RECORD)
    if not record.exists():
        return []
    try:
        overrides = (yaml.safe_load(record.read_text(encoding="utf-8")) or {}).get("overrides")
    except (yaml.YAMLError, AttributeError):
        overrides = None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UserError(f"{record} is not a record of overrides (a list `overrides`): run `nexttoken compose` "
                        f"to rewrite it")
    return overrides


def check(root: Path, params_file: Path) -> tuple[list[str], list[str]]:
    """(keys where params_file differs from conf/ composed with its recorded overrides (empty:
    in step), those overrides)."""
    overrides = recorded_overrides(params_file)
    with tempfile.TemporaryDirectory() as d:
        expected = compose_to(Path(d) / "params.yaml", overrides, root)
    actual = schema.read_params(params_file)
    return diff_keys(expected, actual), overrides
