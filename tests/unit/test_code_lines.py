"""bench.code_lines, the measure of issue 12's size target: what counts as a code line."""

from __future__ import annotations

from bench import code_lines

SOURCE = '''"""Module docstring: not code."""

import os   # a comment after code: the line counts


def f(a,
      b):
    """A docstring over
    two lines."""
    # a comment alone
    x = "a string that is a value"
    return (a +
            b + len(x) + len(os.sep))
'''


def test_code_lines_skip_docstrings_comments_and_blanks_and_count_every_line_of_a_split_statement():
    # import, def (2 lines), x = ..., return (2 lines)
    assert code_lines.code_lines(SOURCE) == 6


def test_a_span_of_a_file_is_dedented_and_counted_with_a_total(tmp_path, capsys):
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    code_lines.main([f"{path}:6-13", str(path)])      # the function alone (indented body), then the file
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{path}:6-13 8 5", f"{path} 13 6", "total 11"]
