"""The kernel path: pinning `capture.kernels`, refusing `portable` where it has no meaning, CUDA
determinism (faked where no GPU is present), the kernel-path record and how two records compare.

What cannot run here: a real CUDA device (the flags are torch globals, set and read on the CPU
build; `kernel_path`'s CUDA section is exercised with torch.cuda faked) and a real AVX2-only or
ARM CPU (their /proc/cpuinfo is faked).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pipeline import kernels
from pipeline.errors import UserError
from pipeline.model import loader
from pipeline.store import provenance
from tests.conftest import REPO

AMX = ("flags\t\t: fpu sse4_1 avx avx2 fma avx512f avx512bw avx512dq avx512vl avx512_bf16 avx512_fp16 "
       "amx_bf16 amx_tile amx_int8\n")
AVX2_ONLY = "flags\t\t: fpu sse4_1 avx avx2 fma\n"
SSE_ONLY = "flags\t\t: fpu sse4_1 sse4_2 avx\n"
ARM = "Features\t: fp asimd evtstrm aes crc32 asimddp sve sve2 bf16 i8mm\n"


@pytest.fixture(autouse=True)
def avx2_machine(monkeypatch):
    """Every test starts on a faked x86-64 AVX2 machine and leaves the process's pinned mode as it was."""
    monkeypatch.setattr(kernels, "_pinned", kernels._pinned)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "cpu_flags", lambda *a: ["avx2", "fma"] if not a else _real_flags(*a))


_real_flags = kernels.cpu_flags


def _flags(tmp_path, text):
    (tmp_path / "cpuinfo").write_text("processor\t: 0\n" + text)
    return _real_flags(tmp_path / "cpuinfo")


def test_cpu_flags_are_the_kernel_selecting_ones(tmp_path):
    assert _flags(tmp_path, AMX) == ["avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16",
                                     "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"]
    assert _flags(tmp_path, ARM) == ["asimd", "asimddp", "sve", "sve2", "bf16", "i8mm"]
    assert _real_flags(tmp_path / "missing") is None


@pytest.mark.parametrize(("machine", "cpuinfo", "env", "reason"), [
    ("x86_64", AMX, {}, None),
    ("x86_64", AVX2_ONLY, {"ATEN_CPU_CAPABILITY": "avx512"}, None),     # a cap at or above AVX2: pinned over
    ("x86_64", SSE_ONLY, {}, "this CPU has no avx2 or fma"),
    ("aarch64", ARM, {}, "this machine is aarch64"),
    ("x86_64", None, {}, "/proc/cpuinfo cannot be read"),
    ("x86_64", AMX, {"ATEN_CPU_CAPABILITY": "default"}, "ATEN_CPU_CAPABILITY=default caps the kernels below AVX2"),
    ("x86_64", AMX, {"ONEDNN_MAX_CPU_ISA": "SSE41"}, "ONEDNN_MAX_CPU_ISA=SSE41 caps the kernels below AVX2"),
])
def test_portable_is_refused_where_it_has_no_meaning(tmp_path, machine, cpuinfo, env, reason):
    flags = None if cpuinfo is None else _flags(tmp_path, cpuinfo)
    got = kernels.portable_refusal(machine, flags, env)
    assert got == reason if reason is None else reason in got


def test_portable_sets_the_pins_and_native_changes_nothing():
    env = {"ATEN_CPU_CAPABILITY": "avx512", "HOME": "/x"}
    kernels.pin("portable", env, torch_loaded=False)
    assert env == {**kernels.PORTABLE_ENV, "HOME": "/x"} and kernels.pinned_mode() == "portable"
    env = {"ATEN_CPU_CAPABILITY": "default"}
    kernels.pin("native", env, torch_loaded=True)      # a user's hand-set cap stays, and is recorded
    assert env == {"ATEN_CPU_CAPABILITY": "default"} and kernels.pinned_mode() == "native"


def test_a_pin_after_torch_loaded_is_refused_unless_already_in_place():
    with pytest.raises(RuntimeError, match="before torch is imported"):
        kernels.pin("portable", {}, torch_loaded=True)
    kernels.pin("portable", dict(kernels.PORTABLE_ENV), torch_loaded=True)    # nothing would change: fine


def test_bad_and_refused_modes_are_one_line(monkeypatch):
    with pytest.raises(UserError, match=r"^capture.kernels='fast' is not allowed: one of native, portable$"):
        kernels.pin("fast", {}, torch_loaded=False)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    with pytest.raises(UserError) as e:
        kernels.pin("portable", {}, torch_loaded=False)
    assert str(e.value) == ("capture.kernels='portable' is not allowed on this machine: it pins x86-64 kernels to "
                            "AVX2, and this machine is aarch64; use native")


def test_pinning_stages_import_no_torch_before_they_pin():
    """The mechanism: a stage that pins must not load torch at import time (its pin would do nothing)."""
    code = ("import sys\nfor s in ('forward', 'probs', 'trajectories', 'checks'):\n"
            "    __import__('stages.' + s)\n    assert 'torch' not in sys.modules, s\n"
            "import pipeline.tools.verify, pipeline.tools.audit\nassert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.fixture
def cuda_flags():
    """Restore torch's global determinism flags after a test sets them (they are process-wide)."""
    m, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             m.allow_tf32, cudnn.allow_tf32, m.allow_bf16_reduced_precision_reduction,
             m.allow_fp16_reduced_precision_reduction, cudnn.deterministic, cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    (m.allow_tf32, cudnn.allow_tf32, m.allow_bf16_reduced_precision_reduction,
     m.allow_fp16_reduced_precision_reduction, cudnn.deterministic, cudnn.benchmark) = saved[2:]


def test_cuda_determinism_sets_every_flag(cuda_flags, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    torch.backends.cudnn.allow_tf32 = True
    kernels.deterministic_cuda()
    m = torch.backends.cuda.matmul
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert not (m.allow_tf32 or torch.backends.cudnn.allow_tf32 or m.allow_bf16_reduced_precision_reduction
                or m.allow_fp16_reduced_precision_reduction or torch.backends.cudnn.benchmark)
    assert torch.backends.cudnn.deterministic
    assert kernels.os.environ["CUBLAS_WORKSPACE_CONFIG"] == kernels.CUBLAS_WORKSPACE


def test_loading_on_a_gpu_applies_cuda_determinism_first(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(kernels, "deterministic_cuda", lambda: calls.append("determinism"))

    class Model:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            calls.append("load")
            return SimpleNamespace(eval=lambda: "model", to=lambda device: calls.append(("to", str(device))))
    import transformers
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", Model)
    assert loader.load_model(tmp_path, torch.bfloat16, "cuda:0", "eager", False) == "model"
    assert calls == ["determinism", "load", ("to", "cuda:0")]
    calls.clear()
    loader.load_model(tmp_path, torch.bfloat16, "cpu", "eager", False)
    assert calls == ["load"]


def test_the_kernel_path_record_on_cpu_and_on_a_faked_gpu(monkeypatch):
    cpu = provenance.kernel_path()
    assert cpu["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert cpu["torch_threads"] == torch.get_num_threads() and set(cpu["env"]) == set(kernels.PIN_VARS)
    assert cpu["cuda"] is None and cpu["mkl"] and cpu["onednn"].startswith("v")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name="NVIDIA H100", major=9,
                                                                                        minor=0))
    gpu = provenance.kernel_path()["cuda"]
    assert gpu["gpus"] == ["NVIDIA H100 (cc 9.0)"] and "allow_bf16_reduced_precision_reduction" in gpu
    assert "Cublas" in gpu["preferred_blas_library"] and "deterministic_algorithms" in gpu


def test_two_records_compare_field_by_field():
    then = {"mode": "native", "aten_cpu_capability": "AVX512", "cpu_flags": ["avx2", "amx_bf16"],
            "env": {"ONEDNN_MAX_CPU_ISA": None}, "cuda": None}
    now = {**then, "aten_cpu_capability": "AVX2", "cpu_flags": ["avx2"], "env": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
    diffs = kernels.differences(then, now)
    assert [d[0] for d in diffs] == ["aten_cpu_capability", "cpu_flags", "env.ONEDNN_MAX_CPU_ISA"]
    assert [kernels.describe_difference(*d) for d in diffs] == [
        "aten_cpu_capability AVX512 -> AVX2", "cpu_flags -amx_bf16", "env.ONEDNN_MAX_CPU_ISA None -> AVX2"]
    assert kernels.differences(then, dict(then)) == []


def test_verify_names_the_prompts_a_cluster_computed_on_other_cpu_kernels():
    """issue 29: a Ray run records each prompt's kernels; verify says which prompts were computed with kernels that
    are not this machine's, by node, and says nothing where they match or are not recorded."""
    from pipeline.numerics.divergence import prompt_kernel_lines
    here = {"mode": "native", "aten_cpu_capability": "AVX2", "cpu_flags": ["avx2", "fma"]}
    node = {"kernel_mode": "native", "aten_cpu_capability": "AVX2", "cpu_flags": ["avx2", "fma"], "node": "a"}
    other = {**node, "aten_cpu_capability": "AVX512", "cpu_flags": ["avx2", "fma", "avx512f"], "node": "b"}
    prompts = {f"p{i}": (other if i % 3 == 0 else node) for i in range(9)}
    manifests = {"tokenize": {}, "forward": {"executor": {"kind": "ray", "prompts": prompts}}}
    (line,) = prompt_kernel_lines(manifests, here)
    assert line == ("kernel path per prompt: forward computed 3 prompt(s) on node b with CPU kernels ATen AVX512, "
                    "flags avx2+fma+avx512f, here ATen AVX2, flags avx2+fma (their bits may differ): p0, p3, p6")
    assert prompt_kernel_lines(manifests, other | {"mode": "native"}) == [
        "kernel path per prompt: forward computed 6 prompt(s) on node a with CPU kernels ATen AVX2, flags avx2+fma, "
        "here ATen AVX512, flags avx2+fma+avx512f (their bits may differ): p1, p2, p4, p5, p7 and 1 more"]
    assert prompt_kernel_lines({"forward": {"executor": {"kind": "ray", "prompts": {"p0": node}}}}, here) == []
    assert prompt_kernel_lines(manifests, None) == []           # nothing recorded here: nothing to compare
    assert prompt_kernel_lines({"forward": {"kernels": here}}, here) == []    # serial: the run-wide line says it
