"""The parts of a stage's per-prompt work that both executors share: the work's protocol, a worker's
`Writer` (`WorkerOutput`), one prompt run on a worker (`run_one` -> `PromptResult`) and its result taken
into the stage (`accept`: the inputs verified, then the bytes written into staging)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pipeline.errors import UserError
from pipeline.store import ledger
from pipeline.store.artifacts import StageRun, Writer
from pipeline.store.staging import Staging


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library: nothing to call)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """Give the memory a prompt freed back to the system (glibc `malloc_trim(0)`), after each prompt of either
    executor. A prompt allocates and frees full-vocabulary arrays (1.2 MB each in FP64 for 152k ids) among small
    objects that live on; glibc keeps the freed blocks in its heap, and without this a stage's RSS grew by
    about 2.4 MB per prompt (probs, 100 prompts: 447 -> 684 MB; with it flat at about 420 MB), for about 6 ms per
    prompt. Python's own allocations stayed flat (tracemalloc): nothing was held, only not returned."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class LoadsInSetup:
    """Base of a PromptWork: what `setup` loads goes into `_`-named attributes, which pickling leaves out
    (a work is pickled for its workers before `setup`: never the weights)."""

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class PromptWork(Protocol):
    stage: str

    def setup(self) -> None: ...

    def run(self, out: Writer, prompt_id: str) -> Any: ...


@dataclass
class PromptResult:
    """What a worker returns for one prompt: its files (path in the stage folder -> bytes), the inputs
    it used (verified by the stage before a byte is written), the facts and model record it set, its
    value for the set-level files, its seconds, where it ran, and a UserError's text or a crash's
    traceback instead of a value."""
    prompt_id: str
    files: dict[str, bytes] = field(default_factory=dict)
    used: list[tuple[Any, str | None]] = field(default_factory=list)
    facts: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    value: Any = None
    seconds: float = 0.0
    where: dict[str, Any] = field(default_factory=dict)
    user_error: str | None = None
    crash: str | None = None


class WorkerOutput(Writer):
    """`Writer` for one prompt on a worker: files go to a private folder, inputs are located (the
    stage verifies them), nothing is written under `artifacts/`."""

    def __init__(self, stage: str, root: Path, config: dict[str, Any], model: dict[str, Any] | None,
                 folder: Path):
        super().__init__(stage, Path(root), config, Staging(folder), model)
        self.used: list[tuple[Any, str | None]] = []

    def use(self, item, prompt_id: str | None = None) -> Path:
        self.used.append((item, prompt_id))
        return ledger.locate(item, self.root, prompt_id)


def run_one(work: PromptWork, root: Path, config: dict, model: dict | None, prompt_id: str) -> PromptResult:
    """One prompt on a worker (`cluster.Worker.run`): never raises for the prompt's own failure, so the
    stage can verify the inputs it used before it reports that failure."""
    import traceback
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"nexttoken-{work.stage}-") as tmp:
        out = WorkerOutput(work.stage, root, config, model, Path(tmp))
        result = PromptResult(prompt_id)
        try:
            result.value = work.run(out, prompt_id)
            result.files, result.facts, result.model = out.files.read(), out.facts or None, out.model
        except UserError as e:
            result.user_error = str(e)
        except Exception:       # a bug, not the user's input: the stage shows its traceback
            result.crash = traceback.format_exc()
        result.used, result.seconds = out.used, time.perf_counter() - start
    release_memory()
    return result


def accept(stage: StageRun, result: PromptResult) -> Any:
    """A worker's prompt into the stage: its inputs verified first, then its bytes into staging."""
    for item, pid in result.used:
        stage.use(item, pid)                # a tampered or stale input is refused here, naming the file
    if result.user_error is not None:
        raise UserError(result.user_error)
    if result.crash is not None:
        raise RuntimeError(f"stage {stage.stage}, prompt {result.prompt_id}: the work failed on its worker "
                           f"({result.where.get('node', '?')}):\n{result.crash}")
    stage.files.put(result.files)
    if result.model is not None:
        stage.model = result.model
    stage.prompt_done(result.prompt_id, result.seconds, result.facts)
    return result.value
