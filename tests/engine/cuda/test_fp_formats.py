"""FP8 (E4M3, per-row or per-128 x 128 block scale) and NVFP4 (E2M1 + E4M3 per 16 + global scale) on the CUDA
backend, without a GPU: the kernels on host threads (tests/engine/cuda/simt.py) against the CPU fpquant
kernels, and the decoder over a tiny model whose matrices are FP8 / NVFP4, on the stand-in CuPy of
test_decoder_dry.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu.fpquant import FP8_E4M3, FP8_E4M3_BLOCK, NVFP4, block_scales_per_row
from engine.quant.encode import dequantize
from engine.quant.fp8 import quantize_fp8, quantize_fp8_blocks
from engine.quant.nvfp4 import quantize_nvfp4
from engine.weights import Weight
from tests.engine.cuda import test_decoder_dry as dry
from tests.engine.cuda import test_kernels_gpu as gpu_tests
from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3
from tests.engine.tiny_models import TinySpec, write_tiny_gguf

# the stand-in CuPy, the PTX parameter lists and the host-thread build, shared with test_decoder_dry.py
fake = dry.fake
ptx_params = dry.ptx_params
simt = dry.simt

FORMATS = {"fp8": FP8_E4M3, "nvfp4": NVFP4, "fp8b": FP8_E4M3_BLOCK}
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_matvec_and_dequant_kernels_on_host_threads(fake, simt, fmt):
    """test_kernels_gpu.py's per-type parity check (matvec against cpu.linear and the reference
    decoder, dequant to float32 / float16, picked rows), its kernels run on host threads."""
    dry.STATE.simt = simt
    gpu_tests.test_matvec_and_dequant_match_cpu(0, FORMATS[fmt])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_stacked_matvec_on_host_threads(fake, simt, fmt):
    """Three stacked weights, each with its own scales (and NVFP4 global scale), every prologue."""
    dry.STATE.simt = simt
    gpu_tests.test_stacked_matvec_prologues_and_accumulate(0, FORMATS[fmt], False)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_batched_matvec_on_host_threads(fake, simt, monkeypatch, fmt):
    """A batch of 5 vectors in launches of 2, 2 (matvec_<fmt>_batch) and 1 (matvec_<fmt>), each weight row
    read once a launch: what each vector gets alone."""
    dry.STATE.simt = simt
    gpu_tests.test_float_matvec_batch_matches_one_vector_at_a_time(0, FORMATS[fmt], monkeypatch)
    assert fake.launches.count(f"matvec_{fmt}") == 2 * (1 + 5)  # a vector alone: the one-vector kernel
    assert fake.launches.count(f"matvec_{fmt}_batch") == 2 * 2


def _fp(w: Weight, fmt: int) -> Weight:
    dense = dequantize(w.ggml_type, w.raw, w.cols).reshape(w.rows, w.cols)
    if fmt == FP8_E4M3:
        codes, scale = quantize_fp8(dense)
        return Weight(fmt, codes, w.rows, w.cols, scale)
    if fmt == FP8_E4M3_BLOCK:
        codes, blocks = quantize_fp8_blocks(dense)
        return Weight(fmt, codes, w.rows, w.cols, block_scales_per_row(blocks, w.rows))
    packed, scales, g = quantize_nvfp4(dense)
    return Weight(fmt, packed, w.rows, w.cols, scales, float(g))


def _model(tmp_path, kind: str, fmt: int):
    """A tiny float model with every layer matrix converted, as `hearth convert --to fp8/nvfp4` does
    (embeddings and the output head stay float)."""
    from engine.loader import load_model

    path = tmp_path / f"{kind}.gguf"
    if kind == "gemma3":
        write_tiny_gemma3(path, TinyGemmaSpec(layers=2, final_softcap=3.0))
    else:
        write_tiny_gguf(path, TinySpec(layers=1 if kind == "llama-1layer" else 2, tied=kind != "llama"))
    model = load_model(path).model
    for layer in model.layers:
        for name in MATRICES:
            setattr(layer, name, _fp(getattr(layer, name), fmt))
    return model


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_decoder_runs_fp_models(fake, tmp_path, kind, fmt):
    """Upload (codes and scales), prefill through the dequant kernel, captured decode steps through the
    matvec kernel, every launch checked against the compiled kernel's parameters."""
    t = FORMATS[fmt]
    model = _model(tmp_path, kind, t)
    seen = []
    dec = fake.decoder.CudaDecoder(model, n_ctx=64, progress=lambda d, total: seen.append((d, total)))
    assert seen[-1][0] == seen[-1][1] == dec.weight_bytes
    wq = dec.layers[0]["wq"]
    assert wq.ggml_type == t and wq.scales is not None and wq.nbytes == model.layers[0].wq.nbytes
    np.testing.assert_array_equal(wq.scales, model.layers[0].wq.scales)
    assert wq.global_scale == model.layers[0].wq.global_scale
    # a decode step reads the codes and the scales of every layer matrix
    layer_bytes = sum(getattr(layer, m).nbytes for layer in model.layers for m in MATRICES)
    assert dec.decode_weight_bytes >= layer_bytes > sum(
        getattr(layer, m).raw.nbytes for layer in model.layers for m in MATRICES
    )
    cache = dec.new_cache(64)
    dec.forward([1, 2, 3, 4, 5], cache)
    assert f"dequant_{fmt}" in fake.launches  # prefill tiles
    fake.launches.clear()
    dec.forward([6], cache)
    assert f"matvec_{fmt}" in fake.launches and fake.cp.cuda.Stream.captures[-2:] == ["begin", "end"]
    assert 0 <= dec.greedy_step(3, cache) < 2**31 and cache.offset == 7


# a whole decoder on host threads takes ~10-30 s on 2 cores: CI runs NVFP4 (the longer argument lists);
# HEARTH_CUDA_SIMT=1 adds both FP8s (whose kernels CI checks one by one above)
@pytest.mark.parametrize("fmt", ["nvfp4", *dry._opt_in("fp8", "fp8b")])
def test_decoder_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path, fmt):
    """One FP8 / NVFP4 layer run by the kernels on host threads gives the CPU model's logits: prefill
    (dequantized tiles), a captured decode step (stacked q|k|v and gate|up matvecs with their own
    scales) and the greedy token."""
    dry.STATE.simt = simt
    model = _model(tmp_path, "llama-1layer", FORMATS[fmt])
    prompt = [1, 2, 3]
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    cpu_cache, gpu_cache = model.new_cache(32), dec.new_cache(32, np.float32)
    ref = model.forward(prompt, cpu_cache, all_logits=True)
    assert dry._rel(dec.forward(prompt, gpu_cache, all_logits=True), ref) < 1e-4
    token = int(np.argmax(ref[-1]))
    for _ in range(2):  # graph capture on the first step, a replay after
        ref_step = model.forward([token], cpu_cache)
        assert dry._rel(dec.forward([token], gpu_cache), ref_step) < 1e-4
        token = int(np.argmax(ref_step[-1]))
    assert dec.greedy_step(token, gpu_cache) == int(np.argmax(model.forward([token], cpu_cache)[-1]))


def test_malformed_fp_weight_is_refused_on_upload(fake):
    ok = Weight(FP8_E4M3, np.zeros((4, 32), np.uint8), 4, 32, np.ones(4, np.float32))
    assert fake.ops.upload(ok).nbytes == 4 * 32 + 4 * 4
    with pytest.raises(ValueError, match="FP8_E4M3 weight 4x32"):
        fake.ops.upload(Weight(FP8_E4M3, ok.raw, 4, 32, np.ones(3, np.float32)))
    with pytest.raises(ValueError, match="NVFP4 weight 4x32"):
        fake.ops.upload(Weight(NVFP4, np.zeros((4, 16), np.uint8), 4, 32, np.zeros((4, 1), np.uint8)))
    with pytest.raises(fake.ops.UnsupportedCudaWeightType, match="multiple of 32"):
        fake.ops.check_type(NVFP4, 48)
