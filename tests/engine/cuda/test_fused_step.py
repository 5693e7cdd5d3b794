"""The fused decode step (kernels/step.cu, engine/backends/cuda/fused.py) without a GPU.

Its launch is checked against the compiled PTX by the stand-in CuPy of test_decoder_dry, and the kernel
itself runs on host threads with every block at once (tests/engine/cuda/simt.py, cooperative mode), so
its grid barriers, its int8 (dp4a) dot products for every GGUF block type, the float paths, the
online-softmax attention with the KV write, Gemma 3's post-norms / windows / soft-capping, the argmax and
the partial-offload (head) variant are compared with the CPU model. Small blocks (2 warps) and grids
(2-3 blocks) keep the thread count sane.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.cuda import test_decoder_dry as dry
from tests.engine.tiny_models import T, TinySpec, write_tiny_gguf

STATE, _rel = dry.STATE, dry._rel
fake, ptx_params, simt = dry.fake, dry.ptx_params, dry.simt  # the stand-in CuPy's fixtures


def _kquant(monkeypatch):
    """gguf.quants cannot encode K-quants: the engine's own encoder writes them for the tiny files."""
    import gguf

    from engine.quant.encode import quantize

    plain = gguf.quants.quantize

    def encode(value, qtype):
        if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
            return quantize(int(qtype), np.asarray(value, np.float32))
        return plain(value, qtype)

    monkeypatch.setattr(gguf.quants, "quantize", encode)


def _model(tmp_path, spec: TinySpec):
    from engine.loader import load_model

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, spec)
    return load_model(path).model


def _fused(fake, monkeypatch, model, blocks: int = 2, **kw):
    monkeypatch.setattr(fake.fused, "THREADS", 64)
    monkeypatch.setattr(fake.ops, "_sm_count", lambda: blocks)
    return fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32", decode_kernel="fused", **kw)


def test_fused_launch_matches_the_kernel(fake, tmp_path, monkeypatch):
    model = _model(tmp_path, TinySpec(matrix_type=T.Q8_0))
    dec = _fused(fake, monkeypatch, model)
    assert dec.decode_path == "fused" and dec.fused.blocks == 2 and dec.fused.threads == 64
    cache = dec.new_cache(32)
    dec.forward([1, 2, 3], cache)
    fake.launches.clear()
    dec.greedy_step(4, cache)
    dec.forward([5], cache)
    assert fake.launches == ["decode_step", "decode_step"]  # one launch per token, nothing else


def test_decode_kind_and_fallbacks(fake, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="graphs, fused"):
        fake.fused.decode_kind("megakernel")
    monkeypatch.setenv(fake.fused.ENV, "fused")
    assert fake.fused.decode_kind(None) == "fused"
    monkeypatch.delenv(fake.fused.ENV)
    assert fake.fused.decode_kind(None) == "graphs"
    # a head wider than the kernel's attention registers: the graph path, and the reason
    dec = _fused(fake, monkeypatch, _model(tmp_path, TinySpec(hidden=512, heads=1, kv_heads=1, layers=1)))
    assert dec.fused is None and dec.decode_path == "graphs (fused step: head_dim 512 > 256)"
    with pytest.raises(ValueError, match="multiple of 32"):
        fake.fused.FusedStep(dec, threads=48)
    # a GPU where the block does not fit on an SM: the graph path, and why
    monkeypatch.setattr(fake.cp.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", lambda f, t, m: 0)
    (tmp_path / "q8").mkdir()  # a file of its own: the first model still maps tiny.gguf
    dec = _fused(fake, monkeypatch, _model(tmp_path / "q8", TinySpec(matrix_type=T.Q8_0, layers=1)))
    assert dec.fused is None and dec.decode_path == "graphs (fused step: its block does not fit on one SM)"


def test_a_barrier_timeout_is_a_typed_error(fake, tmp_path, monkeypatch):
    dec = _fused(fake, monkeypatch, _model(tmp_path, TinySpec(matrix_type=T.Q8_0, layers=1)))
    cache = dec.new_cache(32)
    dec.forward([1], cache)
    step = dec._steps[cache]
    step.status[1] = 1  # what a barrier that waited too long leaves
    with pytest.raises(fake.fused.FusedStepError, match="HEARTH_CUDA_DECODE=graphs"):
        dec.greedy_step(2, cache)
    assert step.status[1] == 0  # cleared: the next step may run


SPECS = {
    "q8_0": dict(matrix_type=T.Q8_0),
    "q4_0-qwen2-bias": dict(arch="qwen2", qkv_bias=True, matrix_type=T.Q4_0),
    "q4_1-untied": dict(matrix_type=T.Q4_1, tied=False),
    "f32": dict(matrix_type=T.F32, layers=1),
    "q5_0": dict(matrix_type=T.Q5_0, layers=1),  # the fifth bits spread into dp4a's bytes
    "q5_1": dict(matrix_type=T.Q5_1, layers=1),
    # every matrix MXFP4, the embedding too (its row through dec_unit); 17-byte blocks at every alignment
    "mxfp4": dict(matrix_type=T.MXFP4, layers=1),
    # 256-wide rows for the K-quants; head_dim 64
    "q4_k": dict(matrix_type=T.Q4_K, hidden=256, ffn=512, heads=4, kv_heads=2, layers=1),
    "q5_k": dict(matrix_type=T.Q5_K, hidden=256, ffn=512, heads=4, kv_heads=2, layers=1),
    "q2_k": dict(matrix_type=T.Q2_K, hidden=256, ffn=256, heads=4, kv_heads=2, layers=1),
    "q3_k": dict(matrix_type=T.Q3_K, hidden=256, ffn=256, heads=4, kv_heads=2, layers=1),
    "q6_k": dict(matrix_type=T.Q6_K, hidden=256, ffn=256, heads=4, kv_heads=1, layers=1),
}


def _gemma(tmp_path):
    """post-norms, GeGLU, q/k norms, a window of 4 every other layer, soft-capped logits"""
    from engine.loader import load_model
    from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3

    path = tmp_path / "gemma.gguf"
    write_tiny_gemma3(path, TinyGemmaSpec(matrix_type=T.Q8_0, layers=2, pattern=2, final_softcap=3.0))
    return load_model(path).model


@pytest.mark.parametrize("kind", [*SPECS, "gemma3", "q8_0-splits", "gemma3-splits"])
def test_fused_step_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path, monkeypatch, kind):
    _kquant(monkeypatch)
    STATE.simt = simt
    name = kind.removesuffix("-splits")
    model = _gemma(tmp_path) if name == "gemma3" else _model(tmp_path, TinySpec(**SPECS[name]))
    blocks = 3 if kind == "q8_0" else 2
    if kind.endswith("-splits"):  # 8 blocks for 4 heads: each head's keys in 2 splits of up to 3
        monkeypatch.setattr(fake.fused, "SPLIT_KEYS", 3)
        blocks = 8
    dec = _fused(fake, monkeypatch, model, blocks=blocks)
    assert dec.decode_path == "fused" and dec.fused.max_splits == (2 if blocks == 8 else 1)
    cpu_cache, gpu_cache = model.new_cache(32), dec.new_cache(32, np.float32)
    prompt = [1, 2, 3, 4, 5]
    ref = model.forward(prompt, cpu_cache)
    dec.forward(prompt, gpu_cache)  # prefill: the per-op kernels
    token = int(np.argmax(ref[-1]))
    for _ in range(2):
        ref_step = model.forward([token], cpu_cache)
        got_step = dec.forward([token], gpu_cache)
        # activations as two int8 levels (15 bits), as good as the CPU kernels' int16 ones
        assert _rel(got_step, ref_step) < 1e-3, kind
        token = int(np.argmax(ref_step[-1]))
    assert dec.greedy_step(token, gpu_cache) == int(np.argmax(model.forward([token], cpu_cache)[-1]))
    assert fake.launches.count("decode_step") == 3


def test_fused_head_in_a_hybrid_decoder_on_host_threads(fake, simt, tmp_path, monkeypatch):
    """Partial offload with the fused step (HEARTH_CUDA_DECODE=fused): the GPU head (1 of 2 layers) hands
    its residual stream to the CPU layers, and the logits are the CPU model's; with a float16 KV cache
    the step stays close to the graph path's."""
    STATE.simt = simt
    model = _model(tmp_path, TinySpec(matrix_type=T.Q8_0))
    monkeypatch.setenv(fake.fused.ENV, "fused")
    monkeypatch.setattr(fake.fused, "THREADS", 64)
    monkeypatch.setattr(fake.ops, "_sm_count", lambda: 2)
    hyb = fake.hybrid.HybridDecoder(model, 1, n_ctx=32, prefill_dtype="float32")
    assert hyb.gpu.decode_path == "fused"
    cpu_cache, cache = model.new_cache(32), hyb.new_cache(32, np.float32)
    prompt = [3, 1, 4, 1, 5]
    token = int(np.argmax(model.forward(prompt, cpu_cache)[-1]))
    hyb.forward(prompt, cache)
    for _ in range(2):
        ref_step = model.forward([token], cpu_cache)
        assert _rel(hyb.forward([token], cache), ref_step) < 1e-3
        token = int(np.argmax(ref_step[-1]))
    # float16 cache: the fused head against the graph head on the same steps
    monkeypatch.delenv(fake.fused.ENV)
    heads = [_fused(fake, monkeypatch, model, n_layers=1)]
    heads.append(fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32", n_layers=1))
    caches = [h.new_cache(32, np.float16) for h in heads]
    for h, c in zip(heads, caches):
        h.hidden(prompt, c)
    for t in (7, 2):
        got, want = (h.hidden([t], c) for h, c in zip(heads, caches))
        assert _rel(got, want) < 1e-3
