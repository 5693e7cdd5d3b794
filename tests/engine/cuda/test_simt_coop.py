"""tests/engine/cuda/simt.py's cooperative mode: every block of a launch at once, so a kernel can
synchronise the whole grid with a software barrier on global-memory atomics (as the persistent decode
kernel does), each block with its own dynamic shared memory; and the host atomics, fence and clocks."""

from __future__ import annotations

import numpy as np
import pytest

BLOCKS, THREADS, ROUNDS = 4, 64, 3

# A test kernel in CUDA syntax (the host build compiles it after the project's kernels)
PROBE = r"""
// sync[0]: arrivals, sync[1]: generation; flags[2]: set when a wait gave up (instead of hanging the test)
__device__ void probe_grid_sync(uint* sync, int* flags, int sleep) {
    __syncthreads();
    if (threadIdx.x == 0) {
        uint g = *(volatile uint*)&sync[1];  // cannot move before this block arrives
        __threadfence();
        if (atomicAdd(&sync[0], 1u) == gridDim.x - 1) {
            atomicExch(&sync[0], 0u);
            __threadfence();
            atomicExch(&sync[1], g + 1);
        } else {
            long long t0 = clock64();
            while (*(volatile uint*)&sync[1] == g) {
                if (sleep) __nanosleep(100);
                if (clock64() - t0 > 20000000000LL) {  // 20 s of nanoseconds: a block never arrived
                    atomicExch(&flags[2], 1);
                    break;
                }
            }
        }
        __threadfence();
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(64, 1) coop_probe(
    float* out, float* sums, float* seen, uint* sync, unsigned long long* best, int* flags, int sleep) {
    extern __shared__ float tile[];
    int b = blockIdx.x, t = threadIdx.x, n = blockDim.x, nb = gridDim.x;
    tile[t] = (float)(1000 * b + t);  // this block's shared memory, read back after the last barrier
    long long c0 = clock64();
    for (int r = 0; r < 3; r++) {
        out[(r * nb + b) * n + t] = (float)((b + 1) * (t + 1) + r);
        probe_grid_sync(sync, flags, sleep);
        float s = 0.f;
        for (int o = 0; o < nb; o++)
            if (o != b) s += out[(r * nb + o) * n + t];  // what the other blocks wrote this round
        sums[(r * nb + b) * n + t] = s;
    }
    __syncthreads();
    seen[b * n + t] = tile[(t + 1) % n];
    atomicMax(best, ((unsigned long long)(b + 1) << 32) | (unsigned long long)(t ^ 5));
    atomicAdd(&flags[0], 1);
    if (clock64() < c0) atomicExch(&flags[3], 1);
    if (b == 0 && t == 0) {
#ifdef __CUDA_ARCH__
        flags[1] = 1;
#else
        flags[1] = 2;
#endif
    }
}
"""


@pytest.fixture(scope="module")
def simt(tmp_path_factory):
    from tests.engine.cuda.simt import Simt

    try:
        return Simt(tmp_path_factory.mktemp("simt_coop"), extra_source=PROBE)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_the_launch_table_takes_two_argument_launch_bounds(simt):
    assert "coop_probe" in simt.names


@pytest.mark.parametrize("sleep", [0, 1], ids=["busy-spin", "nanosleep"])
def test_cooperative_blocks_run_together_with_a_grid_barrier(simt, sleep):
    out = np.zeros((ROUNDS, BLOCKS, THREADS), np.float32)
    sums = np.zeros_like(out)
    seen = np.zeros((BLOCKS, THREADS), np.float32)
    sync = np.zeros(2, np.uint32)
    best = np.array([1 << 32], np.uint64)  # below every candidate
    flags = np.zeros(4, np.int32)
    args = (out, sums, seen, sync, best, flags, np.int32(sleep))
    simt.launch("coop_probe", (BLOCKS,), (THREADS,), args, shared_mem=THREADS * 4, cooperative=True)

    assert flags[2] == 0, "a grid barrier wait gave up"
    b = np.arange(BLOCKS)[None, :, None]
    t = np.arange(THREADS)[None, None, :]
    r = np.arange(ROUNDS)[:, None, None]
    want_out = ((b + 1) * (t + 1) + r).astype(np.float32)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(sums, want_out.sum(axis=1, keepdims=True) - want_out)
    assert list(sync) == [0, ROUNDS]  # every barrier completed, the count reset
    # each block saw its own shared memory, not the last block's
    own = 1000 * np.arange(BLOCKS)[:, None] + (np.arange(THREADS) + 1) % THREADS
    np.testing.assert_array_equal(seen, own)
    assert int(best[0]) == (BLOCKS << 32) | max(i ^ 5 for i in range(THREADS))
    assert flags[0] == BLOCKS * THREADS  # int atomicAdd from every thread
    assert flags[1] == 2  # the host build compiles the #else branch of #ifdef __CUDA_ARCH__
    assert flags[3] == 0  # clock64 never went back


def test_atomic_max_keeps_a_larger_value(simt):
    best = np.array([(99 << 32) | 1], np.uint64)
    flags = np.zeros(4, np.int32)
    out = np.zeros((ROUNDS, 1, 32), np.float32)
    seen, sync = np.zeros((1, 32), np.float32), np.zeros(2, np.uint32)
    args = (out, np.zeros_like(out), seen, sync, best, flags, np.int32(0))
    simt.launch("coop_probe", (1,), (32,), args, shared_mem=32 * 4, cooperative=True)
    assert int(best[0]) == (99 << 32) | 1 and flags[0] == 32 and flags[2] == 0


def test_sequential_mode_runs_blocks_one_after_another(simt):
    """Without cooperative the blocks run in turn (a grid barrier of several blocks would never
    complete); a one-block launch of the probe works there too."""
    out = np.zeros((ROUNDS, 1, THREADS), np.float32)
    flags = np.zeros(4, np.int32)
    sync = np.zeros(2, np.uint32)
    best = np.zeros(1, np.uint64)
    args = (out, np.zeros_like(out), np.zeros((1, THREADS), np.float32), sync, best, flags, np.int32(0))
    simt.launch("coop_probe", (1,), (THREADS,), args, shared_mem=THREADS * 4)
    assert list(sync) == [0, ROUNDS] and flags[0] == THREADS and flags[2] == 0
    assert int(best[0]) == (1 << 32) | 63
