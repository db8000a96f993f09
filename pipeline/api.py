"""The Python API for notebooks: `open_run(path_or_revision)` reads a recorded run as pandas / numpy / torch.

`from pipeline.api import open_run`. A run is a workspace folder (default: the current one) or a git
revision / experiment name of the workspace repository, read the way `nexttoken audit --rev` reads one
(`pipeline.tools.revisions.open_run`: git + the local DVC cache, nothing checked out). Every artifact
read is first checked against the sha256 that the stage which wrote it recorded in its manifest
(artifacts/<stage>/manifest.json), once per file; a file that differs raises one `ArtifactChanged`
naming it. `verify=False` skips the check. Every table with token ids carries their text beside each id
column, from the run's verified vocab.parquet: `piece` (the vocabulary's piece, byte-level for a byte-level
BPE: `éĹ®é¢ĺ`) and `piece_text` (that one token decoded: `问题`), so a notebook needs no join of its own.
Capture tensors are opened lazily with
`safetensors.safe_open` (memory-mapped: a tensor is read when it is asked for), as TransformerLens'
ActivationCache is indexed by name.
A run whose manifests record another `format_version` than this code's is refused in one line
when it is opened: read it with the nexttoken revision that made it.

The module lives at the top of the library (above `tools`): `pipeline/__init__.py` does not re-export
it, because the package root is the base layer every module imports (tests/unit/test_layout.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.store import paths, provenance
from pipeline.tools import revisions

__all__ = ["ArtifactChanged", "Capture", "Run", "open_run"]


class ArtifactChanged(UserError):
    """A file differs from what its producing stage recorded (or no manifest records it)."""


def open_run(where: str | Path = ".", *, repo: str | Path = ".", verify: bool = True) -> Run:
    """The run in folder `where` (a workspace: it has artifacts/), else the run at git revision or experiment
    `where` of the repository `repo`. Close it (or use `with`) to release a revision's temporary folder."""
    folder = Path(where)
    if (folder / paths.ARTIFACTS).is_dir():
        return Run(folder, verify=verify, label=str(folder))
    rev = revisions.resolve(Path(repo), str(where))
    stack = contextlib.ExitStack()
    try:
        root = stack.enter_context(revisions.open_run(Path(repo), rev))
    except BaseException:
        stack.close()
        raise
    return Run(root, verify=verify, label=str(rev), stack=stack)


class Capture:
    """One prompt's capture.safetensors, lazily: `names`, `cap[name]` -> torch tensor in its stored dtype."""

    def __init__(self, path: Path):
        from safetensors import safe_open
        self.path = path
        self._file = safe_open(str(path), framework="pt")

    @property
    def names(self) -> list[str]:
        return list(self._file.keys())

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(f"{name!r} is not in {self.path.name}: one of {', '.join(self.names[:8])}, ...")
        return self._file.get_tensor(name)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"Capture({self.path}, {len(self)} tensors)"


class Run:
    """A recorded run: its prompts, tokens, logits, probability tables, capture, trajectories, checks and
    manifests. `prompt_id` None means the run's only prompt (a set needs it named)."""

    def __init__(self, root: Path, *, verify: bool = True, label: str = "", stack=None):
        self.root, self.verify, self.label = Path(root).resolve(), verify, label or str(root)
        self._stack = stack or contextlib.ExitStack()
        self._checked: set[Path] = set()
        self._vocab = None
        self.manifests: dict[str, dict] = revisions.load_manifests(self.root)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Run({self.label}: {len(self.prompt_ids)} prompt(s), stages {', '.join(self.manifests)})"

    # ------------------------------------------------------------ reading, verified
    def path(self, item: tuple[str, str], prompt_id: str | None = None) -> Path:
        """The verified path of an artifact (paths.<ITEM>); a per-prompt one for prompt_id."""
        path = paths.lookup(self.root)(item, self._prompt(prompt_id) if item in paths.PER_PROMPT else None)
        if self.verify and path not in self._checked:
            self._check(path)
            self._checked.add(path)
        return path

    def _check(self, path: Path) -> None:
        rel = path.relative_to(self.root).as_posix()
        if not path.is_file():
            raise ArtifactChanged(f"{rel} is missing from {self.label}: run `dvc repro` to make it")
        for stage, manifest in self.manifests.items():
            record = next((o for o in manifest["outputs"] if o.get("path") == rel), None)
            if record is not None:
                got = provenance.sha256_file(path)
                if got != record["sha256"]:
                    raise ArtifactChanged(f"{rel} has sha256 {got[:12]}, not the {record['sha256'][:12]} that "
                                          f"artifacts/{stage}/manifest.json records: the file changed after the "
                                          f"stage wrote it (re-run `dvc repro`, or read it anyway with verify=False)")
                return
        raise ArtifactChanged(f"{rel} is recorded by no stage manifest of {self.label}: not this run's output "
                              f"(read it anyway with verify=False)")

    def _prompt(self, prompt_id: str | None) -> str:
        ids = self.prompt_ids
        if prompt_id is None:
            if len(ids) != 1:
                raise UserError(f"this run holds {len(ids)} prompts: name one, prompt_id= one of {', '.join(ids)}")
            return ids[0]
        if prompt_id not in ids:
            raise UserError(f"prompt_id={prompt_id!r} is not in this run: one of {', '.join(map(str, ids))}")
        return prompt_id

    def _parquet(self, item: tuple[str, str], prompt_id: str | None = None, **kw):
        import pyarrow.parquet as pq
        return pq.read_table(self.path(item, prompt_id), **kw).to_pandas()

    def _with_text(self, df, column: str = "token_id"):
        """df with, right after its id column `column` (`token_id`, or `<x>_id`), the vocabulary's `piece`
        and `piece_text` (`<x>_piece`, `<x>_piece_text`) of each id, from vocab.parquet (read and verified
        once per Run); a column the table already has is kept as it is. An id past the tokenizer (an output
        size larger than the vocabulary) has none: missing, as a null string of the table's own columns."""
        import numpy as np
        if self._vocab is None:      # sorted by id: an id's row is found by binary search, whatever the file's order
            vocab = self._parquet(paths.VOCAB, columns=["token_id", "piece", "text"]).sort_values("token_id")
            self._vocab = (vocab["token_id"].to_numpy(), vocab["piece"].reset_index(drop=True),
                           vocab["text"].reset_index(drop=True))
        ids, pieces, texts = self._vocab
        want = df[column].to_numpy()
        found = np.clip(np.searchsorted(ids, want), 0, len(ids) - 1)
        known = ids[found] == want
        stem = "" if column == "token_id" else column.removesuffix("_id") + "_"
        place = df.columns.get_loc(column) + 1
        for name, values in ((f"{stem}piece", pieces), (f"{stem}piece_text", texts)):
            if name not in df.columns:     # the vocabulary's column taken row by row: its dtype, its missing value
                df.insert(place, name, values.take(found).set_axis(df.index).where(known))
            place = df.columns.get_loc(name) + 1
        return df

    def _json(self, item: tuple[str, str], prompt_id: str | None = None) -> Any:
        return json.loads(self.path(item, prompt_id).read_text(encoding="utf-8"))

    # ------------------------------------------------------------ the artifacts
    @property
    def prompt_ids(self) -> list[str]:
        return paths.run_prompt_ids(self.root)

    @property
    def prompts(self):
        """One row per prompt: prompt_id, name, text, n_tokens, token_ids (pandas)."""
        import pandas as pd
        rows = []
        for pid in self.prompt_ids:
            t = self._json(paths.TOKENIZE_SUMMARY, pid)
            rows.append({"prompt_id": pid, "name": t.get("prompt_name"), "text": t["prompt"],
                         "n_tokens": t["n_tokens"], "token_ids": t["token_ids"]})
        return pd.DataFrame(rows, columns=["prompt_id", "name", "text", "n_tokens", "token_ids"])

    def tokens(self, prompt_id: str | None = None):
        """tokens.parquet: position, token_id, piece, piece_text (the token decoded alone, from vocab.parquet),
        piece_bytes_hex, text, decodes_alone, is_special (pandas)."""
        return self._with_text(self._parquet(paths.TOKENS, prompt_id))

    def logits(self, prompt_id: str | None = None, position: int | None = None):
        """float32 logits from logits.parquet (numpy): [T, V] for every recorded position, [V] for one."""
        from pipeline.store import logits_io
        path = self.path(paths.LOGITS, prompt_id)
        if position is not None:
            return logits_io.read_position(path, position)
        return logits_io.read_matrix(path)[1]

    def probs(self, prompt_id: str | None = None):
        """table.parquet: the FP64 probability table per temperature, with ranks (pandas). A set's run
        (`probs.table=derived`) stores no table.parquet: it is re-derived here, bit for bit, from the
        verified logits.parquet and summary.json by the probs stage's own function (`probs.read_table`)."""
        from pipeline.store.artifacts import tables_stored
        manifest = self.manifest("probs")
        if tables_stored(manifest):
            return self._with_text(self._parquet(paths.TABLE, prompt_id))
        from pipeline.numerics import probs
        return self._with_text(probs.read_table(self.path, self._prompt(prompt_id), manifest).to_pandas())

    def step_logits(self, prompt_id: str | None = None) -> dict:
        """step_logits.parquet: (branch, kv_cache, step) -> that step's full float32 logits row (numpy),
        XOR-decoded and widened exactly (`logits_io.read_step_logits`). A prompt whose rows the run did not store
        (`sampling.step_logits`: a large set stores a fixed sample's) has them re-derived here, by the stage's own
        decoding on the run's model (loaded once per Run), and proven bit for bit against the sha256 of every row
        in trajectories.json (`trajectories.step_rows`; refused in one line otherwise)."""
        from pipeline.model import trajectories
        rows = trajectories.step_rows(self._find, self.root, self._prompt(prompt_id), self._model)
        return {(k["branch"], k["kv_cache"], k["step"]): row for k, _, row in rows}

    def _find(self, item, prompt_id: str | None = None) -> Path:
        return self.path(item, prompt_id) if isinstance(item, tuple) else paths.locate(item, self.root)

    def _model(self):
        """The run's model as its trajectories stage loaded it (`trajectories.recorded_model`), loaded once."""
        if not hasattr(self, "_loaded"):
            from pipeline.model import trajectories
            self._loaded = trajectories.recorded_model(self._find, self.root)
        return self._loaded

    def filtered(self, prompt_id: str | None = None):
        """filtered.parquet: the top-k / top-p kept sets, before and after renormalising (pandas); a set's
        (`probs.table=derived`) re-derived as `probs` is."""
        from pipeline.store.artifacts import tables_stored
        manifest = self.manifest("probs")
        if tables_stored(manifest):
            return self._with_text(self._parquet(paths.FILTERED, prompt_id))
        from pipeline.numerics import probs
        return self._with_text(probs.read_table(self.path, self._prompt(prompt_id), manifest, paths.FILTERED)
                               .to_pandas())

    def capture(self, prompt_id: str | None = None) -> Capture:
        """capture.safetensors, lazy and memory-mapped: `run.capture()["blocks.0.resid_post"]` (torch)."""
        return Capture(self.path(paths.CAPTURE, prompt_id))

    def trajectories(self, prompt_id: str | None = None):
        """steps.parquet: one row per branch, cache mode and step, with piece_text beside its piece (pandas)."""
        return self._with_text(self._parquet(paths.STEPS, prompt_id))

    def lens(self, prompt_id: str | None = None):
        """lens.parquet: the logit lens's top-k ids per layer and position, FP64 probabilities, each id's piece
        and piece_text (pandas)."""
        return self._with_text(self._parquet(paths.LENS, prompt_id))

    def lens_summary(self, prompt_id: str | None = None):
        """lens_summary.parquet: per layer and position, entropy, the final top-1 (its id, final_top1_piece,
        final_top1_piece_text), its rank and prob, KL (pandas)."""
        return self._with_text(self._parquet(paths.LENS_SUMMARY, prompt_id), "final_top1_id")

    @property
    def checks(self):
        """checks.parquet: one row per checked prompt and check (pandas; a large set's prompts outside the
        `checks.prompts` sample have none)."""
        return self._parquet(paths.CHECKS)

    def metrics(self, stage: str) -> dict:
        """A stage's metrics.json (probs, trajectories or checks)."""
        return self._json((stage, "metrics.json"))

    def manifest(self, stage: str) -> dict:
        if stage not in self.manifests:
            raise UserError(f"stage {stage!r} has no manifest in this run: one of {', '.join(self.manifests)}")
        return self.manifests[stage]
