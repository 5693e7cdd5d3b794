"""A host build of the CUDA kernels that runs them as real thread blocks (test helper, no GPU).

kernels/*.cu are compiled with g++ after a light rewrite: each block runs its threads as std::threads
with a std::barrier for __syncthreads and a per-warp barrier for the shuffles; block shared memory is
function-static storage (blocks run one after another); halves convert in software. `launch(name,
grid, block, shared_mem, args)` takes the same arguments as a CuPy RawKernel call, with numpy arrays
for device pointers. Slow (a thread per CUDA thread) but faithful enough to check indexing,
synchronisation and numerics of small launches against the CPU kernels.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from engine.backends.cuda import kernels

PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>
struct dim3h { unsigned x = 0, y = 0, z = 0; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static thread_local dim3h threadIdx;
static dim3h blockIdx, blockDim, gridDim;
static float* g_dyn_smem = nullptr;
static std::barrier<>* g_block_barrier = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
static std::vector<uint64_t> g_shfl;
static inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
template <typename T> static T __shfl_xor_sync(unsigned, T v, int o) {
    unsigned t = threadIdx.x, w = t >> 5;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    g_warp_barriers[w]->arrive_and_wait();
    g_shfl[t] = bits;
    g_warp_barriers[w]->arrive_and_wait();
    uint64_t got = g_shfl[t ^ o];
    g_warp_barriers[w]->arrive_and_wait();
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max; using std::min;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
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
template <typename... A>
static void run(void (*k)(A...), const unsigned* grid, unsigned threads, size_t smem, const uint64_t* slots) {
    std::vector<float> dyn(smem / 4 + 1);
    g_dyn_smem = dyn.data();
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {threads, 1, 1};
    g_shfl.assign(threads, 0);
    std::barrier<> block(threads);
    g_block_barrier = &block;
    g_warp_barriers.clear();
    for (unsigned w = 0; w < (threads + 31) / 32; w++)
        g_warp_barriers.emplace_back(new std::barrier<>(32));
    unsigned n_blocks = grid[0] * grid[1] * grid[2];
    // one host thread per CUDA thread for the whole launch; blocks run one after another
    auto body = [&](unsigned t) {
        threadIdx = {t, 0, 0};
        for (unsigned b = 0; b < n_blocks; b++) {
            block.arrive_and_wait();
            if (t == 0) blockIdx = {b % grid[0], (b / grid[0]) % grid[1], b / (grid[0] * grid[1])};
            block.arrive_and_wait();
            call_slots(k, slots, std::index_sequence_for<A...>{});
        }
    };
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; t++) ts.emplace_back(body, t);
    for (auto& t : ts) t.join();
}
"""


def _host_source() -> tuple[str, list[str]]:
    common = (kernels._DIR / "common.cuh").read_text()
    # the PTX half conversions -> software ones
    common = re.sub(r"__device__ __forceinline__ float h2f\(ushort h\) \{.*?\n\}\n", "", common, flags=re.S)
    common = re.sub(r"__device__ __forceinline__ ushort f2h\(float f\) \{.*?\n\}\n", "", common, flags=re.S)
    head, tail = common.split("__device__ __forceinline__ float bf2f", 1)
    common = head + SOFT_HALF + "__device__ __forceinline__ float bf2f" + tail
    body = "\n".join((kernels._DIR / n).read_text() for n in kernels.SOURCES)
    body = body.replace("extern __shared__ float sx[];", "float* sx = g_dyn_smem;")
    body = body.replace('_Pragma("unroll")', "")
    names = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', body)
    names += [
        f"{p}_{t}" for p in ("matvec", "dequant") for t in re.findall(r"^[QF]MATVEC\((\w+),", body, re.M)
    ]
    names = [n for n in names if not n.startswith("__")]
    entry = '{{"{n}", [](const unsigned* g, unsigned t, size_t m, const uint64_t* s) '
    entry += "{{ run({n}, g, t, m, s); }}}}"
    table = ",\n".join(entry.format(n=n) for n in names)
    driver = (
        "static const std::map<std::string, std::function<void(const unsigned*, unsigned, size_t, "
        "const uint64_t*)>> table = {\n" + table + "};\n"
        'extern "C" int simt_launch(const char* name, const unsigned* grid, unsigned threads, size_t smem,'
        " const uint64_t* slots) {\n auto it = table.find(name); if (it == table.end()) return 1;"
        " it->second(grid, threads, smem, slots); return 0; }\n"
    )
    return PRELUDE + common + body + LAUNCHER + driver, names


# source text -> the library built from it: test modules of one session share one build (seconds of g++)
_BUILT: dict[str, ctypes.CDLL] = {}


class Simt:
    """The compiled host build; `launch` runs one kernel."""

    def __init__(self, workdir: Path):
        gxx = shutil.which("g++")
        if gxx is None:
            raise FileNotFoundError("g++ not found")
        src, self.names = _host_source()
        if src not in _BUILT:
            path = Path(workdir) / "simt.cpp"
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
        ]

    def launch(self, name: str, grid, block, args, shared_mem: int = 0) -> None:
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
        rc = self.lib.simt_launch(name.encode(), g.ctypes.data, threads, int(shared_mem), slots.ctypes.data)
        if rc:
            raise KeyError(name)
