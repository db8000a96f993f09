"""Run tools in a temporary git clone of this working tree (the e2e / reliability tests, `nexttoken bench`).

`clone_worktree` copies the tracked and the untracked-but-not-ignored files (what a commit of
the current tree would hold) into a new repository and commits them there, so `dvc repro` and
`dvc exp run` work on the tree as it is, with their own git history and DVC cache. `sh` runs a
command with this interpreter's bin folder first on PATH: DVC runs stages, and its queue's
workers run them, with `python` from PATH, which must be this venv's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the checkout these helpers are imported from
TAIL_CHARS = 20_000                          # of stdout and of stderr, in the error of a failed command
# Commits in the clone need an identity; GIT_AUTHOR_* / GIT_COMMITTER_* in the environment win over it.
IDENTITY = ("-c", "user.name=nexttoken", "-c", "user.email=nexttoken@nexttoken.invalid")


class CommandFailed(RuntimeError):
    """A command run by `sh` exited non-zero; the message holds its output."""


def tool_env(**extra: str) -> dict[str, str]:
    """This environment with the interpreter's bin folder first on PATH and DVC's analytics off, plus `extra`."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "DVC_NO_ANALYTICS": "1", **extra}


def sh(cwd: Path, *cmd: str, check: bool = True, timeout: int = 1800,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` in `cwd` (output captured as text, environment `tool_env(**env)`); with `check`,
    a non-zero exit raises CommandFailed with the command, its exit code and its output."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=tool_env(**(env or {})))
    if check and proc.returncode != 0:
        raise CommandFailed(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                            f"{proc.stdout[-TAIL_CHARS:]}\n{proc.stderr[-TAIL_CHARS:]}")
    return proc


def clone_worktree(dest: Path, repo: Path = ROOT, decode_steps: int | None = None) -> Path:
    """Tracked + untracked-not-ignored files of `repo`'s working tree, committed in a new repo at `dest`.

    decode_steps: conf/'s sampling.max_new_tokens in the clone (params.yaml composed again), as the tests'
    workspaces decode (tests/conftest.py TEST_STEPS): each step costs the trajectories and checks stages a
    full-vocabulary pass, and conf/'s 24 are for gemma3_270m's continuation, not for what a test proves."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (repo / rel).is_file():        # listed but deleted in the working tree: not in the clone
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / rel, dest / rel)
    if decode_steps is not None:
        conf = dest / "conf/sampling/reference.yaml"
        text, n = re.subn(r"^max_new_tokens: \d+", f"max_new_tokens: {decode_steps}", conf.read_text(), flags=re.M)
        if n != 1:
            raise ValueError(f"{conf}: no max_new_tokens line to set")
        conf.write_text(text)
        sh(dest, sys.executable, "-m", "pipeline.tools.cli", "compose")
    sh(dest, "git", "init", "-q")
    sh(dest, "git", "add", "-A")
    sh(dest, "git", *IDENTITY, "commit", "-qm", "clone of the working tree")
    return dest


def wait_for_queue(repo: Path, timeout: float, poll_s: float = 3) -> str:
    """Poll `dvc queue status` in `repo` until nothing is queued or running; its last output.
    TimeoutError (with that output) when the queue is still busy after `timeout` seconds."""
    deadline, status = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        status = sh(repo, "dvc", "queue", "status").stdout
        if not re.search(r"\b(Queued|Running)\b", status) and "0 active" in status:
            return status
        time.sleep(poll_s)
    raise TimeoutError(f"the queue did not finish in {timeout} s:\n{status}")
