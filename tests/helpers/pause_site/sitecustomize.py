"""Test-only: pause a writer halfway through an artifact, in any Python process that starts
with this folder on PYTHONPATH and NEXTTOKEN_TEST_PAUSE=<point> in its environment (a stage
run directly, or by `dvc repro`). See tests/helpers/pause.py; the production code knows
nothing of it.

Points: `forward.capture` (capture.safetensors: its tensors streamed by safetensors, its header
not yet rewritten in canonical order, i.e. the first write of the `r+b` pass);
`logits.rows` (logits.parquet after its first row group); `import.torch` (the stage module's
imports, when torch is about to be imported). At the point, the process writes
its id to `.nexttoken/test-pause-<point>` in its working directory (or in NEXTTOKEN_TEST_PAUSE_DIR)
and sleeps (10 minutes).
"""

import os

_POINT = os.environ.get("NEXTTOKEN_TEST_PAUSE")


def _pause(point):
    import time
    from pathlib import Path
    marker = Path(os.environ.get("NEXTTOKEN_TEST_PAUSE_DIR", ".")) / ".nexttoken" / f"test-pause-{point}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(os.getpid()))
    time.sleep(600)


def _pause_capture():
    import builtins
    from pathlib import Path
    real_open = builtins.open

    class Writer:
        """A file whose write number `at` pauses first."""

        def __init__(self, f, at):
            self._f, self._writes, self._at = f, 0, at

        def write(self, data):
            self._writes += 1
            if self._writes == self._at:
                self._f.flush()
                _pause("forward.capture")
            return self._f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __getattr__(self, attr):
            return getattr(self._f, attr)

    def pausing_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        named = isinstance(file, (str, os.PathLike)) and Path(file).name == "capture.safetensors"
        if named and "+" in mode:       # the header rewrite after safetensors wrote the file
            return Writer(f, 1)
        return Writer(f, 2) if named and "w" in mode else f

    builtins.open = pausing_open


def _pause_logits():
    from pathlib import Path

    import pyarrow.parquet as pq
    original = pq.ParquetWriter.write_table

    def write_table(self, table, *args, **kwargs):
        original(self, table, *args, **kwargs)
        if Path(str(self.where)).name == "logits.parquet":
            _pause("logits.rows")

    pq.ParquetWriter.write_table = write_table


def _pause_import():
    import sys

    class PauseAtTorch:
        """A finder that finds nothing: it only pauses the first time torch is looked for."""

        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                _pause("import.torch")
            return None

    sys.meta_path.insert(0, PauseAtTorch())


if _POINT == "forward.capture":
    _pause_capture()
elif _POINT == "logits.rows":
    _pause_logits()
elif _POINT == "import.torch":
    _pause_import()
