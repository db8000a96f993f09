"""The kernel path: pin it before torch loads (`capture.kernels`), apply CUDA determinism, compare records.

The same code, packages and snapshot give different bits on CPUs whose kernels differ: ATen
picks its vectorised kernels by CPU capability (AVX2, AVX-512), oneDNN its bf16 matmuls by ISA
(AVX2, AVX-512, AMX), MKL its float32 GEMM by branch and thread count. `capture.kernels`:

- `native` (default): the fastest kernels of this machine; nothing is changed (variables a
  user set by hand stay, and are recorded).
- `portable`: on x86-64 with AVX2 + FMA, `PORTABLE_ENV`: ATen and oneDNN capped at AVX2, MKL's
  conditional numerical reproducibility at AVX2 (STRICT: GEMM results do not depend on the
  thread count) and a fixed thread count, so every AVX2 machine computes the same bits.
  Refused with one line elsewhere (no AVX2, another architecture, or kernels capped below
  AVX2 by a variable already set).

These variables are read when torch and its libraries initialise, so `pin` must run before
anything imports torch. The mechanism: each stage whose numbers depend on the kernels
(forward, probs, trajectories, checks) imports only torch-free modules at the top, calls
`pin(capture.kernels)` first thing in `main()`, then imports the model code; `nexttoken
verify` and `audit` pin the mode of the run they read the same way. `pin` refuses to change
the environment once torch is loaded (a pin that cannot take effect must not be recorded).

On CUDA the run always applies deterministic settings (`deterministic_cuda`, called where a
model is loaded on a GPU); GPU results reproduce on the same GPU model only.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from pipeline.errors import UserError, bad_value

MODES = ("native", "portable")
PORTABLE_THREADS = 2      # fixed: ATen reductions split by thread; 2 fits the smallest machines we run on
PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",        # ATen's vectorised kernels: softmax, norms, exp, reductions
    "ONEDNN_MAX_CPU_ISA": "AVX2",         # oneDNN (bf16 matmuls): no AVX-512 or AMX code paths
    "MKL_CBWR": "AVX2,STRICT",            # MKL float32 GEMM: the AVX2 branch, same bits for any thread count
    "OMP_NUM_THREADS": str(PORTABLE_THREADS),
    "MKL_NUM_THREADS": str(PORTABLE_THREADS),
}
# Every variable that selects kernels, precision or threads: recorded in each manifest.
PIN_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE",
            "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE")
# Values of a variable set by hand that cap the kernels below AVX2: `portable` cannot hold there.
BELOW_AVX2 = {"ATEN_CPU_CAPABILITY": {"default"}, "ONEDNN_MAX_CPU_ISA": {"sse41", "avx"},
              "DNNL_MAX_CPU_ISA": {"sse41", "avx"}, "MKL_ENABLE_INSTRUCTIONS": {"sse4_2", "avx"}}
# CPU flags that select kernels (/proc/cpuinfo names): x86-64, then their ARM counterparts.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
                "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm", "sme")
X86 = ("x86_64", "amd64")
CUBLAS_WORKSPACE = ":4096:8"          # what cuBLAS needs to repeat its GEMMs bit for bit
KEY = "capture.kernels"

_pinned: str | None = None            # the mode this process pinned; None: it did not pin


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str] | None:
    """The kernel-selecting flags of this CPU, or None where they cannot be read (not Linux)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            present = set(value.split())
            return [f for f in KERNEL_FLAGS if f in present]
    return None


def portable_refusal(machine: str, flags: list[str] | None, environ: MutableMapping[str, str]) -> str | None:
    """Why `portable` has no meaning on this machine, or None when it can be pinned."""
    if machine.lower() not in X86:
        return f"it pins x86-64 kernels to AVX2, and this machine is {machine}"
    if flags is None:
        return "it needs the CPU's flags to confirm AVX2 + FMA, and /proc/cpuinfo cannot be read here"
    if missing := [f for f in ("avx2", "fma") if f not in flags]:
        return f"it pins the kernels to AVX2 + FMA, and this CPU has no {' or '.join(missing)}"
    for var, low in BELOW_AVX2.items():
        if environ.get(var, "").strip().lower() in low:
            return f"{var}={environ[var]} caps the kernels below AVX2 (unset it to pin AVX2)"
    return None


def check_mode(mode: str) -> None:
    """`capture.kernels` is one of MODES (config validation, no side effect)."""
    if mode not in MODES:
        raise bad_value(KEY, mode, "one of " + ", ".join(MODES))


def pin(mode: str, environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None) -> None:
    """Set the kernel-pinning variables of `mode` in the environment; call before torch is imported.

    UserError (one line) for `portable` where it has no meaning. RuntimeError when torch is
    already loaded and the environment would change: the pin could not take effect.
    """
    global _pinned
    environ = os.environ if environ is None else environ
    check_mode(mode)
    wanted = {}
    if mode == "portable":
        if reason := portable_refusal(platform.machine(), cpu_flags(), environ):
            raise UserError(f"{KEY}='portable' is not allowed on this machine: {reason}; use native")
        wanted = {k: v for k, v in PORTABLE_ENV.items() if environ.get(k) != v}
    loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if wanted and loaded:
        raise RuntimeError(f"{KEY}={mode} must be pinned before torch is imported, and torch is loaded: "
                           f"{', '.join(wanted)} would have no effect (import the model code after kernels.pin)")
    environ.update(wanted)
    _pinned = mode


def pinned_mode() -> str | None:
    """The mode this process pinned (None: it did not pin, it computes nothing kernel-bound)."""
    return _pinned


def deterministic_cuda() -> None:
    """CUDA, always: cuBLAS workspace for repeatable GEMMs, deterministic algorithms (warn where an
    op has none), no TF32, no reduced-precision bf16/fp16 reductions, cuDNN without autotuning.
    Call before the first CUDA kernel (loader.load_model does, on a GPU)."""
    import torch
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


# ---------------------------------------------------------------- comparing records
def flatten(record: dict | None, prefix: str = "") -> dict[str, Any]:
    """A kernel-path record as dotted keys (env.MKL_CBWR, cuda.gpus, ...)."""
    out: dict[str, Any] = {}
    for k, v in (record or {}).items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(then: dict | None, now: dict | None) -> list[tuple[str, Any, Any]]:
    """(field, value then, value now) for every field of two kernel-path records that differs."""
    a, b = flatten(then), flatten(now)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def describe_difference(field: str, x: Any, y: Any) -> str:
    """One field's change, short: a flag list as the flags gained and lost."""
    if isinstance(x, list) and isinstance(y, list) and all(isinstance(v, str) for v in x + y):
        lost, gained = [f for f in x if f not in y], [f for f in y if f not in x]
        return f"{field} " + " ".join([*(f"-{f}" for f in lost), *(f"+{f}" for f in gained)])
    return f"{field} {x} -> {y}"


def cpu_key(record: dict | None) -> str | None:
    """What decides a CPU computation's bits, in one phrase: `portable` (the pins make every x86 CPU compute the
    same bits), else ATen's capability and the kernel-selecting flags. `record`: a manifest's kernel path
    (`provenance.kernel_path`) or a Ray prompt's record (`kernel_mode`, `aten_cpu_capability`, `cpu_flags`);
    None when it holds neither."""
    if not record:
        return None
    mode = record.get("mode", record.get("kernel_mode"))
    if mode == "portable":
        return "portable"
    if record.get("aten_cpu_capability") is None:
        return None
    return f"ATen {record['aten_cpu_capability']}, flags {'+'.join(record.get('cpu_flags') or []) or 'unknown'}"


def summary(record: dict | None) -> str:
    """A kernel-path record in one short phrase (the report, diff and verify lines)."""
    if not record:
        return "not recorded"
    env = {k: v for k, v in (record.get("env") or {}).items() if v is not None}
    pins = ", ".join(f"{k}={v}" for k, v in env.items()) or "no pinning variables"
    return (f"{record.get('mode') or 'not pinned'}; ATen {record.get('aten_cpu_capability')}, "
            f"{record.get('torch_threads')} threads; {pins}")
