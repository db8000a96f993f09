"""Progress bars: drawn on a terminal, silent anywhere else (CI logs, DVC's captured output)."""

from __future__ import annotations

import io
import sys

from pipeline import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_is_drawn_on_a_terminal(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert list(progress.bar(iter(range(5)), 5, "write logits.parquet", "position")) == [0, 1, 2, 3, 4]
    assert "write logits.parquet" in term.getvalue() and "/5 " in term.getvalue()   # leave=False: cleared after


def test_no_bar_off_a_terminal_or_for_one_item(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    pipe = io.StringIO()                       # isatty() is False: a log file or a pipe
    monkeypatch.setattr(sys, "stderr", pipe)
    assert list(progress.bar(range(5), 5, "steps")) == [0, 1, 2, 3, 4]
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    one = [7]
    assert progress.bar(one, 1, "steps") is one
    assert pipe.getvalue() == "" and term.getvalue() == ""
