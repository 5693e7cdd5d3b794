"""MXFP4 weights (gpt-oss's type) on the CUDA backend, without a GPU: the kernels on host threads
(tests/engine/cuda/simt.py, over test_decoder_dry's stand-in CuPy) against the CPU backend.

MXFP4 blocks are 17 bytes (an E8M0 exponent, then 16 bytes of E2M1 codes), so consecutive blocks start
at every byte alignment and a row of cols = 32 * odd is an odd number of bytes: the widths here (288,
the tiny model's 96-wide down projection) keep both. The per-type kernel checks (float and integer-dot
matvec, dequant_qb) run in test_decoder_dry's parametrizations; the fused step in test_fused_step.
"""
# ruff: noqa: F811 - the stand-in CuPy fixtures are imported from test_decoder_dry

from __future__ import annotations

import numpy as np

from tests.engine.cuda.test_decoder_dry import (  # noqa: F401 - fixtures
    STATE,
    _rel,
    check_decoder_against_cpu,
    fake,
    ptx_params,
    simt,
)
from tests.engine.tiny_models import T, TinySpec, write_tiny_gguf

MXFP4 = 39


def _dense_check(out, dense, x, tol):
    # out (rows,) against the float64 product, within tol of |w_row|_1 max |x|
    ref = dense @ x.astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol * np.abs(dense).sum(1).max() * np.abs(x).max())


def test_int_dot_matvec_stacks_mxfp4_with_other_types_on_host_threads(fake, simt):
    """One matvec_qb launch over MXFP4 | Q8_0 | IQ4_NL rows of 288 columns (153-byte MXFP4 rows): the
    dense product, and the CPU's own kernels; the float kernel (int_dot=False) over MXFP4 alone too."""
    from engine.backends import cpu
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    cp, ops = fake.cp, fake.ops
    cols = 288
    stack = ((MXFP4, 19, 1), (8, 5, 2), (20, 8, 3))  # (type, rows, seed)
    parts = [gpu_tests._weight(t, rows, cols, seed) for t, rows, seed in stack]
    dense = np.concatenate([d for _, d in parts])
    ws = [ops.upload(w) for w, _ in parts]
    rng = np.random.default_rng(4)
    x = rng.standard_normal(cols).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    normed = x / np.sqrt(np.mean(x * x) + 1e-6) * nw
    out = cp.empty(32, cp.float32)
    ops.matvec(out, ws, cp.asarray(x), norm=cp.asarray(nw), eps=1e-6, prologue=1)
    _dense_check(out.get(), dense, normed, 1e-4)
    assert fake.launches == ["matvec_qb"]
    ref = np.empty((1, 19), np.float32)
    cpu.linear(ref, parts[0][0], x[None])
    for int_dot in (True, False):
        one = cp.empty(19, cp.float32)
        ops.matvec(one, ws[:1], cp.asarray(x), int_dot=int_dot)
        assert _rel(one.get(), ref[0]) < 1e-4  # both quantize x per 32 (15 and 16 bits) or not at all
        _dense_check(one.get(), parts[0][1], x, 1e-4 if int_dot else 2e-6)
    assert fake.launches[1:] == ["matvec_qb", "matvec_mxfp4"]


def test_batched_matvec_over_mxfp4_on_host_threads(fake, simt):
    """ops.matvec_batch over 10 vectors (launches of 8 and 2) of MXFP4 | Q8_0 rows gives each vector what
    ops.matvec gives it alone (integer dot products), with the SwiGLU prologue and accumulate; the
    float kernel's batch (int_dot=False) likewise."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    cp, ops = fake.cp, fake.ops
    cols, B = 96, 10
    parts = [gpu_tests._weight(t, rows, cols, seed) for t, rows, seed in ((MXFP4, 12, 5), (8, 4, 6))]
    ws = [ops.upload(w) for w, _ in parts]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B, 2 * cols)).astype(np.float32)  # [x | x2] rows
    base = rng.standard_normal((B, 20)).astype(np.float32)
    for int_dot in (True, False):
        stack = ws if int_dot else ws[:1]  # the float kernels stack weights of one type
        rows = sum(w.rows for w in stack)
        out = cp.asarray(base)
        kw = dict(prologue=2, accumulate=True, int_dot=int_dot)
        ops.matvec_batch(out, stack, cp.asarray(x), cols_x2=True, **kw)
        for b in range(B):
            one = cp.asarray(base[b, :rows])
            ops.matvec(one, stack, cp.asarray(x[b, :cols]), x2=cp.asarray(x[b, cols:]), **kw)
            np.testing.assert_allclose(out.get()[b, :rows], one.get(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(out.get()[:, rows:], base[:, rows:])


def test_decoder_with_mxfp4_ffn_matrices_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path):
    """A tiny llama whose FFN matrices are MXFP4 (the rest Q8_0) through the whole CUDA decoder: prefill,
    graph decode steps, the GPU argmax, a batched step of two sequences and partial offload (1 of 2
    layers) give the CPU model's logits; the graph path's matvecs are matvec_qb (integer dot products)
    with the hand-off between them."""
    from engine.loader import load_model

    STATE.simt = simt
    path = tmp_path / "mxfp4-ffn.gguf"
    ffn = tuple((f"blk.{i}.ffn_{m}.weight", T.MXFP4) for i in range(2) for m in ("gate", "up", "down"))
    write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, heads=2, kv_heads=1, types=ffn))
    model = load_model(path).model
    assert model.layers[1].w_down.ggml_type == MXFP4 and model.layers[1].w_down.raw.shape[1] == 51
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert dec.batchable and dec.decode_path == "graphs"
    plan, _ = dec._handoff_plan()
    assert all(p["gu"] and p["down"] for p in plan)  # records into and out of the MXFP4 stacks
    steps = check_decoder_against_cpu(fake, model, dec, [1, 2, 3])
    assert {n for n in steps if n.startswith("matvec")} == {"matvec_qb"}
