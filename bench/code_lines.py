"""Code lines of Python files: the measure issue 12's "validation code 40% shorter" is stated in.

A code line is a physical line that holds part of a token other than a comment: blank lines,
comment-only lines and docstrings (a string that is a statement of its own, e.g. the first
statement of a module, class or function) do not count; every line of a statement split over
several lines does. Prints, per file (or `FILE:A-B`, lines A to B of it): its name, its lines in
all, its code lines; then the total.

    python -m bench.code_lines pipeline/config/schema.py
    git show 0286aca:pipeline/config.py > /tmp/c0.py && python -m bench.code_lines /tmp/c0.py
    python -m bench.validation_size      # issue 12: config.py and the checks it repeated, then and now
"""

import io
import sys
import textwrap
import tokenize

SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
BLANK = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE}


def _is_docstring(tokens: list[tokenize.TokenInfo], i: int) -> bool:
    """A string alone on its statement: at a statement's start (or after a colon) and ended by NEWLINE."""
    before = i - 1
    while before >= 0 and tokens[before].type in BLANK:
        before -= 1
    starts = before < 0 or tokens[before].type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    return (starts or tokens[before].string == ":") and tokens[i + 1].type == tokenize.NEWLINE


def code_lines(source: str) -> int:
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines: set[int] = set()
    for i, token in enumerate(tokens):
        if token.type in SKIPPED or (token.type == tokenize.STRING and _is_docstring(tokens, i)):
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines)


def count(lines: list[str]) -> int:
    """The code lines of some whole lines of a file, dedented (so a method can be counted alone)."""
    return code_lines(textwrap.dedent("".join(lines)))


def main(paths: list[str]) -> None:
    """Each argument is a file, or `FILE:A-B` for its lines A to B (1-based, inclusive; dedented, so a
    method can be counted alone); the last line is the total of the code lines."""
    total = 0
    for arg in paths:
        path, _, span = arg.partition(":")
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)
        if span:
            first, _, last = span.partition("-")
            lines = lines[int(first) - 1:int(last or first)]
        n = count(lines)
        total += n
        print(arg, len(lines), n)
    print("total", total)


if __name__ == "__main__":
    main(sys.argv[1:])
