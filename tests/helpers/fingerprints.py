"""Cross-machine fingerprints (pipeline/reference/fingerprints.yaml): computed here and compared.

An entry is a model and dtype run on the reference prompt with `capture.kernels=portable`
through the real stages (prepare_model, tokenize, forward, logits, trajectories) in a
temporary workspace: the logits content sha256 (`logits_content_sha256` of logits.parquet,
the raw bytes of the captured logits), the sha256 of the greedy and of the sampled token ids
(`trajectories.json`, full-prefix runs, `STEPS` of them: the article's 4, pinned whatever
conf/'s `sampling.max_new_tokens` is, so the committed numbers stand), and the kernel path of the machine that computed
them (the forward manifest's record). Any x86-64 machine with AVX2 + FMA must reproduce them
bit for bit; a machine whose kernels differ in native mode gives other bits.

`python -m tests.helpers.fingerprints [--write] [ENTRY ...]` computes the entries here and
prints them (with --write, rewrites the YAML: only after a deliberate change of the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from pipeline.store import paths, provenance
from tests.conftest import ON_CPU, REPO, make_workspace, run_module
from tests.helpers.partitions import part

FILE = REPO / "pipeline" / "reference" / "fingerprints.yaml"
ENTRIES = {"tiny_qwen2_bfloat16": ("tiny_qwen2", "bfloat16"),
           "tiny_qwen2_float32": ("tiny_qwen2", "float32"),
           "gemma3_270m_bfloat16": ("gemma3_270m", "bfloat16")}
STAGES = ("forward", "logits", "trajectories")
STEPS = 4                   # new tokens per trajectory the fingerprints hash: the article's table
COMPARED = ("logits_content_sha256", "greedy_ids_sha256", "sample_ids_sha256")
HEADER = """\
# Cross-machine fingerprints: capture.kernels=portable (ATen and oneDNN capped at AVX2, MKL CNR
# AVX2,STRICT, 2 threads), the reference prompt, the real stages. Any x86-64 machine with AVX2 +
# FMA must reproduce every sha256 below bit for bit (tests/integration/test_fingerprints.py);
# `kernel_path` is the record of the machine that made them. Regenerate only after a deliberate
# change of the numbers: python -m tests.helpers.fingerprints --write
"""


def prepared_workspace(dest: Path, model: str, prepared: Path | None = None) -> Path:
    """A workspace for `model` with its snapshot prepared (or linked from `prepared`) and the prompt tokenized."""
    ws = make_workspace(dest, [f"model={model}"])
    if prepared is not None:
        (ws / paths.ARTIFACTS).mkdir(exist_ok=True)
        paths.stage_dir("prepare_model", ws).symlink_to(prepared.resolve(), target_is_directory=True)
    else:
        run_module("stages.prepare_model", ws, check=True, timeout=1800)
    run_module("stages.tokenize", ws, check=True)
    return ws


def compute(base: Path, dest: Path, model: str, dtype: str, kernels: str = "portable",
            env: dict[str, str] | None = None) -> dict:
    """The fingerprint of `model` in `dtype`, computed in a copy of the prepared workspace `base`
    with `capture.kernels=kernels`, each stage in a fresh process with `env` added."""
    shutil.copytree(base / "conf", dest / "conf")
    shutil.copytree(paths.stage_dir("tokenize", base), paths.stage_dir("tokenize", dest))
    paths.stage_dir("prepare_model", dest).symlink_to(paths.stage_dir("prepare_model", base).resolve(),
                                                      target_is_directory=True)     # read only: never copied
    run_module("pipeline.tools.cli", dest, "compose", ON_CPU, f"model={model}", f"capture.dtype={dtype}",
               f"capture.kernels={kernels}", f"sampling.max_new_tokens={STEPS}",
               check=True)      # CPU kernels are what the fingerprints pin
    for stage in STAGES:
        run_module(f"stages.{stage}", dest, check=True, env=env, timeout=1800)
    return entry(dest, model, dtype)


def entry(ws: Path, model: str, dtype: str) -> dict:
    """The fingerprint fields of a workspace that ran forward, logits and trajectories."""
    logits = json.loads(paths.manifest_path("logits", ws).read_text())["facts"]["logits_content_sha256"]
    runs = json.loads(part(paths.TRAJECTORIES, ws).read_text())
    forward = json.loads(paths.manifest_path("forward", ws).read_text())
    out = {"model": model, "dtype": dtype, "logits_content_sha256": logits}
    for branch in ("greedy", "sample"):
        ids = runs[branch]["token_ids"]
        out[f"{branch}_token_ids"] = ids
        out[f"{branch}_ids_sha256"] = provenance.sha256_json(ids)
    out["made_on"] = {"cpu_model": forward["hardware"]["cpu_model"], "torch": forward["libraries"]["torch"],
                      "native_aten_cpu_capability": native_capability(), "kernel_path": forward["kernels"]}
    return out


def native_capability() -> str:
    """ATen's capability on this machine without the portable pins (this process never pins)."""
    import torch
    return torch.backends.cpu.get_cpu_capability()


def mismatch(expected: dict, got: dict) -> str | None:
    """None when the compared sha256s agree; else what differs and both machines' kernel paths."""
    differ = [k for k in COMPARED if expected.get(k) != got.get(k)]
    if not differ:
        return None
    return (f"{', '.join(differ)} differ from pipeline/reference/fingerprints.yaml\n"
            f"  committed: {json.dumps({k: expected.get(k) for k in differ})}\n"
            f"  here:      {json.dumps({k: got.get(k) for k in differ})}\n"
            f"  kernel path of the machine that made them: {json.dumps(expected['made_on'])}\n"
            f"  kernel path here:                          {json.dumps(got['made_on'])}")


def load() -> dict:
    return yaml.safe_load(FILE.read_text(encoding="utf-8"))["fingerprints"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.helpers.fingerprints", description=__doc__)
    p.add_argument("entries", nargs="*", default=list(ENTRIES), help=", ".join(ENTRIES))
    p.add_argument("--write", action="store_true", help="rewrite pipeline/reference/fingerprints.yaml")
    p.add_argument("--prepared-gemma", type=Path, help="an artifacts/prepare_model folder of gemma3_270m to reuse")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = load() if FILE.exists() else {}
    with tempfile.TemporaryDirectory(prefix="nexttoken-fingerprints-") as tmp:
        bases: dict[str, Path] = {}
        for name in args.entries:
            model, dtype = ENTRIES[name]
            if model not in bases:
                prepared = args.prepared_gemma if model == "gemma3_270m" else None
                bases[model] = prepared_workspace(Path(tmp) / f"base-{model}", model, prepared)
            results[name] = compute(bases[model], Path(tmp) / name, model, dtype)
            print(json.dumps({name: results[name]}, indent=1), flush=True)
    if args.write:
        write(results)
    return 0


def write(results: dict) -> None:
    text = yaml.safe_dump({"fingerprints": {k: results[k] for k in ENTRIES if k in results}},
                          sort_keys=False, allow_unicode=True, width=120)
    FILE.write_text(HEADER + text, encoding="utf-8")
    print(f"wrote {FILE.relative_to(REPO)}")


if __name__ == "__main__":
    sys.exit(main())
