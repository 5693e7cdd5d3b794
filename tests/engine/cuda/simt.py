"""A host build of the CUDA kernels that runs them as real thread blocks (test helper, no GPU).

kernels/*.cu are compiled with g++ after a light rewrite: each block runs its threads as std::threads
with a std::barrier for __syncthreads and a per-warp barrier for the shuffles; static `__shared__`
arrays become function-static storage, `extern __shared__ T name[]` a per-block buffer of `shared_mem`
bytes; halves convert in software; a warp's mma.sync (m16n8k16, float16 in, float32 accumulators)
gathers its lanes' fragments and multiplies on the host; atomics (atomicAdd, atomicExch, atomicMax on 64
bits), __threadfence, clock64 and __nanosleep have host versions (std::atomic_ref, lock-free: a thread
that spins on a volatile load never blocks another). __CUDA_ARCH__ is not defined: device-only code sits
in `#ifdef __CUDA_ARCH__ ... #else <host C++> #endif`. `launch(name, grid, block, args, shared_mem)`
takes the same arguments as a CuPy RawKernel call, with numpy arrays for device pointers. Slow (a thread
per CUDA thread) but faithful enough to check indexing, synchronisation and numerics of small launches
against the CPU kernels.

Two modes. By default (sequential) the blocks of a launch run one after another on `blockDim` host
threads. With `cooperative=True` every block runs at once, one host thread per CUDA thread of the
whole grid, each block with its own barriers, shuffle slots and dynamic shared memory: what a
persistent kernel with a software grid barrier (global-memory atomics) needs. Static `__shared__`
arrays are shared by all blocks (function statics), so a cooperative kernel must use dynamic shared
memory only. The whole grid is real threads: a few thousand is practical (each a kernel thread with
its own stack, every spinning one competing for the cores); a launch whose threads cannot all be
created raises RuntimeError instead of hanging. `Simt(workdir, extra_source=...)` appends test
kernels to the build.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from engine.backends.cuda import kernels

PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <latch>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>
struct dim3h { unsigned x = 0, y = 0, z = 0; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
// per host thread: its CUDA thread and block, and the block's barriers, shuffle slots and dynamic
// shared memory (in a cooperative launch every block has its own; sequentially the blocks share one)
static thread_local dim3h threadIdx, blockIdx;
static dim3h blockDim, gridDim;
static thread_local float* g_dyn_smem = nullptr;
static thread_local std::barrier<>* g_block_barrier = nullptr;
static thread_local std::vector<std::unique_ptr<std::barrier<>>>* g_warp_barriers = nullptr;
static thread_local uint64_t* g_shfl = nullptr;
static thread_local uint32_t* g_mma = nullptr;  // the block's mma fragment slots: 10 words a thread
static inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
template <typename T> static T __shfl_xor_sync(unsigned, T v, int o) {
    unsigned t = threadIdx.x, w = t >> 5;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    std::barrier<>& warp = *(*g_warp_barriers)[w];
    warp.arrive_and_wait();
    g_shfl[t] = bits;
    warp.arrive_and_wait();
    uint64_t got = g_shfl[t ^ o];
    warp.arrive_and_wait();
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max; using std::min;
// atomics on global memory: lock-free std::atomic_ref (sequentially consistent, as strong as CUDA's)
template <typename T> static inline T atomic_add_(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <typename T> static inline T atomic_exch_(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return atomic_add_(p, v); }
static inline int atomicAdd(int* p, int v) { return atomic_add_(p, v); }
static inline unsigned atomicExch(unsigned* p, unsigned v) { return atomic_exch_(p, v); }
static inline int atomicExch(int* p, int v) { return atomic_exch_(p, v); }
static inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
    std::atomic_ref<unsigned>(*p).compare_exchange_strong(cmp, v);
    return cmp;
}
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    std::atomic_ref<unsigned long long> a(*p);
    unsigned long long old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {}
    return old;
}
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline long long clock64() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}
static inline void __nanosleep(unsigned) { std::this_thread::yield(); }
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
"""

SOFT_HALF = r"""
__device__ __forceinline__ float h2f(ushort h) {
    int s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24)
            : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), e - 25);
    return s ? -v : v;
}
__device__ __forceinline__ ushort f2h(float f) {
    _Float16 h = (_Float16)f;  // round to nearest even, as cvt.rn.f16.f32
    ushort u;
    std::memcpy(&u, &h, 2);
    return u;
}
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 for the calling warp: every lane leaves its
// fragments (the PTX ISA's layout, g = lane / 4, c = lane % 4: a[0] = A[g][2c, 2c+1], a[1] = A[g+8][..],
// a[2] = A[g][2c+8, 2c+9], a[3] = A[g+8][2c+8, ..]; b0 = B[2c, 2c+1][g], b1 = B[2c+8, 2c+9][g];
// d = D[g][2c, 2c+1], D[g+8][2c, 2c+1]), the warp meets, each lane rebuilds A and B and computes its
// part of D = A B + D in float32, and the warp meets again before any lane reuses its slots.
static void host_mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    unsigned t = threadIdx.x, w = t >> 5;
    std::barrier<>& warp = *(*g_warp_barriers)[w];
    uint32_t* mine = g_mma + 10 * t;
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    warp.arrive_and_wait();
    float A[16][16], B[16][8];
    auto lo = [](uint32_t v) { return h2f((ushort)(v & 0xffffu)); };
    auto hi = [](uint32_t v) { return h2f((ushort)(v >> 16)); };
    for (int l = 0; l < 32; l++) {
        const uint32_t* f = g_mma + 10 * (32 * w + l);
        int g = l >> 2, c = l & 3;
        A[g][2 * c] = lo(f[0]); A[g][2 * c + 1] = hi(f[0]);
        A[g + 8][2 * c] = lo(f[1]); A[g + 8][2 * c + 1] = hi(f[1]);
        A[g][2 * c + 8] = lo(f[2]); A[g][2 * c + 9] = hi(f[2]);
        A[g + 8][2 * c + 8] = lo(f[3]); A[g + 8][2 * c + 9] = hi(f[3]);
        B[2 * c][g] = lo(f[4]); B[2 * c + 1][g] = hi(f[4]);
        B[2 * c + 8][g] = lo(f[5]); B[2 * c + 9][g] = hi(f[5]);
    }
    warp.arrive_and_wait();
    int g = (t & 31) >> 2, c = t & 3;
    int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * c, 2 * c + 1, 2 * c, 2 * c + 1};
    for (int i = 0; i < 4; i++) {
        float acc = d[i];
        for (int k = 0; k < 16; k++) acc += A[rows[i]][k] * B[k][cols[i]];
        d[i] = acc;
    }
}
"""

LAUNCHER = r"""
template <typename T> static T from_slot(uint64_t s) {
    if constexpr (std::is_pointer_v<T>) return reinterpret_cast<T>(s);
    else if constexpr (std::is_same_v<T, float>) {
        float f;
        uint32_t u = (uint32_t)s;
        std::memcpy(&f, &u, 4);
        return f;
    }
    else return (T)(int64_t)s;
}
template <typename... A, size_t... I>
static void call_slots(void (*k)(A...), const uint64_t* s, std::index_sequence<I...>) {
    k(from_slot<A>(s[I])...);
}
// what the threads of one block share
struct BlockState {
    std::barrier<> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<uint64_t> shfl;
    std::vector<uint32_t> mma;
    std::vector<float> dyn;
    BlockState(unsigned threads, size_t smem)
        : block(threads), shfl(threads, 0), mma(10 * threads, 0), dyn(smem / 4 + 1) {
        for (unsigned w = 0; w < (threads + 31) / 32; w++)
            warps.emplace_back(new std::barrier<>(std::min(32u, threads - 32 * w)));
    }
    void enter(unsigned t) {
        threadIdx = {t, 0, 0};
        g_block_barrier = &block;
        g_warp_barriers = &warps;
        g_shfl = shfl.data();
        g_mma = mma.data();
        g_dyn_smem = dyn.data();
    }
};
// 0: done; 2: the host could not create the launch's threads (none ran the kernel)
template <typename... A>
static int run(void (*k)(A...), const unsigned* grid, unsigned threads, size_t smem, const uint64_t* slots,
               int coop) {
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {threads, 1, 1};
    unsigned n_blocks = grid[0] * grid[1] * grid[2];
    auto block_index = [&](unsigned b) {
        return dim3h{b % grid[0], (b / grid[0]) % grid[1], b / (grid[0] * grid[1])};
    };
    std::vector<std::unique_ptr<BlockState>> blocks;
    for (unsigned b = 0; b < (coop ? n_blocks : 1u); b++) blocks.emplace_back(new BlockState(threads, smem));
    // the threads wait at the gate until all exist: the kernel runs on all of them or on none
    std::latch gate(1);
    std::atomic<bool> failed{false};
    auto sequential = [&](unsigned t) {
        // one host thread per CUDA thread of a block; blocks run one after another
        blocks[0]->enter(t);
        gate.wait();
        if (failed) return;
        for (unsigned b = 0; b < n_blocks; b++) {
            g_block_barrier->arrive_and_wait();  // the previous block is done (its shared memory is reused)
            blockIdx = block_index(b);
            call_slots(k, slots, std::index_sequence_for<A...>{});
        }
    };
    auto cooperative = [&](unsigned b, unsigned t) {
        // one host thread per CUDA thread of the grid, all blocks at once
        blocks[b]->enter(t);
        blockIdx = block_index(b);
        gate.wait();
        if (failed) return;
        call_slots(k, slots, std::index_sequence_for<A...>{});
    };
    std::vector<std::thread> ts;
    try {
        ts.reserve((size_t)threads * (coop ? n_blocks : 1u));
        for (unsigned b = 0; b < (coop ? n_blocks : 1u); b++)
            for (unsigned t = 0; t < threads; t++)
                coop ? ts.emplace_back(cooperative, b, t) : ts.emplace_back(sequential, t);
    } catch (const std::system_error&) {
        failed = true;
    }
    gate.count_down();
    for (auto& t : ts) t.join();
    return failed ? 2 : 0;
}
"""


# `extern "C" __global__ void [__launch_bounds__(N[, M])] name(` or `... name SOME_PARAMS` (a macro holding
# the parameter list, as matvec_qb's and matvec_qb_split's): the launchable kernels
KERNEL = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\(\s*\d+\s*(?:,\s*\d+\s*)?\) )?'
    r"(\w+)(?:\(| [A-Z_]+_PARAMS\b)"
)
# `extern __shared__ T name[];` -> this block's dynamic shared memory
DYN_SMEM = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];")


def _host_source(extra_source: str = "") -> tuple[str, list[str]]:
    common = (kernels._DIR / "common.cuh").read_text()
    # the PTX half conversions -> software ones
    common = re.sub(r"__device__ __forceinline__ float h2f\(ushort h\) \{.*?\n\}\n", "", common, flags=re.S)
    common = re.sub(r"__device__ __forceinline__ ushort f2h\(float f\) \{.*?\n\}\n", "", common, flags=re.S)
    head, tail = common.split("__device__ __forceinline__ float bf2f", 1)
    common = head + SOFT_HALF + "__device__ __forceinline__ float bf2f" + tail
    body = "\n".join([(kernels._DIR / n).read_text() for n in kernels.SOURCES] + [extra_source])
    body = DYN_SMEM.sub(r"\1* \2 = (\1*)g_dyn_smem;", body)
    body = body.replace('_Pragma("unroll")', "")
    names = KERNEL.findall(body)
    names += [f"matvec_{t}" for t in re.findall(r"^[QF]MATVEC\((\w+),", body, re.M)]
    names += [f"dequant_{t}" for t in re.findall(r"^FMATVEC\((\w+),", body, re.M)]
    # FMV_KERNELS pairs (FMATVEC's, and fp8's and nvfp4's): the one-vector kernel and the batch one
    pairs = re.findall(r"^FMATVEC\((\w+),", body, re.M) + re.findall(r"^FMV_KERNELS\((\w+),", body, re.M)
    names += [f"matvec_{t}_batch" for t in pairs]
    names += [f"matvec_{t}" for t in re.findall(r"^FMV_KERNELS\((\w+),", body, re.M)]
    names += [f"matvec_{t}_experts" for t in re.findall(r"^FMV_EXPERTS\((\w+)\)", body, re.M)]
    names = [n for n in names if not n.startswith("__")]
    entry = '{{"{n}", [](const unsigned* g, unsigned t, size_t m, const uint64_t* s, int c) '
    entry += "{{ return run({n}, g, t, m, s, c); }}}}"
    table = ",\n".join(entry.format(n=n) for n in names)
    driver = (
        "static const std::map<std::string, std::function<int(const unsigned*, unsigned, size_t, "
        "const uint64_t*, int)>> table = {\n" + table + "};\n"
        'extern "C" int simt_launch(const char* name, const unsigned* grid, unsigned threads, size_t smem,'
        " const uint64_t* slots, int coop) {\n auto it = table.find(name); if (it == table.end()) return 1;"
        " return it->second(grid, threads, smem, slots, coop); }\n"
    )
    return PRELUDE + common + body + LAUNCHER + driver, names


# source text -> the library built from it: test modules of one session share one build (seconds of g++)
_BUILT: dict[str, ctypes.CDLL] = {}


class Simt:
    """The compiled host build; `launch` runs one kernel."""

    def __init__(self, workdir: Path, extra_source: str = ""):
        """extra_source: more CUDA source (test kernels) compiled after the project's kernels; its
        `extern "C" __global__` kernels are launchable too."""
        gxx = shutil.which("g++")
        if gxx is None:
            raise FileNotFoundError("g++ not found")
        src, self.names = _host_source(extra_source)
        if src not in _BUILT:
            # one file name per source: dlopen would hand back an already loaded library of the same path
            path = Path(workdir) / f"simt_{hashlib.sha1(src.encode()).hexdigest()[:12]}.cpp"
            path.write_text(src)
            so = path.with_suffix(".so")
            proc = subprocess.run(
                [gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", str(so), str(path)],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                raise RuntimeError(proc.stderr[-4000:])
            _BUILT[src] = ctypes.CDLL(str(so))
        self.lib = _BUILT[src]
        self.lib.simt_launch.argtypes = [
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.c_uint,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_int,
        ]

    def launch(self, name: str, grid, block, args, shared_mem: int = 0, cooperative: bool = False) -> None:
        """Run kernel `name` to completion. cooperative: all blocks at once (see the module docstring)."""
        slots = np.zeros(max(1, len(args)), np.uint64)
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                slots[i] = a.ctypes.data
            elif isinstance(a, np.float32):
                slots[i] = int(np.array(a).view(np.uint32))
            elif isinstance(a, (np.int32, np.int64, np.uint64)):
                slots[i] = np.array(a).astype(np.int64).view(np.uint64)
            else:
                raise TypeError(f"{name}: argument {i} is {type(a).__name__}")
        g = np.ones(3, np.uint32)
        g[: len(grid)] = grid
        threads = int(np.prod(block))
        rc = self.lib.simt_launch(
            name.encode(), g.ctypes.data, threads, int(shared_mem), slots.ctypes.data, int(bool(cooperative))
        )
        if rc == 1:
            raise KeyError(name)
        if rc:
            n = threads * int(np.prod(g)) if cooperative else threads
            raise RuntimeError(f"{name}: could not start {n} host threads")
