"""Writing a stage's artifacts atomically, with its manifest, and reading them back safely.

A stage builds its whole output folder in a staging folder outside `artifacts/`
(`.nexttoken/staging/`), writes `manifest.json` last, then moves the folder into
`artifacts/<stage>/` with a rename. An interrupted or failed stage therefore leaves no
partial file under `artifacts/`: either the old folder, none, or the complete new one.
Every input is checked against the manifests before it is read: the file its stage
recorded, the file the other inputs were made from, and made with params.yaml's config and
the repository files as they are now (else it is stale, and named so).
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline import kernels, progress
from pipeline.config import registry
from pipeline.errors import EXIT_USER_ERROR, UserError, interrupted
from pipeline.store import graph, paths, provenance

PARQUET_META_KEY = b"nexttoken"
# Files in a stage folder that are not the stage's outputs but git's record of them: DVC
# writes a .gitignore there for a stage whose outs are files (probs, trajectories, checks).
# The swap keeps them, or a failed run under DVC would leave the folder's files untracked.
KEPT_ON_SWAP = (".gitignore",)
HASH_INPUTS_ENV = "NEXTTOKEN_HASH_INPUTS"   # set: every stage input is hashed in full, none trusted


class Writer:
    """What a stage's per-prompt work writes through: files under `out()`'s folder, Parquet files whose
    schema metadata carries the run's key facts. `StageRun` writes into its staging folder;
    `pipeline.executor`'s worker context into a private folder whose bytes the stage writes after it.
    The bytes depend only on the stage, its config, the model record and the facts, never on where
    the work ran (a set gives the same bytes under either executor)."""

    stage: str
    config: dict[str, Any]
    model: dict[str, Any] | None
    facts: dict[str, Any]
    staging: Path

    def out(self, name: str, prompt_id: str | None = None) -> Path:
        """A path in the staging folder, for writers that need a file name; with a prompt id,
        inside that prompt's partition (`paths.partition_rel`)."""
        p = self.staging / (name if prompt_id is None else paths.partition_rel(name, prompt_id))
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_json(self, name: str, obj: Any, prompt_id: str | None = None) -> Path:
        p = self.out(name, prompt_id)
        with open(p, "w", encoding="utf-8") as f:     # streamed: json.dumps(indent=...) holds every piece of the
            json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=False)   # text at once (a 10,000-prompt
            f.write("\n")                              # forward manifest: 49 MB of text, ~400 MB of pieces)
        return p

    def write_parquet(self, name: str, table, facts: dict[str, Any] | None = None, prompt_id: str | None = None,
                      **kwargs) -> Path:
        """A Parquet file whose schema metadata carries the key facts of this run (in its
        prompt's partition when given one)."""
        import pyarrow.parquet as pq
        meta = {**(table.schema.metadata or {}), **self.parquet_metadata(facts)}
        p = self.out(name, prompt_id)
        pq.write_table(table.replace_schema_metadata(meta), p, **kwargs)
        return p

    def parquet_metadata(self, extra: dict[str, Any] | None = None) -> dict[bytes, bytes]:
        """Schema metadata for a Parquet file: this run's key facts under b"nexttoken"."""
        facts = {"stage": self.stage, "config_sha256": provenance.sha256_json(self.config)}
        if self.model:
            facts["model"] = provenance.model_record(self.model)
        facts = {**facts, **self.facts, **(extra or {})}
        return {PARQUET_META_KEY: provenance.canonical_json(facts).encode()}


class StageRun(Writer):
    """One run of one stage: records inputs, collects outputs, writes the manifest."""

    def __init__(self, stage: str, root: Path, config: dict[str, Any]):
        self.stage = stage
        self.root = Path(root).resolve()
        self.config = config
        # False: the manifest leaves out what only torch tells (threads, GPUs, determinism flags,
        # kernel path). Also left out where the stage never imported torch (logits, probs,
        # report): it computed nothing with it, and importing torch only to describe it cost
        # ~2.3 s of each such stage's start (issue 16).
        self.with_torch = True
        self.seeds: dict[str, int] = {}
        self.model: dict[str, Any] | None = None
        self.facts: dict[str, Any] = {}
        self._inputs: list[dict[str, Any]] = []
        self._listed: dict[str, str] = {}                         # path -> sha256 of each input listed
        self._recorded: dict[str, tuple[str, str | None]] = {}   # path -> (sha256, stage recording it)
        self._manifests: dict[str, dict | None] = {}
        self._outputs: dict[str, dict[str, dict]] = {}            # stage -> its manifest's outputs by path
        self._verified: set[str] = set()                          # stages whose manifest's inputs were checked
        self._prompt_seconds: dict[str, float] = {}
        self._prompt_facts: dict[str, str] = {}           # prompt -> its facts as compact JSON text (`_keep_facts`)
        self.executor: dict[str, Any] | None = None     # where the per-prompt work ran (`pipeline.executor`)
        self._started = time.time()
        self.staging = self.root / paths.STAGING / f"{stage}-{os.getpid()}"
        _remove_stale_staging(self.staging.parent, stage)
        self.staging.mkdir(parents=True)

    # ------------------------------------------------------------ inputs
    def use(self, item: tuple[str, str] | Path, prompt_id: str | None = None) -> Path:
        """Record an input (an artifact item, a per-prompt one with its prompt id, or a path).

        A folder records every file its stage produced (not its manifest, which is the
        record of those files, not one of them). See `_input_record` for what is read.
        """
        path = paths.locate(item, self.root, prompt_id)
        if not path.exists():
            raise UserError(f"input {_rel(path, self.root)} is missing: run the stage that makes it "
                            f"(`dvc repro`)")
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != paths.MANIFEST) \
            if path.is_dir() else [path]
        for f in files:
            record = self._input_record(f)
            self._verify(record)
            if self._listed.get(record["path"]) != record["sha256"]:     # read twice (a set-level file): once
                self._inputs.append(record)
                self._listed[record["path"]] = record["sha256"]
        return path

    def prompt_ids(self, item: tuple[str, str]) -> list[str]:
        """The prompts an input dataset holds a partition for (the set this stage loops over)."""
        ids = paths.prompt_ids(item, self.root)
        if not ids:
            raise UserError(f"input {_rel(paths.dataset(item, self.root), self.root)} holds no prompt partition: "
                            f"run the stage that makes it (`dvc repro`)")
        return ids

    def _input_record(self, f: Path) -> dict[str, Any]:
        """path, size and sha256 of an input, read cheaply where that is safe.

        A file its producing stage recorded, still of the recorded size and modification time
        (ns), is that file: its recorded sha256 and logical hash are taken over without
        reading it again (DVC trusts its own outputs the same way). Anything else (another
        size or time, a copy DVC checked out, no record, or NEXTTOKEN_HASH_INPUTS=1) is
        hashed in full and then checked against the record (`_verify`). Nothing is parsed
        here: a file that is unreadable yet unrecorded is named by the reader that opens it.
        """
        rel, st = _rel(f, self.root), f.stat()
        made = self._producer_record(rel) or {}
        trusted = not os.environ.get(HASH_INPUTS_ENV) and made.get("sha256") and \
            made.get("bytes") == st.st_size and made.get("mtime_ns") == st.st_mtime_ns
        record = {"path": rel, "bytes": st.st_size,
                  "sha256": made["sha256"] if trusted else provenance.sha256_file(f)}
        if record["sha256"] == made.get("sha256") and "logical_sha256" in made:
            record["logical_sha256"] = made["logical_sha256"]
        return record

    def _producer_record(self, rel: str) -> dict[str, Any] | None:
        """The output record of `rel` in its producing stage's manifest (None: no such record)."""
        parts = Path(rel).parts
        if len(parts) < 3 or parts[0] != paths.ARTIFACTS or parts[1] not in paths.STAGES:
            return None
        self._manifest(parts[1])
        return self._outputs[parts[1]].get(rel)

    def _manifest(self, stage: str) -> dict | None:
        """A stage's manifest, read once (with its outputs indexed by path: a set's manifest lists every
        partition, and each prompt's inputs are looked up in it). It is the process's one parsed copy
        (`read_manifest_once`), the one the checks and the report read too: a manifest parses to about
        twice its JSON size in Python objects (forward's at 1,000 prompts: 1.15 MB, 2.4 MB parsed), the
        manifests a late stage reads at 10,000 prompts hold some 60 MB of JSON, and the report and the
        checks each held two copies."""
        if stage not in self._manifests:
            exists = paths.manifest_path(stage, self.root).exists()
            manifest = self._manifests[stage] = read_manifest_once(stage, self.root) if exists else None
            index = self._outputs[stage] = {}
            for o in (manifest or {}).get("outputs") or []:
                index.setdefault(o.get("path"), o)
        return self._manifests[stage]

    def _verify(self, record: dict[str, Any]) -> None:
        """Refuse an input that is not what its stage recorded, or not what other inputs were made from.

        (1) The producing stage's manifest, when there is one and it lists the file, records
        this sha256. (2) Every manifest read so far that lists this file among its inputs
        recorded this sha256 too (e.g. a capture made from other tokens than the
        tokens.parquet beside it).
        """
        rel, sha = record["path"], record["sha256"]
        self._agree(rel, sha, None)
        parts = Path(rel).parts
        if len(parts) < 3 or parts[0] != paths.ARTIFACTS or parts[1] not in paths.STAGES:
            return
        stage = parts[1]
        manifest = self._manifest(stage)
        if manifest is None:
            return
        made = self._producer_record(rel)
        if made is not None and made.get("sha256") != sha:
            raise UserError(f"{rel} was not produced by the recorded run of stage {stage} "
                            f"(sha256 {sha[:12]} != manifest {str(made.get('sha256'))[:12]}): re-run `dvc repro`")
        if made is None and any(p.startswith(paths.PARTITION_KEY + "=") for p in parts):
            # a stray partition would join every query over the dataset: only the recorded ones count
            raise UserError(f"{rel} is not a partition the recorded run of stage {stage} wrote: "
                            f"remove it or re-run `dvc repro`")
        if stage in self._verified:       # what the manifest records holds for all its files: checked once
            return
        for i in manifest.get("inputs") or []:
            self._agree(i.get("path"), i.get("sha256"), stage)
        self._fresh(rel, stage, manifest)
        self._verified.add(stage)

    def _fresh(self, rel: str, stage: str, manifest: dict) -> None:
        """Refuse an input whose stage ran with another config than the one validate wrote for it now
        (artifacts/validate/<stage>.json, from params.yaml), or read a repository file (a prompt file)
        that has changed since: its numbers belong to another run, and the checks would blame them
        instead of naming what is stale."""
        now = self._validated(stage)
        if now is not None:
            recorded = manifest.get("config") or {}
            for key in registry.diff_keys(recorded, now)[:1]:
                was, has = registry.dotted(recorded, key), registry.dotted(now, key)
                raise UserError(f"{rel} is stale: stage {stage} ran with {key}={was!r}, params.yaml has {has!r}: "
                                f"re-run {stage} and the stages after it (`dvc repro`)")
        for i in manifest.get("inputs") or []:
            path = str(i.get("path"))
            if path.startswith(paths.ARTIFACTS + "/"):
                continue
            if Path(path).is_absolute() or ".." in Path(path).parts:   # a tampered record: read nothing
                raise UserError(f"{paths.manifest_path(stage).as_posix()} records an input outside the "
                                f"repository ({path}): re-run `dvc repro`")
            file = self.root / path
            now_sha = provenance.sha256_file(file) if file.is_file() else "missing"
            if now_sha != i.get("sha256"):
                raise UserError(f"{rel} is stale: {_changed_since(stage, path, str(i.get('sha256')), now_sha)}")

    def _validated(self, stage: str) -> dict | None:
        """The config validate wrote for `stage` from params.yaml as it is now, in the form a manifest records
        it (None where there is none: validate itself, logits, a folder without a validate run)."""
        if stage not in graph.validated_stages():
            return None
        try:
            return graph.recorded(stage, json.loads(paths.validated(stage, self.root).read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return None

    def _agree(self, rel: str, sha: str, made_from_by: str | None) -> None:
        """Note a sha256 for rel (on disk: made_from_by None; else recorded as an input of that stage)."""
        seen = self._recorded.setdefault(rel, (sha, made_from_by))
        if seen[0] != sha:
            disk, claim = ((sha, seen) if made_from_by is None else (seen[0], (sha, made_from_by)))
            if not rel.startswith(paths.ARTIFACTS + "/") and (made_from_by is None) != (seen[1] is None):
                # a repository file (a prompt file) edited after that stage read it: its outputs are stale
                stale = _changed_since(claim[1], rel, claim[0], disk)
                raise UserError(f"{paths.ARTIFACTS}/{claim[1]} is stale: {stale}")
            raise UserError(f"{rel} (sha256 {disk[:12]}) is not the file stage {claim[1]} was made from "
                            f"(its manifest records sha256 {claim[0][:12]}): the artifacts come from different "
                            f"runs; re-run `dvc repro`")

    # ------------------------------------------------------------ outputs
    @contextmanager
    def timed(self, prompt_id: str | None) -> Iterator[None]:
        """Time one prompt's work: the manifest's `prompt_seconds` (what each prompt of a set cost, the
        shared set-up such as a model load not counted). Facts the stage sets inside are that prompt's
        (`_set_facts` writes them to the manifest)."""
        start, facts = time.perf_counter(), self.facts
        try:
            yield
        finally:
            key = prompt_id or ""
            self._prompt_seconds[key] = self._prompt_seconds.get(key, 0.0) + time.perf_counter() - start
            if self.facts is not facts:
                self._keep_facts(key, self.facts)

    def prompt_done(self, prompt_id: str, seconds: float, facts: dict[str, Any] | None) -> None:
        """A prompt's work done elsewhere (a Ray worker): its seconds there and the facts it set, as
        `timed` records them for work done here."""
        self._prompt_seconds[prompt_id] = self._prompt_seconds.get(prompt_id, 0.0) + seconds
        if facts is not None:
            self.facts = facts
            self._keep_facts(prompt_id, facts)

    def _keep_facts(self, prompt_id: str, facts: dict[str, Any]) -> None:
        # As text, parsed again one prompt at a time when the manifest is written: 10,000 prompts' forward
        # facts are 44 MB as Python objects and 9 MB as text.
        self._prompt_facts[prompt_id] = json.dumps(facts, ensure_ascii=False, separators=(",", ":"))

    def _set_facts(self) -> dict[str, Any]:
        """The manifest's `facts` and, for a set whose prompts' facts differ, `prompt_facts`: `facts` holds
        what every prompt shares (a single prompt: all its facts), `prompt_facts` each prompt's own values
        of the others (otherwise the manifest would hold the last prompt's values as if they were the set's)."""
        per = self._prompt_facts
        if len(per) < 2:
            return {"facts": self.facts}
        texts = iter(per.values())
        shared = json.loads(next(texts))
        for text in texts:                      # one prompt's facts in memory at a time
            f = json.loads(text)
            shared = {k: v for k, v in shared.items() if k in f and f[k] == v}
        own = {pid: {k: v for k, v in json.loads(text).items() if k not in shared} for pid, text in per.items()}
        return {"facts": shared, **({"prompt_facts": own} if any(own.values()) else {})}

    # ------------------------------------------------------------ commit
    def commit(self) -> Path:
        """Write the manifest and move the finished folder into artifacts/<stage>/."""
        outputs = [provenance.file_record(p, self.staging) for p in sorted(self.staging.rglob("*"))
                   if p.is_file()]
        final = paths.stage_dir(self.stage, self.root)
        for o in outputs:
            o["path"] = _rel(final / o["path"], self.root)
        manifest = {
            "format_version": provenance.FORMAT_VERSION,
            "stage": self.stage,
            "config": self.config,
            "config_sha256": provenance.sha256_json(self.config),
            "seeds": self.seeds,
            "model": self.model,
            **self._set_facts(),
            **({"executor": self.executor} if self.executor else {}),
            "inputs": self._inputs,
            "outputs": outputs,
            **provenance.environment(self.root, self.with_torch and "torch" in sys.modules),
            "command": sys.argv,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - self._started, 3),
            "prompt_seconds": {pid: round(s, 3) for pid, s in self._prompt_seconds.items()},
        }
        self.write_json(paths.MANIFEST, manifest)
        _swap_into_place(self.staging, final)
        return final

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _remove_stale_staging(staging_root: Path, stage: str) -> None:
    """Remove this stage's staging folders left by runs that were killed (their process is gone)."""
    if not staging_root.is_dir():
        return
    pattern = re.compile(re.escape(stage) + r"-(\d+)(\.old)?")
    for d in staging_root.iterdir():
        m = pattern.fullmatch(d.name)
        if m and (int(m.group(1)) == os.getpid() or not _alive(int(m.group(1)))):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:        # exists, owned by someone else
        return True
    return True


def _swap_into_place(staging: Path, final: Path) -> None:
    """Replace `final` by `staging` with renames (same filesystem, no copy); the files of
    KEPT_ON_SWAP in `final` are copied over first (copied: until the rename, `final` is whole)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    trash = staging.with_name(staging.name + ".old")
    if final.exists():
        for name in KEPT_ON_SWAP:
            if (final / name).is_file() and not (staging / name).exists():
                shutil.copy2(final / name, staging / name)
        os.replace(final, trash)
    os.replace(staging, final)
    shutil.rmtree(trash, ignore_errors=True)


def _changed_since(stage: str, path: str, recorded: str, now: str) -> str:
    return (f"stage {stage} read {path} (sha256 {recorded[:12]}), which has changed since (now {now[:12]}): "
            f"re-run {stage} and the stages after it (`dvc repro`)")


def _rel(path: Path, root: Path) -> str:
    return Path(os.path.relpath(path, root)).as_posix()


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


# ---------------------------------------------------------------- readers
def read_parquet(path: Path, columns: list[str] | None = None, filters=None):
    """A Parquet artifact as an Arrow table; a clear error naming a missing or corrupt file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        return pq.read_table(path, columns=columns, filters=filters)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path} is not a readable Parquet file (truncated or corrupt?): "
                        f"{str(e).splitlines()[0]}") from None


def read_dataset(item: tuple[str, str], root: Path | str = ".", columns: list[str] | None = None, filter=None):
    """Every prompt's partition of a per-prompt Parquet file as one Arrow table, with a
    `prompt_id` column (string) taken from the Hive path; `filter` (a pyarrow expression, e.g.
    `pc.field("prompt_id") == "q"`) is pushed down to the partitions, so others are not read."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    folder = paths.dataset(item, root)
    if not paths.prompt_ids(item, root):
        raise UserError(f"{folder} holds no partition: run `dvc repro` to make it")
    hive = ds.partitioning(pa.schema([(paths.PARTITION_KEY, pa.string())]), flavor="hive")
    try:
        return ds.dataset(folder, format="parquet", partitioning=hive).to_table(columns=columns, filter=filter)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{folder} is not a readable Parquet dataset (truncated or corrupt?): "
                        f"{str(e).splitlines()[0]}") from None


def parquet_facts(path: Path) -> dict[str, Any]:
    """The facts a stage stored in a Parquet file's schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        meta = pq.read_schema(path).metadata or {}
        return json.loads(meta.get(PARQUET_META_KEY, b"{}"))
    except (pa.ArrowInvalid, OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a readable Parquet file (truncated or corrupt?): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def read_json(path: Path) -> Any:
    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON (corrupt?): {e}") from None


def read_safetensors(path: Path) -> dict:
    """All tensors of a safetensors artifact (no pickle); a clear error when corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not Path(path).exists():
        raise UserError(f"{path} is missing: run `dvc repro` to make it")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def tables_stored(probs_manifest: dict[str, Any]) -> bool:
    """Whether the probs stage of this manifest wrote table.parquet and filtered.parquet (`facts.table`:
    `probs.table` resolved), or readers re-derive them from logits.parquet (`probs.read_table`)."""
    return (probs_manifest.get("facts") or {}).get("table", "stored") != "derived"


def read_manifest(stage: str, root: Path | str = ".") -> dict[str, Any]:
    """A stage's manifest.json, refused in one line unless it is a manifest of this code's format
    (`provenance.FORMAT_VERSION`): every reader of a run's files reads it through here first."""
    return check_format(read_json(paths.manifest_path(stage, root)), paths.manifest_path(stage).as_posix())


def read_once(reader: Callable[..., Any] | None = None, *, maxsize: int = 8) -> Callable[..., Any]:
    """`reader(path, *args)` remembered per process by the file's path, modification time (ns) and size, and
    args (the last `maxsize`): what a stage reads for every prompt of a set but that is one file for the whole
    set (a manifest listing every partition, a 152k-id vocabulary or tokenizer.json), read once and again only
    when the file changes. The result is shared: callers only read it. `@read_once` or `@read_once(maxsize=N)`."""
    if reader is None:
        return functools.partial(read_once, maxsize=maxsize)

    @functools.lru_cache(maxsize=maxsize)
    def cached(path: str, mtime_ns: int, size: int, *args: Any) -> Any:
        return reader(Path(path), *args)

    @functools.wraps(reader)
    def wrapper(path: Path | str, *args: Any) -> Any:
        try:
            st = Path(path).stat()
        except FileNotFoundError:              # the reader names what is missing, in its own words
            return reader(Path(path), *args)
        return cached(str(path), st.st_mtime_ns, st.st_size, *args)
    return wrapper


@read_once(maxsize=len(paths.STAGES))      # every stage's manifest at once (the report reads them all)
def _manifest_file(path: Path, stage: str) -> dict[str, Any]:
    return check_format(read_json(path), paths.manifest_path(stage).as_posix())


def read_manifest_once(stage: str, root: Path | str = ".") -> dict[str, Any]:
    """`read_manifest`, read once per process and version of the file (`read_once`). Shared: read only."""
    return _manifest_file(paths.manifest_path(stage, root), stage)


def device_where(record: dict) -> str:
    """Where a recorded computation ran ({"device", "gpu_name"}), as the checks and the refusals name it: the
    device type (`cpu`), or for CUDA the type and GPU model (`cuda (NVIDIA H200)`)."""
    kind = str(record.get("device") or "cpu").split(":")[0]
    if kind != "cuda":
        return kind
    return f"{kind} ({record.get('gpu_name') or 'GPU model not recorded'})"


def recorded_cpu_kernels(root: Path | str, stage: str, prompt_id: str) -> str | None:
    """The CPU kernels a stage computed `prompt_id` with (`kernels.cpu_key`): the prompt's own record where the
    stage ran on Ray (a cluster may mix CPUs), else the stage process's kernel path; None when not recorded."""
    if not paths.manifest_path(stage, root).exists():
        return None
    manifest = read_manifest_once(stage, root)
    prompt = ((manifest.get("executor") or {}).get("prompts") or {}).get(prompt_id)
    return kernels.cpu_key(prompt) if prompt else kernels.cpu_key(manifest.get("kernels"))


def check_format(manifest: Any, where: str) -> dict[str, Any]:
    """`manifest` (read from `where`) when it is a stage manifest of this code's format, else one line:
    a run made by code of another format is read by checking out that code, not by special cases here."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("outputs"), list):
        raise UserError(f"{where} is not a stage manifest (no `outputs` list; corrupt?): re-run `dvc repro`")
    if manifest.get("format_version") != provenance.FORMAT_VERSION:
        raise UserError(provenance.format_refusal(where, manifest.get("format_version"),
                                                  (manifest.get("git") or {}).get("commit")))
    return manifest
