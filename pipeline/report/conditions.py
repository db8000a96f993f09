"""Section 1 of the report, the run conditions: model, hardware, seeds, determinism, the forward pass's
kernel path, git; each stage's record; the library versions, from the manifests and forward's facts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline import kernels
from pipeline.report.markdown import name, src, table, yes
from pipeline.store import paths


def kernel_path(record: dict | None) -> str:
    """The forward pass's kernel path: mode, ATen capability, pins; CPU flags, MKL / oneDNN, CUDA."""
    if not record:
        return "not recorded (the forward stage's manifest holds none)"
    cuda = record.get("cuda")
    return (f"{kernels.summary(record)}; CPU flags {' '.join(record.get('cpu_flags') or []) or 'unknown'}; "
            f"MKL {record.get('mkl')}, oneDNN {record.get('onednn')}"
            + (f"; CUDA: {', '.join(f'{k}={v}' for k, v in cuda.items())}" if cuda else ""))


# Model configs named after their kind of source (conf/model/local.yaml, hub.yaml, tiny.yaml): the name says how the
# model was found, not which model it is.
GENERIC_NAMES = ("local", "hub", "tiny")


def model_title(source: dict) -> str:
    """Which model a run used, as the report's title names it: the config's name, or where that name is only the
    kind of source (`model=local`), the model's folder name (a hub model: its id) with its model_type."""
    name, kind = source.get("name"), source.get("kind")
    if name != kind or name not in GENERIC_NAMES:
        return str(name)
    model_type = (source.get("model") or {}).get("model_type") or source.get("family")
    folder = source.get("snapshot_dir") or source.get("path")
    which = source.get("hub_id") if kind == "hub" else Path(folder).name if kind == "local" and folder else None
    about = ", ".join(str(x) for x in (model_type, f"model={name}") if x)
    return f"{which} ({about})" if which else f"{name} ({model_type or 'model_type not recorded'})"


def stage_rows(manifests: dict[str, dict]) -> list[list]:
    """One row per stage of the graph (paths.STAGES, dvc.yaml's order): its manifest's record, or why there is none."""
    rows = []
    for st in paths.STAGES:
        m = manifests.get(st)
        if st == "report":
            rows.append([st, "this report", "-", "-", "-", "-", f"in {src(paths.manifest_path(st))}"])
        elif m is None:
            rows.append([st, "not run (no manifest)", "-", "-", "-", "-", "-"])
        else:
            rows.append([st, m.get("created_at"), m.get("duration_s"), m.get("hardware", {}).get("cpu_model"),
                         ", ".join(g["name"] for g in m.get("hardware", {}).get("gpus", [])) or "-",
                         (m.get("config_sha256") or "")[:12], (m.get("git") or {}).get("commit") or "-"])
    return rows


def conditions(inp: Any) -> list[str]:
    """Section 1 for a render.Inputs: model, hardware, seeds, determinism, kernel path, git; stages; libraries."""
    s, f = inp.source, inp.facts
    fwd = inp.manifests.get("forward", {})
    hw, det = fwd.get("hardware", {}), fwd.get("determinism", {})
    gpus = "; ".join(f"{g['name']} (cc {g['compute_capability']}, {g['total_memory_bytes'] / 2**30:.0f} GiB)"
                     for g in hw.get("gpus", [])) or "none (CUDA not available)"
    seeds = "; ".join(f"{k} = {v} ({stage})" for stage, m in inp.manifests.items()
                      for k, v in (m.get("seeds") or {}).items()) or "none recorded"
    origin = s.get("hub_id") or (f"pip {s.get('pip')} {s.get('package_version')}" if s.get("pip") else "local")
    git = fwd.get("git", {})
    rows = [
        ["model", name(s.get("name"))], ["kind", s.get("kind")], ["revision", name(s.get("revision"))],
        ["from", origin],
        ["architecture", f"{f['model_type']}: {f['num_layers']} layers, hidden {f['hidden_size']}, "
                         f"{f['num_heads']} heads ({f['num_kv_heads']} KV), head dim {f['head_dim']}, "
                         f"tied embeddings {yes(f['tied_embeddings'])}"],
        ["output size / tokenizer length", f"{f['output_size']} / {f['tokenizer_len']}"],
        ["dtype (compute)", f["compute_dtype"]], ["attention", f["attn_implementation"]],
        ["device", f["device"] + (f" ({f['gpu_name']})" if f.get("gpu_name") else "")],
        ["CPU", f"{hw.get('cpu_model')}, {hw.get('cpu_cores')} cores, "
                f"{(hw.get('ram_bytes') or 0) / 2**30:.1f} GiB RAM"],
        ["GPU", gpus],
        ["CUDA / cuDNN / driver", f"{hw.get('cuda_version')} / {hw.get('cudnn_version')} / {hw.get('gpu_driver')}"],
        ["seeds", seeds],
        ["determinism", ", ".join(f"{k}={v}" for k, v in det.items())],
        ["kernel path", kernel_path(fwd.get("kernels"))],
        ["git", "not recorded (no git checkout)" if not git.get("commit")
         else f"{git['commit'][:12]}{' (dirty)' if git.get('dirty') else ''}"],
    ]
    out = ["## 1. Run conditions", ""] + table(["", "value"], rows, [
        src(paths.SOURCE), inp.cite(paths.FORWARD_FACTS), src(paths.manifest_path("forward")),
        "artifacts/*/manifest.json"])
    out += ["Stages:", ""] + table(["stage", "created (UTC)", "duration (s)", "CPU", "GPU", "config sha256",
                                    "git commit"], stage_rows(inp.manifests), "artifacts/*/manifest.json")
    libs = fwd.get("libraries", {})
    lib_rows = []
    for lib, version in libs.items():
        other = sorted({f"{st}: {m['libraries'].get(lib)}" for st, m in inp.manifests.items()
                        if m.get("libraries", {}).get(lib) != version})
        lib_rows.append([lib, name(version), "; ".join(other) or "same in every stage"])
    return out + ["Library versions:", ""] + table(["library", "version (forward)", "other stages"], lib_rows,
                                                    "artifacts/*/manifest.json")
