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
import tempfile
from pathlib import Path

import yaml

from pipeline.atomic import write_atomic
from pipeline.config import schema
from pipeline.config.registry import diff_keys
from pipeline.errors import UserError, bad_value

CONF_DIR = "conf"
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
    try:
        compose_and_dump(out_file, str(conf), None, CONFIG_NAME, str(root.resolve()), list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise _explain(e, overrides, conf) from None
    params = schema.read_params(out_file)      # an unknown section is refused there
    for section in schema.SECTIONS:
        schema.load_section(params, section, root)
    return params


def _explain(err: Exception, overrides: list[str], conf: Path) -> UserError:
    """Hydra's multi-line errors as one line naming the override; unknown choices and keys list the options."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    first = re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: repr(m.group())[1:-1], first)   # one printable line
    for ov in overrides:
        if not ov.partition("=")[0].lstrip("+~") or not _parses(ov):
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


def _parses(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    try:
        OverridesParser.create().parse_overrides([override])
    except HydraException:
        return False
    return True


def compose(overrides: list[str], root: Path, params_file: Path) -> dict:
    """Write params_file atomically from conf/ + overrides, and record the overrides beside it
    (nothing is written when invalid)."""
    params = write_atomic(params_file, lambda tmp: compose_to(tmp, overrides, root))
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
