"""Compose `conf/` (+ Hydra overrides) into `params.yaml`, exactly as `dvc exp run` does.

DVC's Hydra integration (`hydra.enabled = true` in .dvc/config) composes `conf/` into
params.yaml for `dvc exp run -S ...`. `nexttoken compose` calls the same DVC function, so
both paths write the same bytes; every section is validated before anything is written.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from pipeline.atomic import write_atomic
from pipeline.config import schema
from pipeline.errors import UserError, bad_value

CONF_DIR = "conf"
CONFIG_NAME = "config"


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
    params = schema.read_params(out_file)
    for extra in sorted(set(params) - set(schema.SECTIONS), key=str):
        raise bad_value(str(extra), params[extra], "a config section: " + ", ".join(schema.SECTIONS))
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
            known = schema.known_keys(name.rpartition(".")[0])
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
    """Write params_file atomically from conf/ + overrides (nothing is written when invalid)."""
    return write_atomic(params_file, lambda tmp: compose_to(tmp, overrides, root))


def check(root: Path, params_file: Path) -> list[str]:
    """Keys where params_file differs from the composition of conf/ (empty: in step)."""
    with tempfile.TemporaryDirectory() as d:
        expected = compose_to(Path(d) / "params.yaml", [], root)
    actual = schema.read_params(params_file)
    return diff_keys(expected, actual)


def diff_keys(a, b, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in a or k not in b:
                out.append(key)
            else:
                out.extend(diff_keys(a[k], b[k], key))
        return out
    return [] if a == b and type(a) is type(b) else [prefix or "<root>"]
