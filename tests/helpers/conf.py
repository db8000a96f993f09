"""A conf/ option as Hydra composes it, read without Hydra: the option's file merged over the options of its
group its `defaults` list names (conf/model/tiny_qwen2.yaml is tiny.yaml with family qwen2). For tests
that read one option's values directly; tests/unit/test_config.py holds it to the composition."""

from __future__ import annotations

from pathlib import Path

import yaml

CONF = Path(__file__).resolve().parents[2] / "conf"
MISSING = "???"


def option(group: str, name: str, conf: Path = CONF) -> dict:
    data = yaml.safe_load((conf / group / f"{name}.yaml").read_text(encoding="utf-8"))
    defaults = data.pop("defaults", None)
    if defaults is None:
        return data
    out: dict = {}
    for entry in defaults if "_self_" in defaults else [*defaults, "_self_"]:
        out = _merge(out, data if entry == "_self_" else option(group, entry, conf))
    return out


def _merge(base: dict, over: dict) -> dict:
    """OmegaConf's merge: mappings key by key, any other value replaced (but not by ???)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif value != MISSING or key not in out:
            out[key] = value
    return out
