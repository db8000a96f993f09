"""A stage's output folder while it is written, and its swap into place.

A stage builds its whole output folder in a staging folder outside `artifacts/`
(`.nexttoken/staging/<stage>-<pid>`), writes `manifest.json` last, then moves the folder into
`artifacts/<stage>/` with a rename. An interrupted or failed stage therefore leaves no partial file
under `artifacts/`: either the old folder, none, or the complete new one. A Ray worker writes into
a private `Staging` of its own, whose bytes the stage `put`s into its staging folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from pipeline.store import paths

# Files in a stage folder that are not the stage's outputs but git's record of them: DVC
# writes a .gitignore there for a stage whose outs are files (probs, trajectories, checks).
# The swap keeps them, or a failed run under DVC would leave the folder's files untracked.
KEPT_ON_SWAP = (".gitignore",)


class Staging:
    """A folder of files being written: paths in it, JSON and Parquet written into it, its files read
    back, and (a stage's) the swap into `artifacts/<stage>/`."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    @classmethod
    def for_stage(cls, stage: str, root: Path) -> Staging:
        """This process's staging folder for `stage`, new and empty (ones left by killed runs removed)."""
        folder = root / paths.STAGING / f"{stage}-{os.getpid()}"
        _remove_stale_staging(folder.parent, stage)
        folder.mkdir(parents=True)
        return cls(folder)

    def out(self, name: str, prompt_id: str | None = None) -> Path:
        """A path in the folder, for writers that need a file name; with a prompt id, inside that
        prompt's partition (`paths.partition_rel`)."""
        p = self.folder / (name if prompt_id is None else paths.partition_rel(name, prompt_id))
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_json(self, name: str, obj: Any, prompt_id: str | None = None) -> Path:
        p = self.out(name, prompt_id)
        with open(p, "w", encoding="utf-8") as f:     # streamed: json.dumps(indent=...) holds every piece of the
            json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=False)   # text at once (a 10,000-prompt
            f.write("\n")                              # forward manifest: 49 MB of text, ~400 MB of pieces)
        return p

    def write_parquet(self, name: str, table, metadata: dict[bytes, bytes], prompt_id: str | None = None,
                      **kwargs) -> Path:
        """A Parquet file whose schema metadata is the table's own updated with `metadata`."""
        import pyarrow.parquet as pq
        meta = {**(table.schema.metadata or {}), **metadata}
        p = self.out(name, prompt_id)
        pq.write_table(table.replace_schema_metadata(meta), p, **kwargs)
        return p

    def files(self) -> list[Path]:
        """Every file in the folder, in path order."""
        return sorted(p for p in self.folder.rglob("*") if p.is_file())

    def read(self) -> dict[str, bytes]:
        """Every file's bytes by its path in the folder (a worker's result)."""
        return {p.relative_to(self.folder).as_posix(): p.read_bytes() for p in self.files()}

    def put(self, files: dict[str, bytes]) -> None:
        """Files (path in the folder -> bytes, as `read` gives them) written into the folder."""
        for rel, data in files.items():
            target = self.folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    def swap_into(self, final: Path) -> None:
        """Replace `final` by this folder with renames (same filesystem, no copy); the files of
        KEPT_ON_SWAP in `final` are copied over first (copied: until the rename, `final` is whole)."""
        final.parent.mkdir(parents=True, exist_ok=True)
        trash = self.folder.with_name(self.folder.name + ".old")
        if final.exists():
            for name in KEPT_ON_SWAP:
                if (final / name).is_file() and not (self.folder / name).exists():
                    shutil.copy2(final / name, self.folder / name)
            os.replace(final, trash)
        os.replace(self.folder, final)
        shutil.rmtree(trash, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


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
