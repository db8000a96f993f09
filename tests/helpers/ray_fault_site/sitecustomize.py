"""Test-only: a fault in a Ray worker's prompt, in any Python process that starts with this folder
on PYTHONPATH and NEXTTOKEN_TEST_RAY_FAULT=<plan file> in its environment (the raylets of the
tests' local cluster and the workers they start; a stage that starts its own local Ray). See
tests/helpers/ray_faults.py; the production code knows nothing of it.

The plan file (JSON, read at each prompt, so a test can change it while the cluster runs):
{"stage": S, "prompt": P, "mode": M, "marker": FILE}. When a worker is about to run prompt P of
stage S (`pipeline.executor.work.run_one`, which `pipeline.executor.cluster` calls):
- `kill-once`: the first time (no FILE yet) it writes its process id to FILE and SIGKILLs itself;
- `kill-always`: every time, appending its id to FILE;
- `pause`: it writes its id to FILE and sleeps (10 minutes), so a test can interrupt the stage.
"""

import os

_PLAN = os.environ.get("NEXTTOKEN_TEST_RAY_FAULT")


def _fault(stage, prompt_id):
    import json
    import signal
    import time
    from pathlib import Path
    try:
        plan = json.loads(Path(_PLAN).read_text())
    except (OSError, ValueError):
        return
    if plan.get("stage") != stage or plan.get("prompt") != prompt_id:
        return
    marker, mode = Path(plan["marker"]), plan.get("mode")
    if mode == "kill-once" and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "kill-always":
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "pause":
        marker.write_text(str(os.getpid()))
        time.sleep(600)


def _wrap(module):
    real = module.run_one

    def run_one(work, root, config, model, prompt_id):
        _fault(work.stage, prompt_id)
        return real(work, root, config, model, prompt_id)

    module.run_one = run_one


if _PLAN:
    import importlib.abc
    import importlib.util
    import sys

    class _Finder(importlib.abc.MetaPathFinder):
        """Wraps run_one as pipeline.executor.work finishes loading (before cluster imports the name)."""

        def find_spec(self, name, path, target=None):
            if name != "pipeline.executor.work":
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module):
                exec_module(module)
                _wrap(module)

            spec.loader.exec_module = exec_and_wrap
            return spec

    sys.meta_path.insert(0, _Finder())
