"""Time the vision towers' GELU forms on one SigLIP-896 layer's MLP activation (4096 patches x 4304), the
numpy / libm-erf forms they replaced beside the Numba kernels they use now: best of 3, and the largest
difference. Usage: .venv/bin/python scripts/bench_activations.py [ROWS COLS]"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402, F401  (sets NUMBA_CACHE_DIR before the kernels compile)
from engine.backends.cpu.ops import gelu_erf_fast  # noqa: E402
from engine.vision.tower import gelu_quick, gelu_tanh  # noqa: E402


def numpy_tanh(x):
    t = x * x
    t *= np.float32(0.044715)
    t += np.float32(1.0)
    t *= x
    t *= np.float32(np.sqrt(2.0 / np.pi))
    np.tanh(t, out=t)
    t += np.float32(1.0)
    x *= t
    x *= np.float32(0.5)
    return x


def numpy_quick(x):
    x *= 1.0 / (1.0 + np.exp(np.float32(-1.702) * x))
    return x


@numba.njit(fastmath=True)
def libm_erf(x):
    n, m = x.shape
    for r in range(n):
        for j in range(m):
            v = x[r, j]
            x[r, j] = np.float32(0.5) * v * (np.float32(1.0) + math.erf(v * np.float32(0.7071067811865476)))
    return x


def fast_erf(x):
    gelu_erf_fast(x)
    return x


def best(f, base) -> float:
    times = []
    for _ in range(3):
        x = base.copy()
        t = time.perf_counter()
        f(x)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    rows, cols = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4096, 4304)
    base = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 3
    for old, new in ((numpy_tanh, gelu_tanh), (numpy_quick, gelu_quick), (libm_erf, fast_erf)):
        old(base[:8].copy()), new(base[:8].copy())  # compile
        diff = np.abs(old(base.copy()) - new(base.copy())).max()
        print(f"{new.__name__:>10}: {best(old, base) * 1e3:7.1f} ms -> {best(new, base) * 1e3:6.1f} ms  "
              f"(max difference {diff:.1e})")


if __name__ == "__main__":
    main()
