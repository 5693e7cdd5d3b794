"""Every CUDA kernel source compiles to PTX for sm_90 through NVRTC (no GPU or driver needed)."""

from __future__ import annotations

import re

import pytest

from engine.backends.cuda import kernels
from tests.engine.cuda.conftest import nvrtc_or_skip

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
OPS = [
    "rmsnorm",
    "rope_store",
    "attn_split",
    "attn_reduce",
    "glu",
    "glu_stacked",
    "add_inplace",
    "to_half",
    "softcap",
    "bump",
    "argmax",
    "sample_topk",
]


@pytest.fixture
def ptx(module_ptx) -> str:
    return module_ptx


def _entries(text: str) -> set[str]:
    return set(re.findall(r"\.entry\s+(\w+)\(", text))


def test_quant_kernels_compile_for_every_type(ptx):
    entries = _entries(ptx)
    for t in TYPES:
        assert f"matvec_{t}" in entries and f"dequant_{t}" in entries, t
    assert ".target sm_90" in ptx


def test_op_kernels_compile(ptx):
    assert set(OPS) <= _entries(ptx)


def test_each_source_compiles_on_its_own():
    nvrtc_or_skip()
    assert kernels.SOURCES == ("quant.cu", "ops.cu")
    # quant.cu is most of the full module (compiled by the fixture); ops.cu must stand alone too
    assert set(OPS) <= _entries(kernels.compile_ptx(kernels.source("ops.cu"), "ops.cu"))


def test_a_syntax_error_is_reported():
    nvrtc_or_skip()
    with pytest.raises(RuntimeError, match="does not compile"):
        kernels.compile_ptx('extern "C" __global__ void k(float* a) { a[0] = undefined_name; }', "bad.cu")
