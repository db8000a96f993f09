"""Every shell and Python example of README.md and docs/*.md runs, on tiny_qwen2 (issue 27).

The blocks are the Markdown fences (parsed with markdown-it, CommonMark) whose language is one of
SHELL or PYTHON. A block runs unless the line right above its opening fence marks it (the grammar,
MARK, is documented in docs/testing.md, "Doc examples"):

    <!-- example: gemma -->              needs gemma3_270m (the default model): not run here
    <!-- example: gpu -->                needs CUDA: run only where CUDA is present
    <!-- example: not-run: REASON -->    not run, for the reason given (required): a placeholder for
                                         the reader's own model or revision, or a second whole chain
                                         (minutes on 2 cores) that another test runs, named

Any of them may carry `: REASON`; `not-run` must. `test_every_example_is_run_or_marked` (fast)
fails on a marker that is not this grammar, on one that is not directly above a shell or Python
block, and on a fence in a language that is neither an example nor known to be no code (NOT_CODE).

The blocks of one doc run in order, in one workspace (so `dvc repro` then `nexttoken audit`
reads that run): a copy of one clone of this working tree (tests/helpers/worktree.py) made once for
the module, where `nexttoken compose model=tiny_qwen2 && dvc repro` ran and was committed as
`baseline`, with its DVC cache (and run cache) shared by every doc's copy. Shell blocks run with
`bash -e` (`console` blocks: their `$ ` lines), Python blocks with the venv's python; a doc's Python
blocks are one notebook (each runs after the doc's earlier ones, in one fresh interpreter), and a
traceback names the doc's own file and line. The workspace differs from a reader's checkout only
as WORKSPACE_RULES say; no command is rewritten.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests.conftest import REPO
from tests.helpers import shared
from tests.helpers.worktree import sh, tool_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python"}
NOT_CODE = {"", "text", "json", "jsonl", "yaml", "toml", "csv"}     # fences that are data or output, never run
KINDS = {"gemma", "gpu", "not-run"}
MARK = re.compile(r"<!--\s*example:\s*(?P<kind>[\w-]+)\s*(?::\s*(?P<reason>.*?))?\s*-->", re.S)
BLOCK_TIMEOUT_S = 1200
TAIL = 6000

# How the docs' workspace differs from a reader's checkout after `make setup`, all of it:
WORKSPACE_RULES = (
    "conf/sampling/reference.yaml decodes 4 new tokens, not 24 (clone_worktree(decode_steps=4), tests/conftest.py "
    "TEST_STEPS): each step costs two stages a full-vocabulary pass",
    ".venv is a link to this checkout's venv (`source .venv/bin/activate` works), excluded in .git/info/exclude",
    "prompts/mine.txt (one prompt) and prompts/mine.jsonl (concepts.jsonl's first two records) exist: the docs' "
    "own prompt files",
    "`nexttoken compose model=tiny_qwen2 && dvc repro` ran and was committed before the first block",
)
MINE = shared.BASELINE_PROMPTS       # the run's shared baseline (tests/helpers/shared.py) has them


@dataclass(frozen=True)
class Block:
    doc: str            # relative to the repository
    line: int           # of the opening fence, from 1
    lang: str
    code: str
    kind: str | None    # None: run
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def parse(path: Path, root: Path = REPO) -> tuple[list[Block], list[str]]:
    """(the shell and Python blocks of a Markdown file, its problems: bad markers, unknown fence languages)."""
    rel = path.relative_to(root).as_posix()
    text = path.read_text(encoding="utf-8")
    tokens = MarkdownIt("commonmark").parse(text)
    blocks, problems, used = [], [], set()
    for i, tok in enumerate(tokens):
        if tok.type != "fence":      # an indented code block is no example: the docs fence theirs
            continue
        line = tok.map[0] + 1
        lang = tok.info.split()[0].lower() if tok.info.strip() else ""
        prev = tokens[i - 1] if i else None
        mark = None
        if prev is not None and prev.type == "html_block" and prev.map[1] == tok.map[0]:
            mark = MARK.fullmatch(prev.content.strip())
            if mark:
                used.add(prev.map[0] + 1)
        if lang not in SHELL | PYTHON:
            if lang not in NOT_CODE:
                problems.append(f"{rel}:{line}: a ```{lang} block: neither an example (SHELL, PYTHON) nor NOT_CODE")
            if mark:
                problems.append(f"{rel}:{prev.map[0] + 1}: an example marker above a ```{lang} block, which never runs")
            continue
        kind, reason = (mark["kind"], mark["reason"] or None) if mark else (None, None)
        if kind is not None and kind not in KINDS:
            problems.append(f"{rel}:{prev.map[0] + 1}: example marker kind {kind!r} is not one of {sorted(KINDS)}")
        if kind == "not-run" and not reason:
            problems.append(f"{rel}:{prev.map[0] + 1}: `not-run` needs a reason: <!-- example: not-run: WHY -->")
        blocks.append(Block(rel, line, lang, tok.content, kind, reason))
    # Every HTML comment that names `example` (a block of its own, or inline in a paragraph) must be one used above.
    html = [(t.map[0] + 1, t.content) for t in tokens if t.type == "html_block"]
    html += [(t.map[0] + 1, c.content) for t in tokens if t.type == "inline" for c in t.children or ()
             if c.type == "html_inline"]
    for n, content in html:
        if re.search(r"<!--\s*example\b", content) and n not in used:
            problems.append(f"{rel}:{n}: an example marker that is not `<!-- example: KIND[: REASON] -->` "
                            "on the line right above a shell or Python block")
    return blocks, problems


PARSED = {doc: parse(doc) for doc in DOCS}
BLOCKS = [b for blocks, _ in PARSED.values() for b in blocks]


def test_every_example_is_run_or_marked():
    problems = [p for _, found in PARSED.values() for p in found]
    assert not problems, "\n".join(problems)
    assert len({b.where for b in BLOCKS}) == len(BLOCKS) > 30
    run = [b for b in BLOCKS if b.kind is None]
    assert len(run) > len(BLOCKS) // 2, "most examples run; a marker is the exception"


def test_the_marker_grammar_is_found_and_checked(tmp_path):
    doc = tmp_path / "probe.md"
    doc.write_text("<!-- example: not-run: a reason -->\n```bash\ntrue\n```\n\n<!-- example: not-run -->\n"
                   "```sh\ntrue\n```\n\n<!-- example: gemma -->\n\n```python\npass\n```\n\n<!-- example: nope -->\n"
                   "```console\n$ true\n```\n\n```zsh\ntrue\n```\n\n"
                   "see `<!-- example: gpu -->` and <!-- example: gpu -->\n", encoding="utf-8")
    blocks, problems = parse(doc, tmp_path)
    assert [(b.line, b.lang, b.kind, b.reason) for b in blocks] == [
        (2, "bash", "not-run", "a reason"), (7, "sh", "not-run", None), (13, "python", None, None),
        (18, "console", "nope", None)]
    assert [p.split(": ", 1)[0] for p in problems] == [
        "probe.md:6", "probe.md:17", "probe.md:22", "probe.md:11", "probe.md:26"], problems
    # no reason; an unknown kind; an unknown language; a blank line between marker and fence; inline (code is fine)


def test_no_doc_calls_a_duckdb_command():
    """`duckdb` is a Python module here (make setup installs no `duckdb` command): a `duckdb -c` /
    `duckdb file.db` command line anywhere is one that fails."""
    calls = [f"{doc.relative_to(REPO)}:{n}" for doc in DOCS
             for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1)
             if re.search(r"(^|[`$;|&(]\s*)duckdb\s+(-|\S+\.(db|duckdb|parquet)\b)", line)]
    assert not calls, calls


# --- running them -----------------------------------------------------------------------------------------

# A doc's Python blocks in one interpreter: each compiled under the doc's path, at its own lines.
NOTEBOOK = """\
import json, sys
ns = {"__name__": "__main__"}
for path, line, code in json.load(sys.stdin):
    exec(compile("\\n" * line + code, path, "exec"), ns)
"""


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    repo = shared.baseline_clone(tmp_path_factory.mktemp("docs") / "baseline")    # MINE in it, run, committed
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1])
    with (repo / ".git/info/exclude").open("a") as f:
        f.write("/.venv\n")
    return repo


@pytest.fixture(scope="module")
def doc_state(baseline, tmp_path_factory):
    """doc -> {"ws": its workspace, "failed": the first of its blocks that failed}, made on first use."""
    state: dict[str, dict] = {}

    def get(doc: str) -> dict:
        if doc not in state:
            ws = tmp_path_factory.mktemp("doc") / Path(doc).stem
            shutil.copytree(baseline, ws, symlinks=True,       # all but the DVC cache, which the copies share
                            ignore=lambda d, names: ["cache"] if Path(d) == baseline / ".dvc" else [])
            sh(ws, "dvc", "cache", "dir", "--local", str(baseline / ".dvc/cache"))
            state[doc] = {"ws": ws, "failed": None}
        return state[doc]

    return get


def _command(block: Block, ws: Path) -> tuple[list[str], str | None]:
    """argv and stdin of a block."""
    if block.lang in PYTHON:
        earlier = [b for b in BLOCKS if b.doc == block.doc and b.lang in PYTHON and b.line <= block.line
                   and b.kind is None]
        cells = [(str(REPO / b.doc), b.line, b.code) for b in earlier]
        return [str(Path(ws) / ".venv/bin/python"), "-c", NOTEBOOK], json.dumps(cells)
    code = block.code
    if block.lang == "console":
        code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))
    return ["bash", "-e", "-c", code], None


def _skip_reason(block: Block) -> str | None:
    if block.kind == "gemma":
        return f"needs gemma3_270m{': ' + block.reason if block.reason else ''}"
    if block.kind == "gpu":
        import torch
        return None if torch.cuda.is_available() else "needs CUDA"
    if block.kind == "not-run":
        return f"not run: {block.reason}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_the_example_runs(block, doc_state):
    reason = _skip_reason(block)
    if reason:
        pytest.skip(reason)
    state = doc_state(block.doc)
    if state["failed"]:
        pytest.skip(f"{state['failed']} failed before it, in the same workspace")
    ws = state["ws"]
    argv, stdin = _command(block, ws)
    proc = subprocess.run(argv, cwd=ws, input=stdin, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          env=tool_env(VIRTUAL_ENV=str(ws / ".venv")))
    if proc.returncode != 0:
        state["failed"] = block.where
        pytest.fail(f"{block.where}: the ```{block.lang} example exited {proc.returncode}\n{block.code}"
                    f"--- stdout (tail) ---\n{proc.stdout[-TAIL:]}\n--- stderr (tail) ---\n{proc.stderr[-TAIL:]}",
                    pytrace=False)
