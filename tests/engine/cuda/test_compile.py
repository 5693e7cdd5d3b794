"""Every CUDA kernel source compiles to PTX for sm_90 through NVRTC (no GPU or driver needed); the
quantized kernels also assemble with ptxas for sm_90 (hardware FP8 conversion) and compile for sm_80
(the portable path)."""

from __future__ import annotations

import re

import pytest

from engine.backends.cuda import kernels
from tests.engine.cuda.conftest import nvrtc_or_skip

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
TYPES += ["iq4_nl", "iq4_xs", "mxfp4"]
TYPES += ["fp8", "fp8b", "nvfp4"]
HW_E4M3 = "cvt.rn.f16x2.e4m3x2"
OPS = [
    "rmsnorm",
    "rope_store",
    "attn_decode",
    "ungroup_heads",
    "glu",
    "add_inplace",
    "softcap",
    "convert",
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
        assert f"matvec_{t}" in entries, t
        # the GGUF block types share one dequantization kernel (stacked weights of mixed types)
        assert (f"dequant_{t}" in entries) != t.startswith(("q", "iq", "mxfp4")), t
    assert {"dequant_qb", "matvec_qb"} <= entries
    assert ".target sm_90" in ptx


def test_fp8_kernels_use_the_hardware_conversion_on_sm_90_only(ptx):
    assert HW_E4M3 in ptx  # the module_ptx fixture compiles for compute_90
    # pre-Ada GPUs get the bit moves: the same kernels, without the sm_89 instruction
    older = kernels.compile_ptx(kernels.source("quant.cu"), "quant.cu", arch="compute_80")
    assert {"matvec_fp8", "dequant_fp8", "matvec_nvfp4", "dequant_nvfp4"} <= _entries(older)
    assert HW_E4M3 not in older and ".target sm_80" in older


def test_quant_kernels_assemble_for_sm_90():
    # NVRTC passes inline PTX through as text; a CUBIN runs ptxas, which checks it
    nvrtc_or_skip()
    cubin = kernels.compile_cubin(kernels.source("quant.cu"), "quant.cu", arch="sm_90")
    assert cubin[:4] == b"\x7fELF" and b"matvec_nvfp4" in cubin


def test_op_kernels_compile(ptx):
    assert set(OPS) <= _entries(ptx)


def test_each_source_compiles_on_its_own():
    nvrtc_or_skip()
    assert kernels.SOURCES == ("quant.cu", "ops.cu", "recurrent.cu", "flash.cu", "step.cu")
    # quant.cu is most of the full module (compiled by the fixture); ops.cu must stand alone too
    # (step.cu builds on quant.cu's decoders: it compiles in the module)
    assert set(OPS) <= _entries(kernels.compile_ptx(kernels.source("ops.cu"), "ops.cu"))


def test_flash_prefill_assembles_for_sm_90_and_sm_80(ptx):
    # ptxas checks the mma.sync operands; it stands alone; sm_80 (Ampere) has the same instruction
    assert {"flash_prefill_64", "flash_prefill_128"} <= _entries(ptx)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in _body(ptx, "flash_prefill_64")
    for arch in ("sm_90", "sm_80"):
        cubin = kernels.compile_cubin(kernels.source("flash.cu"), "flash.cu", arch=arch)
        assert b"flash_prefill_128" in cubin


def test_fused_step_assembles_for_sm_90_and_compiles_for_sm_80(ptx):
    # ptxas checks its inline PTX (dp4a, the sm_90 bulk L2 prefetch); older GPUs build it without
    # the prefetch
    assert {"decode_step", "matvec_qb"} <= _entries(ptx) and "cp.async.bulk.prefetch.L2" in ptx
    cubin = kernels.compile_cubin(kernels.full_source(), "hearth.cu", arch="sm_90")
    assert b"decode_step" in cubin
    older = kernels.compile_ptx(kernels.full_source(), "hearth.cu", arch="compute_80")
    assert "decode_step" in _entries(older) and "cp.async.bulk" not in older and "dp4a" in older


def test_a_syntax_error_is_reported():
    nvrtc_or_skip()
    with pytest.raises(RuntimeError, match="does not compile"):
        kernels.compile_ptx('extern "C" __global__ void k(float* a) { a[0] = undefined_name; }', "bad.cu")
    bad_asm = 'extern "C" __global__ void k(unsigned* a) { asm("cvt.rn.f16x2.e4m3x9 %0, %0;" : "+r"(a[0])); }'
    kernels.compile_ptx(bad_asm, "bad_asm.cu")  # PTX: the asm text is not looked at
    with pytest.raises(RuntimeError, match="e4m3x9"):
        kernels.compile_cubin(bad_asm, "bad_asm.cu")


def _body(ptx: str, entry: str) -> str:
    """The PTX of one kernel: from its .entry to the next one."""
    start = ptx.index(f".entry {entry}(")
    nxt = ptx.find(".entry ", start + 1)
    return ptx[start : nxt if nxt > 0 else len(ptx)]


def test_dependent_launch_kernels_wait_for_their_predecessor(ptx):
    # the kernels pdl.launch sends (a decode step's matvecs and attention) wait in griddepcontrol.wait
    # before they read what the kernel before them wrote; sm_80 builds have neither instruction
    for entry in ("matvec_qb", "attn_decode"):
        body = _body(ptx, entry)
        assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body, entry
    assert "griddepcontrol" not in _body(ptx, "rmsnorm")
    older = kernels.compile_ptx(kernels.full_source(), "hearth.cu", arch="compute_80")
    assert "griddepcontrol" not in older
