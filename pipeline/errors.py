"""The one error type a user sees: a bad value, named, with what is allowed.

Stages and the CLI print it as one line and exit with status 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input or a missing prerequisite, explained in one line."""


def bad_value(key: str, value: object, allowed: str) -> UserError:
    """`key=value` is not allowed; say what is."""
    return UserError(f"{key}={value!r} is not allowed: {allowed}")


def interrupted(stage: str) -> str:
    """The one line a stage prints when Ctrl-C stops it (before or after its imports)."""
    return f"nexttoken {stage}: interrupted; nothing was written to artifacts/{stage}"
