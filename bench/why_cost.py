"""What "why" and "what if" cost (issue 47, item 5): the attribution stage beside the forward stage, and the
trajectories stage with its what-if branches beside the same stage without them, each a fresh interpreter as
DVC runs it, measured side by side in one run on one workspace.

    python -m bench.why_cost [--model gemma3_270m] [--repeat 2] [--out FILE.json]

One workspace (conf/ composed for --model, the configured prompt), prepare_model and tokenize run once; then,
--repeat times in turn: forward, attribution, trajectories with `sampling.what_if=0`, trajectories with the
configured what-if (each `python -m stages.<name>`: wall s, CPU s, its own peak RSS MB, `tests/helpers/
stage_peak.py`). Prints each figure's minimum and the two ratios attribution / forward and
trajectories (what-if) / trajectories (none). A config without `sampling.what_if` (older code) measures the
first pair only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from bench.chain_scale import OFFLINE, run_stage
from pipeline.store import paths
from tests.helpers import worktree


def _params(ws: Path, **changes) -> None:
    params = yaml.safe_load((ws / paths.PARAMS).read_text(encoding="utf-8"))
    for key, value in changes.items():
        section, name = key.split(".")
        params[section][name] = value
    (ws / paths.PARAMS).write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False), encoding="utf-8")


def measure(model: str, repeat: int, tmp: Path) -> dict:
    ws = tmp / "ws"
    ws.mkdir()
    shutil.copytree(worktree.ROOT / "conf", ws / "conf")
    worktree.sh(ws, sys.executable, "-m", "pipeline.tools.cli", "compose", f"model={model}", env=OFFLINE)
    for stage in ("prepare_model", "tokenize"):
        run_stage(ws, stage)
    configured = yaml.safe_load((ws / paths.PARAMS).read_text(encoding="utf-8"))["sampling"]
    what_if = configured.get("what_if")
    runs: dict[str, list[dict]] = {}
    for _ in range(repeat):
        for name, stage, changes in (("forward", "forward", {}), ("attribution", "attribution", {}),
                                     ("trajectories_no_what_if", "trajectories", {"sampling.what_if": 0}),
                                     ("trajectories_what_if", "trajectories", {"sampling.what_if": what_if})):
            if "sampling.what_if" in changes and what_if is None:
                continue
            if changes:
                _params(ws, **changes)
            runs.setdefault(name, []).append(run_stage(ws, stage))
            print(f"[why_cost] {model} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    best = {name: {k: min(r[k] for r in rs) for k in ("wall_s", "cpu_s", "peak_mb")} for name, rs in runs.items()}
    ratios = {"attribution / forward (wall)": best["attribution"]["wall_s"] / best["forward"]["wall_s"],
              "attribution / forward (peak)": best["attribution"]["peak_mb"] / best["forward"]["peak_mb"]}
    if "trajectories_what_if" in best:
        ratios["trajectories what_if / none (wall)"] = (best["trajectories_what_if"]["wall_s"]
                                                      / best["trajectories_no_what_if"]["wall_s"])
    return {"model": model, "what_if": what_if, "repeat": repeat, "runs": runs, "best": best, "ratios": ratios}


def text(result: dict) -> str:
    lines = [f"{result['model']} (what_if = {result['what_if']}), the least of {result['repeat']} runs each:",
             "| stage | wall s | CPU s | peak MB |", "|---|---|---|---|"]
    lines += [f"| {name} | {b['wall_s']:.2f} | {b['cpu_s']:.2f} | {b['peak_mb']} |"
              for name, b in result["best"].items()]
    lines += [f"{k}: {v:.2f}" for k, v in result["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.why_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3_270m")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: at least 1")
    with tempfile.TemporaryDirectory(prefix="why-cost-") as tmp:
        result = measure(args.model, args.repeat, Path(tmp))
    print(text(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
