"""The small-batch linear kernels (engine.backends.cpu.smalln) a speculative verify pass runs on.

Held to the dequantize oracle like every linear path, and to bit-identity with the matvec kernel token
by token (float types too): that identity is what lets a batched verify pass reproduce a sequential
greedy decode exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends import cpu
from tests.engine.test_cpu_kernels import (
    ALL_TYPES,
    DECODE_REL,
    QUANTIZED,
    assert_linear_close,
    llm_like_activations,
    make_weight,
)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_small_batch_matches_dequantize_and_matvec(ggml_type):
    rng = np.random.default_rng(500 + int(ggml_type))
    cols = 512 if ggml_type in QUANTIZED else 520  # float rows: a column tail after the 16-lane vectors
    w, oracle = make_weight(ggml_type, 37, cols, rng)  # 37 rows: the 4-row group tail
    for n in (2, 3, 4, 5, 6, 8, 9, cpu.SMALL_BATCH_MAX):  # 4-token groups and their tails
        x = llm_like_activations(n, cols, rng)
        out = np.full((n, 37), np.nan, np.float32)
        cpu.linear(out, w, x)
        assert_linear_close(out, oracle, x, DECODE_REL if ggml_type in QUANTIZED else 1e-5)
        for t in range(n):
            one = np.empty((1, 37), np.float32)
            cpu.linear(one, w, x[t : t + 1])
            assert np.array_equal(one[0], out[t]), f"n={n} token {t} differs from its matvec"


def test_small_batch_runs_the_small_kernel_not_blas(monkeypatch):
    # Routing: 2..SMALL_BATCH_MAX tokens never dequantize the matrix; one more token does (prefill).
    import gguf

    rng = np.random.default_rng(7)
    w, _ = make_weight(gguf.GGMLQuantizationType.Q4_1, 8, 64, rng)
    calls = []
    matvec, dequant, view = cpu._KERNELS[w.ggml_type]

    def spy(*args):
        calls.append(len(args[2]))
        return dequant(*args)

    monkeypatch.setitem(cpu._KERNELS, w.ggml_type, (matvec, spy, view))
    for n, dequantized in ((2, False), (cpu.SMALL_BATCH_MAX, False), (cpu.SMALL_BATCH_MAX + 1, True)):
        calls.clear()
        cpu.linear(np.empty((n, 8), np.float32), w, rng.standard_normal((n, 64)).astype(np.float32))
        assert bool(calls) == dequantized, n


def test_small_batch_keeps_every_thread():
    n = cpu.get_threads()
    with cpu.batch_phase(cpu.SMALL_BATCH_MAX):
        assert cpu.get_threads() == n
    with cpu.batch_phase(cpu.SMALL_BATCH_MAX + 1):
        assert cpu.get_threads() == 1
    assert cpu.get_threads() == n


def test_a_pass_keeps_the_small_kernels_up_to_its_limit(monkeypatch):
    # batch_phase(n, limit): up to limit tokens the linears read the quantized rows (no dequantization),
    # every thread stays, and attention runs its kernels (whose bits match one-token steps); past it,
    # dequantize + BLAS on one Numba thread. The limit never drops below SMALL_BATCH_MAX.
    import gguf

    rng = np.random.default_rng(8)
    w, _ = make_weight(gguf.GGMLQuantizationType.Q4_1, 8, 64, rng)
    calls = []
    matvec, dequant, view = cpu._KERNELS[w.ggml_type]
    monkeypatch.setitem(cpu._KERNELS, w.ggml_type, (matvec, lambda *a: calls.append(1) or dequant(*a), view))
    threads = cpu.get_threads()
    for n, limit, small in ((30, 40, True), (40, 40, True), (41, 40, False), (16, 4, True), (17, 4, False)):
        calls.clear()
        x = rng.standard_normal((n, 64)).astype(np.float32)
        out = np.empty((n, 8), np.float32)
        with cpu.batch_phase(n, limit):
            cpu.linear(out, w, x)
            assert cpu.get_threads() == (threads if small else 1)
        assert (not calls) == small, (n, limit)
        if small:
            for t in range(n):
                one = np.empty((1, 8), np.float32)
                cpu.linear(one, w, x[t : t + 1])
                assert np.array_equal(one[0], out[t])
    assert cpu.get_threads() == threads
    cpu.linear(np.empty((30, 8), np.float32), w, rng.standard_normal((30, 64)).astype(np.float32))
    assert calls, "outside a pass the limit is SMALL_BATCH_MAX again"


def test_small_batch_limit_averages_the_types_crossovers_by_size():
    import gguf

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(9)
    from engine.backends.cpu.fpquant import FP8_E4M3
    from engine.weights import Weight

    q41, _ = make_weight(T.Q4_1, 64, 64, rng)
    q2k, _ = make_weight(T.Q2_K, 64, 256, rng)  # 4x q41's size
    fp8 = Weight(FP8_E4M3, np.zeros((64, 64), np.uint8), 64, 64)  # none listed: SMALL_BATCH_MAX
    c41, c2k = cpu.SMALL_BATCH_CROSSOVER[T.Q4_1], cpu.SMALL_BATCH_CROSSOVER[T.Q2_K]
    assert cpu.small_batch_limit([q41]) == c41
    assert cpu.small_batch_limit([fp8]) == cpu.SMALL_BATCH_MAX
    assert cpu.small_batch_limit([q41, q2k]) == int((c41 + 4 * c2k) / 5) != c41
    assert cpu.small_batch_limit([fp8, q41]) == int((cpu.SMALL_BATCH_MAX + c41) / 2)
    assert cpu.small_batch_limit([]) == cpu.SMALL_BATCH_MAX
