"""Markdown pieces of the report: cells that show text exactly, tables that cite their artifact, figures.

Shared by the run's detail sections (render.py) and the set overview (overview.py); no I/O.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pipeline.report.plots import Figure
from pipeline.store import paths


def src(item, prompt_id: str | None = None) -> str:
    """The repository-relative path of an artifact (a per-prompt one: the prompt's partition), as the
    report cites it."""
    if not isinstance(item, tuple):
        return Path(item).as_posix()
    return (paths.partition(item, prompt_id) if item in paths.PER_PROMPT else paths.artifact(item)).as_posix()


def code(s: Any) -> str:
    """A table cell showing text `s` exactly: JSON-quoted (spaces, newlines visible) in a code span.
    For token text and pieces, where white space is the point; names and versions use `name()`."""
    return name(json.dumps(s, ensure_ascii=False) if isinstance(s, str) else s)


def name(s: Any) -> str:
    """A name, version or id in a code span, as it is (no quotes)."""
    text = str(s)
    fence = "``" if "`" in text else "`"
    text = text.replace("|", "\\|")     # a bare pipe would end the table cell
    return f"{fence}{text}{fence}"


def prob(p: float) -> str:
    """Probabilities as in the article (4 decimals); tiny ones in scientific form, not 0.0000."""
    return f"{p:.4f}" if p >= 1e-3 else f"{p:.3e}"


def exact(x: float) -> str:
    return repr(float(x))   # shortest string that reads back as the same double


def yes(b: bool | None) -> str:
    return "n/a" if b is None else ("yes" if b else "**no**")


def table(headers: list[str], rows: list[list], source: str | list[str]) -> list[str]:
    sources = [source] if isinstance(source, str) else source
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out + ["", "source: " + ", ".join(f"`{s}`" for s in sources), ""]


def cell(c: Any) -> str:
    # A bare pipe ends a table cell and a newline ends the row; code() already escaped its pipes.
    return re.sub(r"(?<!\\)\|", r"\\|", str(c)).replace("\n", " ")


def figure(fig: Figure) -> list[str]:
    return [f"![{fig.caption}]({fig.png})", "", f"*{fig.caption}* Data: `{fig.data}`.", ""]
