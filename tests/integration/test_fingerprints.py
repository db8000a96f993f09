"""Cross-machine fingerprints: this machine reproduces pipeline/reference/fingerprints.yaml bit for bit.

The entries were made with `capture.kernels=portable` (tests/helpers/fingerprints.py says how);
any x86-64 machine with AVX2 + FMA must give the same logits and token ids. On a mismatch the
failure prints both machines' kernel paths. Two more runs show what the pins are and that the
comparison can fail: the portable variables set by hand in native mode give the same bits, and
kernels capped below AVX2 (ATen's scalar path, oneDNN SSE4.1) give other bits.

gemma3_270m is slow (its snapshot is prepared from the GGUF package once per run for every file that reads it,
tests/helpers/shared.py, about 2 minutes; set NEXTTOKEN_GEMMA_PREPARED to reuse a prepared
artifacts/prepare_model folder).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from pipeline import kernels
from tests.helpers import fingerprints, shared

EXPECTED = fingerprints.load()
REFUSAL = kernels.portable_refusal(platform.machine(), kernels.cpu_flags(), os.environ)
pytestmark = pytest.mark.skipif(REFUSAL is not None, reason=f"capture.kernels=portable has no meaning here: {REFUSAL}")
BELOW_AVX2 = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    return fingerprints.prepared_workspace(tmp_path_factory.mktemp("fp") / "tiny", "tiny_qwen2")


def _check(name: str, got: dict) -> None:
    problem = fingerprints.mismatch(EXPECTED[name], got)
    assert problem is None, problem


@pytest.mark.parametrize("name", ["tiny_qwen2_bfloat16", "tiny_qwen2_float32"])
def test_tiny_fingerprint_reproduces_here(name, tiny_base, tmp_path):
    model, dtype = fingerprints.ENTRIES[name]
    got = fingerprints.compute(tiny_base, tmp_path / "ws", model, dtype)
    _check(name, got)
    # the committed ids are the article's 4 steps, pinned whatever conf/'s max_new_tokens is
    assert len(got["greedy_token_ids"]) == len(EXPECTED[name]["greedy_token_ids"]) == fingerprints.STEPS


def test_the_portable_variables_set_by_hand_are_the_pin(tiny_base, tmp_path):
    """Native mode with PORTABLE_ENV in the environment computes the portable bits (float32: MKL's
    branch and threads matter, not only ATen and oneDNN)."""
    got = fingerprints.compute(tiny_base, tmp_path / "ws", "tiny_qwen2", "float32", kernels="native",
                               env=kernels.PORTABLE_ENV)
    _check("tiny_qwen2_float32", got)
    assert got["made_on"]["kernel_path"]["mode"] == "native"


def test_kernels_below_avx2_give_other_bits_and_the_failure_names_both_kernel_paths(tiny_base, tmp_path):
    got = fingerprints.compute(tiny_base, tmp_path / "ws", "tiny_qwen2", "bfloat16", kernels="native",
                               env=BELOW_AVX2)
    problem = fingerprints.mismatch(EXPECTED["tiny_qwen2_bfloat16"], got)
    assert problem is not None and "logits_content_sha256" in problem
    assert got["made_on"]["kernel_path"]["aten_cpu_capability"] == "DEFAULT"
    assert '"aten_cpu_capability": "AVX2"' in problem and '"aten_cpu_capability": "DEFAULT"' in problem


@pytest.mark.slow
def test_gemma_fingerprint_reproduces_here(tmp_path):
    base = fingerprints.prepared_workspace(tmp_path / "base", "gemma3_270m", shared.gemma_or_skip())
    _check("gemma3_270m_bfloat16", fingerprints.compute(base, tmp_path / "ws", "gemma3_270m", "bfloat16"))
