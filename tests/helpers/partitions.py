"""The per-prompt files of a test run: the tests run sets of one, so each dataset holds one partition."""

from __future__ import annotations

from pathlib import Path

from pipeline.store import paths


def part(item: tuple[str, str], root: Path | str) -> Path:
    """The one partition of a per-prompt item in the run at root (an error if it holds not exactly one)."""
    (pid,) = paths.prompt_ids(item, root) or paths.prompt_ids(paths.TOKENS, root)
    return paths.partition(item, pid, root)


def rel(item: tuple[str, str], root: Path | str) -> str:
    """`part`, relative to the run's root, as manifests and messages name it."""
    return part(item, root).relative_to(root).as_posix()
