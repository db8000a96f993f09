"""A stage's run: what its work writes through (`Writer`), the run itself (`StageRun`: a staging folder, an
input ledger and a prompt log, committed as a manifest and an atomic swap), and its entry point.

`StageRun` composes parts that each do one job: `staging.Staging` (the folder its files are written into, and
the swap into `artifacts/<stage>/`), `ledger.Ledger` (each input verified against its producer's manifest and
validate's config before it is read) and `prompt_log.PromptLog` (each prompt's seconds and facts). `commit`
writes the manifest from them, last, and swaps the folder into place: an interrupted or failed stage leaves
no partial file under `artifacts/`. A stage that feeds the report marks the report stale when it starts.
"""

from __future__ import annotations

import html
import json
import os
import re
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline import kernels, progress
from pipeline.errors import EXIT_USER_ERROR, UserError, interrupted
from pipeline.store import graph, paths, provenance
from pipeline.store.ledger import Ledger, rel
from pipeline.store.prompt_log import PromptLog

# The readers live in pipeline.store.readers; 27 modules of the library and the stages (the stage bodies among
# them, being moved to pipeline/record/ meanwhile) and 18 of the tests and the bench import them from here.
from pipeline.store.readers import (  # noqa: F401
    PARQUET_META_KEY,
    device_where,
    parquet_facts,
    read_dataset,
    read_json,
    read_manifest,
    read_manifest_once,
    read_once,
    read_parquet,
    read_safetensors,
    recorded_cpu_kernels,
    tables_stored,
)
from pipeline.store.staging import Staging


class Writer(ABC):
    """What a stage's per-prompt work writes through: files under `out()`'s folder (its `Staging`), Parquet
    files whose schema metadata carries the run's key facts, and the facts and model record it sets.
    `StageRun` writes into its staging folder; `pipeline.executor`'s worker context into a private folder
    whose bytes the stage writes after it. The bytes depend only on the stage, its config, the model record
    and the facts, never on where the work ran (a set gives the same bytes under either executor)."""

    def __init__(self, stage: str, root: Path, config: dict[str, Any], files: Staging,
                 model: dict[str, Any] | None = None):
        self.stage, self.root, self.config, self.files = stage, root, config, files
        self.model = model
        self.facts: dict[str, Any] = {}

    @property
    def staging(self) -> Path:
        """The folder written into (a stage writing a whole tree itself, e.g. a model snapshot, writes here)."""
        return self.files.folder

    @abstractmethod
    def use(self, item: tuple[str, str] | Path, prompt_id: str | None = None) -> Path:
        """An input's path, recorded (the stage's ledger verifies it; a worker's is verified by the stage)."""

    def out(self, name: str, prompt_id: str | None = None) -> Path:
        return self.files.out(name, prompt_id)

    def write_json(self, name: str, obj: Any, prompt_id: str | None = None) -> Path:
        return self.files.write_json(name, obj, prompt_id)

    def write_parquet(self, name: str, table, facts: dict[str, Any] | None = None, prompt_id: str | None = None,
                      **kwargs) -> Path:
        """A Parquet file whose schema metadata carries the key facts of this run (in its
        prompt's partition when given one)."""
        return self.files.write_parquet(name, table, self.parquet_metadata(facts), prompt_id, **kwargs)

    def parquet_metadata(self, extra: dict[str, Any] | None = None) -> dict[bytes, bytes]:
        """Schema metadata for a Parquet file: this run's key facts under b"nexttoken"."""
        facts = {"stage": self.stage, "config_sha256": provenance.sha256_json(self.config)}
        if self.model:
            facts["model"] = provenance.model_record(self.model)
        facts = {**facts, **self.facts, **(extra or {})}
        return {PARQUET_META_KEY: provenance.canonical_json(facts).encode()}


class StageRun(Writer):
    """One run of one stage: its parts (staging folder, input ledger, prompt log), what the stage says about
    its run (seeds, model, facts, executor), and the commit (the manifest, then the swap into place)."""

    def __init__(self, stage: str, root: Path, config: dict[str, Any]):
        root = Path(root).resolve()
        self._started = time.time()
        super().__init__(stage, root, config, Staging.for_stage(stage, root))
        self.ledger = Ledger(root)
        self.prompts = PromptLog()
        self.seeds: dict[str, int] = {}
        self.executor: dict[str, Any] | None = None     # where the per-prompt work ran (`pipeline.executor`)
        # False: the manifest leaves out what only torch tells (threads, GPUs, determinism flags,
        # kernel path). Also left out where the stage never imported torch (logits, probs,
        # report): it computed nothing with it, and importing torch only to describe it cost
        # ~2.3 s of each such stage's start (issue 16).
        self.with_torch = True

    def use(self, item: tuple[str, str] | Path, prompt_id: str | None = None) -> Path:
        """Record an input, verified before it is read (`Ledger.use`)."""
        return self.ledger.use(item, prompt_id)

    def prompt_ids(self, item: tuple[str, str]) -> list[str]:
        """The prompts an input dataset holds a partition for (the set this stage loops over)."""
        return self.ledger.prompt_ids(item)

    @contextmanager
    def timed(self, prompt_id: str | None) -> Iterator[None]:
        """Time one prompt's work: the manifest's `prompt_seconds` (what each prompt of a set cost, the
        shared set-up such as a model load not counted). Facts the stage sets inside are that prompt's."""
        start, facts = time.perf_counter(), self.facts
        try:
            yield
        finally:
            own = self.facts if self.facts is not facts else None      # facts set inside: this prompt's
            self.prompts.add(prompt_id or "", time.perf_counter() - start, own)

    def prompt_done(self, prompt_id: str, seconds: float, facts: dict[str, Any] | None) -> None:
        """A prompt's work done elsewhere (a Ray worker): its seconds there and the facts it set, as
        `timed` records them for work done here."""
        if facts is not None:
            self.facts = facts
        self.prompts.add(prompt_id, seconds, facts)

    def commit(self) -> Path:
        """Write the manifest and move the finished folder into artifacts/<stage>/."""
        final = paths.stage_dir(self.stage, self.root)
        outputs = [provenance.file_record(p, self.staging) for p in self.files.files()]
        for o in outputs:
            o["path"] = rel(final / o["path"], self.root)
        manifest = {
            "format_version": provenance.FORMAT_VERSION,
            "stage": self.stage,
            "config": self.config,
            "config_sha256": provenance.sha256_json(self.config),
            "seeds": self.seeds,
            "model": self.model,
            **self.prompts.facts(self.facts),
            **({"executor": self.executor} if self.executor else {}),
            "inputs": self.ledger.inputs,
            "outputs": outputs,
            **provenance.environment(self.root, self.with_torch and "torch" in sys.modules),
            "command": sys.argv,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - self._started, 3),
            "prompt_seconds": self.prompts.seconds(),
        }
        self.write_json(paths.MANIFEST, manifest)
        self.files.swap_into(final)
        return final

    def discard(self) -> None:
        self.files.discard()


# ---------------------------------------------------------------- a report that is no longer current
# When a stage that feeds the report starts its work, the report in artifacts/report/ stops being the current
# run's. Its pages are replaced (a new file, then os.replace: DVC's cache may hard-link outputs, so nothing is
# edited in place) by copies that say so at their top. A run that completes re-runs the report stage (or DVC
# restores it from its run-cache: its outputs changed), and the clean report comes back; a run that fails, or
# is killed (even by the OOM killer, where no handler runs), leaves the line in place.
# Not marked by: validate (a refused config changes nothing; its success alone changes no stage's inputs), the
# report stage itself (DVC removes its outputs before it runs), or a stage body run outside its entry point
# (`nexttoken verify` re-runs stages in a scratch folder whose artifacts/report links to the real one).
UNMARKED = ("validate", "report")
STALE_MD = "> **Stale report:**"                       # report.md's first line, once marked
STALE_HTML_ID = "nexttoken-stale"                     # the explorer pages' banner element
_entry_stage: str | None = None                       # set by `stage_main`: this process is that stage's run


def _report_origin(root: Path) -> str:
    """Which run the report belongs to, from its manifest: git commit, params.yaml, when it was made."""
    try:
        m = json.loads(paths.manifest_path("report", root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "an earlier run (its manifest is unreadable)"
    git = m.get("git") or {}
    commit = f"git commit {git['commit'][:12]}{' (dirty)' if git.get('dirty') else ''}" if git.get("commit") \
        else "no git commit recorded"
    params = (m.get("facts") or {}).get("params_sha256")
    config = f"params.yaml sha256 {params[:12]}" if params else "params.yaml not recorded"
    return f"an earlier run ({commit}, {config}, made {m.get('created_at')})"


def stale_banner(origin: str, stage: str, started: str) -> str:
    """The line a stale report carries at its top."""
    return (f"this report belongs to {origin}. A later run started {started} in stage {stage} and has not "
            f"finished: its numbers are not shown here. `dvc repro` brings the report up to date.")


def _replace_text(path: Path, text: str) -> None:
    """path's content replaced by a new file (never edited in place: it may be a hard link into DVC's cache)."""
    tmp = path.with_name(f".{path.name}.stale-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _mark_html(page: Path, line: str) -> None:
    text = page.read_text(encoding="utf-8")
    if f'id="{STALE_HTML_ID}"' in text:
        return
    banner = (f'<div id="{STALE_HTML_ID}" role="alert" style="background:#b00020;color:#fff;padding:.6em 1em;'
              f'font:600 1.05rem/1.4 sans-serif">Stale report: {html.escape(line)}</div>')
    body = re.search(r"<body[^>]*>", text, flags=re.I)
    at = body.end() if body else 0
    _replace_text(page, text[:at] + banner + text[at:])


def mark_report_stale(stage: str, root: Path | str = ".", started: str | None = None) -> Path | None:
    """Mark artifacts/report/ as not the current run's: report.md and every explorer page get a first line
    naming the run they belong to and the stage whose run started since; the report.md marked, or None where
    there is no report. Already marked pages keep their first mark (the run they belong to is still that one).
    A page that cannot be read or rewritten is removed: a report must never look current when it is not."""
    folder = paths.stage_dir("report", root)
    report = folder / paths.REPORT[1]
    if not report.is_file():
        return None
    if stale_report_note(root):                # marked already, report.md last: every page is (the chain's
        return report                          # later stages read no 32 explorer pages again)
    started = started or datetime.now(UTC).isoformat(timespec="seconds")
    line = stale_banner(_report_origin(Path(root)), stage, started)
    pages = sorted(folder.glob("explorer*.html"))
    for page in [*pages, report]:              # report.md last: its mark says every page is marked
        try:
            if page == report:
                text = page.read_text(encoding="utf-8")
                if not text.startswith(STALE_MD):
                    _replace_text(page, f"{STALE_MD} {line}\n\n{text}")
            else:
                _mark_html(page, line)
        except (OSError, ValueError):
            page.unlink(missing_ok=True)
    return report if report.is_file() else None


def stale_report_note(root: Path | str = ".") -> str:
    """The end of a failing stage's one line: where the last good report is (marked stale); "" where there is
    no marked report."""
    report = paths.artifact(paths.REPORT, root)
    try:
        with open(report, encoding="utf-8") as f:
            marked = f.read(len(STALE_MD)) == STALE_MD
    except (OSError, ValueError):
        return ""
    if not marked:
        return ""
    rel = paths.artifact(paths.REPORT).as_posix()
    return f"; the last good report, of {_report_origin(Path(root))}, is {rel} (marked stale)"


@contextmanager
def stage_run(stage: str, config: dict[str, Any], root: Path | str = ".") -> Iterator[StageRun]:
    """Run a stage's body; commit its outputs on success, leave nothing on failure. Run from the stage's own
    entry point (`stage_main`), a stage that feeds the report first marks the report stale (above)."""
    run = StageRun(stage, Path(root), config)
    try:
        if stage == _entry_stage and stage not in UNMARKED:
            mark_report_stale(stage, root)
        yield run
        run.commit()
    finally:
        run.discard()


def entry(stage: str, work: Callable[[graph.StageConfig | None], None]) -> Callable[[], None]:
    """A stage's `main()`: its validated config read (artifacts/validate/<stage>.json: the one file of the
    config a stage reads; none for validate, which reads params.yaml, and logits, which reads no params),
    the CPU kernels pinned before anything imports torch where the stage declared `capture.kernels`, then
    `work(config)`. Run by `stage_main` under `python -m stages.<name>`, or called as it is in one process
    (the tests' and the bench's chains)."""
    def main() -> None:
        cfg = graph.config(stage) if stage in graph.validated_stages() else None
        if cfg is not None and "kernels" in (cfg.recorded.get("capture") or {}):
            kernels.pin(cfg.section("capture").kernels)
        work(cfg)
    main.__doc__ = f"Stage {stage}: {work.__module__}'s work on its validated config."
    return main


def stage_main(stage: str, body: Callable[[], None]) -> None:
    """Entry point wrapper: a UserError is one line on stderr and exit status 2.

    Progress bars show on a terminal only: in CI logs and under DVC's captured output
    they would be thousands of carriage-return lines.
    """
    progress.quiet_off_terminal()
    # Ctrl-C is a KeyboardInterrupt again, so the staging folder is removed on the way out
    # (stages/__init__.py made it a quiet exit while the stage module was importing).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    global _entry_stage
    _entry_stage = stage              # its stage_run marks the report stale (a process that goes on: reset below)
    try:
        body()
    except UserError as e:
        print(f"nexttoken {stage}: error: {e}{_failed(stage)}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        _failed(stage)
        print(interrupted(stage), file=sys.stderr)
        sys.exit(130)
    except Exception:                 # a bug: its traceback follows
        _failed(stage)
        raise
    finally:
        _entry_stage = None


def _failed(stage: str) -> str:
    """A stage that feeds the report failed, maybe before its stage_run marked the report (under DVC its outputs
    are gone already): the report is marked now; the note for its line. A refused config changed nothing."""
    if stage in UNMARKED:
        return ""
    mark_report_stale(stage)
    return stale_report_note()
