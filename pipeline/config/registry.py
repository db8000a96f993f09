"""Comparing configs: the dotted keys where two nested mappings differ, and a value by its dotted key.

(Which keys each stage reads is declared with the stage: pipeline/store/stages.py.)
"""

from __future__ import annotations

from typing import Any


def diff_keys(a, b, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings (a recorded config and params.yaml)."""
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


ABSENT = "<absent>"


def dotted(d: Any, key: str) -> Any:
    """d["a"]["b"] for key "a.b"; ABSENT where the path does not exist."""
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return ABSENT
        d = d[part]
    return d
