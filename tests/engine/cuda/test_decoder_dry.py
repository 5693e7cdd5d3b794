"""The CUDA decoder's host code run against a stand-in CuPy (numpy arrays, kernels that only check
their arguments), so the launch code is exercised without a GPU.

Every launch is checked against the kernel's parameter list as NVRTC compiled it (.param types in
the PTX): the argument count, pointers for pointers, np.int32 for int, np.float32 for float (a plain
Python int or float would reach the GPU as a 64-bit value), block sizes, dynamic shared memory. The
decoder's control flow (prefill, graph capture, greedy and sampled steps, cache switches, the bench)
runs end to end; the numbers it produces are meaningless, what matters is that nothing mismatches.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tests.engine.cuda.test_kernels_gpu import ATTENTION_CASES
from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3
from tests.engine.tiny_models import T, TinySpec, write_tiny_gguf


class FakeArray(np.ndarray):
    """numpy with CuPy's set/get and data.ptr (the host address: what the host-thread kernels use)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def set(self, a, stream=None):
        self[...] = a

    def get(self, stream=None):
        return np.array(self)


def _wrap(a):
    return np.asarray(a).view(FakeArray)


# the stand-in device's attributes, by cudaDeviceAttr: an H200's SM count and opt-in shared memory a block
DEVICE_ATTRIBUTES = {16: 132, 97: 227 * 1024}

# kernel handle -> dynamic shared memory it was allowed through cuda.driver.funcSetAttribute
SHARED_ALLOWED: dict[int, int] = {}

# capture: the launches a stand-in stream records between begin_capture and end_capture (None: run
# them now); simt: a tests.engine.cuda.simt.Simt that executes kernels on the host (None: check only)
STATE = types.SimpleNamespace(capture=None, simt=None)


class FakeKernel:
    def __init__(self, name: str, params: list[str], launches: list):
        self.name, self.params, self.launches = name, params, launches
        # CuPy's RawKernel: .kernel is the cuda.function.Function, whose ptr the driver calls take
        self.kernel = types.SimpleNamespace(ptr=id(self))

    def __call__(self, grid, block, args, shared_mem=0):
        where = f"{self.name}{tuple(grid)}x{tuple(block)}"
        assert len(args) == len(self.params), f"{where}: {len(args)} args for {len(self.params)} params"
        for i, (a, p) in enumerate(zip(args, self.params)):
            if isinstance(a, np.ndarray):
                assert p == "u64", f"{where}: arg {i} is an array for a .{p} parameter"
                # rmsnorm and delta_conv take rows ld apart (column slices of wider rows), rows contiguous
                sliced = self.name in ("rmsnorm", "delta_conv")
                rows = sliced and a.ndim == 2 and a.strides[1] == a.itemsize
                assert a.flags.c_contiguous or rows, f"{where}: arg {i} is not contiguous"
            elif isinstance(a, (np.uint64, np.int64)):
                assert p == "u64", f"{where}: arg {i} is 64-bit for a .{p} parameter"
            elif isinstance(a, np.int32):
                assert p == "u32", f"{where}: arg {i} is int32 for a .{p} parameter"
            elif isinstance(a, np.float32):
                assert p == "f32", f"{where}: arg {i} is float32 for a .{p} parameter"
            else:
                pytest.fail(f"{where}: arg {i} is {type(a).__name__} (needs a numpy scalar or an array)")
        assert all(int(g) >= 1 for g in grid) and len(grid) <= 3
        assert 1 <= int(np.prod(block)) <= 1024 and int(np.prod(block)) % 32 == 0, where
        if self.name.startswith("matvec_"):  # matvec_qb counts on it (step.cu's MV_WARPS)
            assert tuple(block) == (256,), where
        assert shared_mem <= max(48 * 1024, SHARED_ALLOWED.get(self.kernel.ptr, 0)), where
        assert shared_mem <= DEVICE_ATTRIBUTES[97], where  # the device's limit
        self.launches.append(self.name)
        call = (self.name, tuple(grid), tuple(block), tuple(args), shared_mem)
        if STATE.capture is not None:  # the graph holds the arguments, as a real one holds their memory
            STATE.capture.append(call)
        elif STATE.simt is not None:
            _execute(call)


def _execute(call) -> None:
    if callable(call[0]):  # a cuBLAS call recorded in a capture
        call[0](*call[1])
        return
    name, grid, block, args, shared_mem = call
    # the fused decode step's blocks meet at grid barriers: they must all run at once
    STATE.simt.launch(name, grid, block, args, shared_mem, cooperative=name == "decode_step")


def _host_matrix(ptr: int, dtype, rows: int, ld: int, cols: int) -> np.ndarray:
    """The row-major (rows, cols) matrix at host address ptr with leading dimension ld (a view)."""
    itemsize = np.dtype(dtype).itemsize
    buf = (ctypes.c_uint8 * (((rows - 1) * ld + cols) * itemsize)).from_address(ptr)
    flat = np.frombuffer(buf, dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (ld * itemsize, itemsize))


def _gemm_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c, ctype, ldc,
             compute, algo):
    """cublasGemmEx's column-major contract on host memory: C (m, n) = alpha op(A) op(B) + beta C."""
    types = {0: np.float32, 2: np.float16}
    assert compute == 68 and algo == -1 and ctype == 0
    # a column-major (r, c) matrix with leading dimension ld is the row-major (c, ld)[:, :r] transposed
    op_a = _host_matrix(a, types[atype], m, lda, k) if transa else _host_matrix(a, types[atype], k, lda, m).T
    op_b = _host_matrix(b, types[btype], k, ldb, n) if transb else _host_matrix(b, types[btype], n, ldb, k).T
    c_t = _host_matrix(c, np.float32, n, ldc, m)  # C transposed, writable
    al, be = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
    c_t[...] = (al * (op_a.astype(np.float32) @ op_b.astype(np.float32)) + be * c_t.T).T


def _sgemm_strided_batched(
    handle, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c, batch
):
    """cublasSgemmStridedBatched's contract on host memory: cublasGemmEx's per batch, float32 only."""
    for i in range(batch):
        a_i, b_i, c_i = a + 4 * i * stride_a, b + 4 * i * stride_b, c + 4 * i * stride_c
        _gemm_ex(handle, transa, transb, m, n, k, alpha, a_i, 0, lda, b_i, 0, ldb, beta, c_i, 0, ldc, 68, -1)


def _gemm_strided_batched_ex(
    handle, transa, transb, m, n, k, alpha, a, atype, lda, stride_a, b, btype, ldb, stride_b, beta,
    c, ctype, ldc, stride_c, batch, compute, algo,
):
    """cublasGemmStridedBatchedEx's contract on host memory: cublasGemmEx's per batch (strides in
    elements of each operand's type)."""
    size = {0: 4, 2: 2}
    for i in range(batch):
        a_i, b_i = a + size[atype] * i * stride_a, b + size[btype] * i * stride_b
        c_i = c + size[ctype] * i * stride_c
        operands = (a_i, atype, lda, b_i, btype, ldb, beta, c_i, ctype, ldc)
        _gemm_ex(handle, transa, transb, m, n, k, alpha, *operands, compute, algo)


def _fake_cupy():
    cp = types.ModuleType("cupy")
    for name in ("float16", "float32", "int32", "uint8", "uint32", "uint64"):
        setattr(cp, name, np.dtype(name).type)
    cp.ndarray = FakeArray
    cp.empty = lambda shape, dtype=np.float32: _wrap(np.zeros(shape, dtype))  # no NaN warnings
    cp.zeros = lambda shape, dtype=np.float32: _wrap(np.zeros(shape, dtype))
    cp.ones = lambda shape, dtype=np.float32: _wrap(np.ones(shape, dtype))
    cp.asarray = lambda a, dtype=None: _wrap(np.array(a, dtype=dtype))
    cp.ascontiguousarray = lambda a: _wrap(np.ascontiguousarray(a))
    cp.asnumpy = lambda a, stream=None: np.array(a)
    cp.matmul = lambda a, b: _wrap(np.matmul(a, b))
    cp.stack = lambda arrays: _wrap(np.stack(arrays))
    cp.concatenate = lambda arrays, axis=0: _wrap(np.concatenate(arrays, axis=axis))
    cp.empty_like = lambda a: _wrap(np.zeros_like(a))
    cp.copyto = np.copyto
    pool = types.SimpleNamespace(free_all_blocks=lambda: None, used_bytes=lambda: 0, free_bytes=lambda: 0)
    cp.get_default_memory_pool = lambda: pool

    class Device(contextlib.AbstractContextManager):
        def __init__(self, index=0):
            self.id = index
            self.compute_capability = "90"
            self.attributes = {
                "MemoryClockRate": 3_200_000, "GlobalMemoryBusWidth": 6144, "L2CacheSize": 60 << 20
            }

        def __exit__(self, *exc):
            return None

        def synchronize(self):
            pass

    class Graph:
        def __init__(self, launches):
            self.launches = launches

        def launch(self, stream=None):
            for call in self.launches:
                if STATE.simt is not None or callable(call[0]):
                    _execute(call)

    class Stream(contextlib.AbstractContextManager):
        captures = []

        def __init__(self, non_blocking=False):
            pass

        def __exit__(self, *exc):
            return None

        def begin_capture(self):
            Stream.captures.append("begin")
            STATE.capture = []

        def end_capture(self):
            Stream.captures.append("end")
            calls, STATE.capture = STATE.capture or [], None
            return Graph(calls)

        def synchronize(self):
            pass

        def is_capturing(self):
            return STATE.capture is not None

        ptr = 0

    runtime = types.SimpleNamespace(
        memGetInfo=lambda: (80 << 30, 80 << 30),
        getDeviceCount=lambda: 1,
        cudaDevAttrMultiProcessorCount=16,
        cudaDevAttrMaxSharedMemoryPerBlockOptin=97,
        deviceGetAttribute=lambda attr, dev: DEVICE_ATTRIBUTES[attr],
        getDeviceProperties=lambda dev: {"name": b"Fake GPU"},
    )
    memory = types.SimpleNamespace(OutOfMemoryError=MemoryError)
    nvrtc = types.SimpleNamespace(getVersion=lambda: (12, 9))
    driver = types.SimpleNamespace(
        occupancyMaxActiveBlocksPerMultiprocessor=lambda func, threads, smem: 1,
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
        funcSetAttribute=lambda func, attr, value: SHARED_ALLOWED.__setitem__(func, value),
    )
    cublas = types.SimpleNamespace(
        gemmEx=_gemm_ex,
        sgemmStridedBatched=_sgemm_strided_batched,
        gemmStridedBatchedEx=_gemm_strided_batched_ex,
        setPointerMode=lambda handle, mode: None,
    )
    cp.cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, runtime=runtime, memory=memory, Graph=Graph, nvrtc=nvrtc, driver=driver,
        cublas=cublas, device=types.SimpleNamespace(get_cublas_handle=lambda: 0),
        get_current_stream=Stream, using_allocator=lambda allocator=None: contextlib.nullcontext(),
        MemoryPool=lambda: types.SimpleNamespace(malloc=None),
    )
    return cp


# the backend's modules that import CuPy: imported afresh over the stand-in, dropped after
CUPY_MODULES = (
    "engine.backends.cuda.ops",
    "engine.backends.cuda.fused",
    "engine.backends.cuda.decoder",
    "engine.backends.cuda.hybrid",
    "engine.backends.cuda.bench",
)


def test_layer_kinds_without_cuda_kernels_stay_on_the_cpu(fake, tmp_path):
    """A residual multiplier with branch-output norms, Gemma 3n/4 and DeepSeek's latent attention have no
    CUDA path:
    a typed error, which placement turns into the CPU fallback."""
    model = _model(tmp_path, "llama")
    model.cfg.residual_multiplier = 0.5
    model.layers[0].post_ffn_norm = model.layers[0].ffn_norm  # GLM-4's norm of the FFN output
    with pytest.raises(fake.decoder.UnsupportedCudaModelError, match="residual multiplier"):
        fake.decoder.CudaDecoder(model, n_ctx=64)
    from engine.loader import load_model

    tiny = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
    for family, message in (("gemma4", "not Gemma4Model"), ("gemma3n", "not Gemma3nModel"),
                            ("deepseek_v3", "latent attention")):
        with pytest.raises(fake.decoder.UnsupportedCudaModelError, match=message):
            fake.decoder.CudaDecoder(load_model(tiny / family).model, n_ctx=64)


@pytest.fixture(scope="module")
def ptx_params(module_ptx) -> dict[str, list[str]]:
    return {
        m.group(1): re.findall(r"\.param\s+\.(\w+)", m.group(2))
        for m in re.finditer(r"\.entry\s+(\w+)\(([^)]*)\)", module_ptx)
    }


@pytest.fixture
def fake(monkeypatch, ptx_params):
    """engine.backends.cuda.{ops,decoder,bench} imported over the stand-in CuPy."""
    cp = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    for mod in CUPY_MODULES:
        monkeypatch.delitem(sys.modules, mod, raising=False)
    ops = importlib.import_module("engine.backends.cuda.ops")
    launches: list[str] = []
    made: dict[str, FakeKernel] = {}

    def kernel(name, device_id=0):
        assert name in ptx_params, f"no kernel {name!r} in the compiled module"
        return made.setdefault(name, FakeKernel(name, ptx_params[name], launches))

    monkeypatch.setattr(ops, "kernel", kernel)

    def capture_blas(stream_ptr):  # cuBLAS calls in a capture: recorded, run when the graph is
        def recorded(fn):
            return lambda *args: STATE.capture.append((fn, args))

        return types.SimpleNamespace(
            gemmEx=recorded(_gemm_ex),
            sgemmStridedBatched=recorded(_sgemm_strided_batched),
            gemmStridedBatchedEx=recorded(_gemm_strided_batched_ex),
            setPointerMode=lambda handle, mode: None,
        )

    monkeypatch.setattr(ops.capture_blas, "api", capture_blas)
    # programmatic dependent launches (HEARTH_CUDA_PDL): the stand-in runs them as plain launches (the
    # kernels' griddepcontrol instructions are sm_90 PTX; host threads run one launch at a time anyway)
    def pdl_launch(k, grid, block, args, shared, stream):
        k(grid, block, args, shared_mem=shared)

    monkeypatch.setattr(ops.pdl, "launch", pdl_launch)
    # before the decoder: `from engine.backends.cuda import fused` would take the package attribute,
    # which still holds an earlier test's module
    fused = importlib.import_module("engine.backends.cuda.fused")
    decoder = importlib.import_module("engine.backends.cuda.decoder")
    bench = importlib.import_module("engine.backends.cuda.bench")
    hybrid = importlib.import_module("engine.backends.cuda.hybrid")
    yield types.SimpleNamespace(
        cp=cp, ops=ops, decoder=decoder, bench=bench, hybrid=hybrid, fused=fused, launches=launches
    )
    STATE.simt = STATE.capture = None
    for mod in CUPY_MODULES:
        sys.modules.pop(mod, None)


def _model(tmp_path, kind: str):
    from engine.loader import load_model

    path = tmp_path / f"{kind}.gguf"
    if kind == "gemma3":
        write_tiny_gemma3(path, TinyGemmaSpec(matrix_type=T.Q8_0, final_softcap=3.0))
    elif kind == "gemma3-2layer":  # Gemma's hand-off: the post-norms emit the next norm's records
        write_tiny_gemma3(path, TinyGemmaSpec(matrix_type=T.Q8_0, final_softcap=3.0, layers=2))
    elif kind == "llama-1layer":
        # head size 32: attention hands its output to wo as records (ops.attention's records)
        write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, layers=1, heads=2, kv_heads=1))
    elif kind == "llama-mixed":  # float16 matrices among Q8_0 ones: the hand-off where both ends allow it
        f16 = (("blk.0.ffn_down.weight", T.F16), ("blk.1.attn_output.weight", T.F16))
        write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, heads=2, kv_heads=1, types=f16))
    elif kind == "qwen2":
        write_tiny_gguf(path, TinySpec(arch="qwen2", qkv_bias=True))
    else:
        write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0))
    return load_model(path).model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_decoder_launches_match_the_kernels(fake, tmp_path, kind):
    model = _model(tmp_path, kind)
    seen = []
    dec = fake.decoder.CudaDecoder(model, n_ctx=64, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == dec.weight_bytes
    cache = dec.new_cache(64)
    logits = dec.forward([1, 2, 3, 4, 5], cache)
    assert logits.shape == (1, model.cfg.vocab_size) and cache.offset == 5
    prefill = set(fake.launches)
    # prefill: attention as GEMMs around the masked softmax (the split-K kernels are decode's)
    assert {"rope_store", "softmax_causal", "rmsnorm", "glu"} <= prefill and "attn_decode" not in prefill
    fake.launches.clear()
    dec.forward([6], cache)  # decode: warm-up launches, then the captured graph
    assert fake.cp.cuda.Stream.captures[-2:] == ["begin", "end"] and cache.offset == 6
    per_step = len(fake.launches) // 2
    n_layers = model.cfg.num_hidden_layers
    # a layer: q|k|v, attention (RoPE and cache write inside), wo, gate|up, down; Qwen2 adds its biases,
    # Gemma 3 its two post-norms; then the embedding row, the logits (Gemma 3: and their soft-cap)
    per_layer, head = {"llama": (5, 2), "qwen2": (6, 2), "gemma3": (7, 3)}[kind]
    assert per_step == per_layer * n_layers + head, fake.launches[:per_step]
    token = dec.greedy_step(3, cache)
    assert 0 <= token < 2**31 and cache.offset == 7
    dec.sample_step(3, cache, temp=0.8, top_k=40, top_p=0.9, u=0.5, min_p=0.05)
    assert cache.offset == 8
    all_logits = dec.forward([1, 2, 3], cache, all_logits=True)
    assert all_logits.shape == (3, model.cfg.vocab_size)
    dec.use_graphs = False
    dec.forward([7], dec.new_cache(16))  # another cache, plain launches


def test_bench_and_vram_error(fake, tmp_path, monkeypatch):
    model = _model(tmp_path, "llama")
    dec = fake.decoder.CudaDecoder(model, n_ctx=64)
    r = fake.bench.bench_decoder(dec, [1, 2, 3, 4], 3, 64, repetitions=1)
    assert r["peak_bandwidth_gbs"] == pytest.approx(3_200_000 * 1e3 * 2 * 6144 / 8 / 1e9)
    assert r["decode_bytes_per_token"] > dec.decode_weight_bytes > 0
    from engine.backends.cuda.device import CudaOutOfMemoryError

    monkeypatch.setattr(fake.cp.cuda.runtime, "memGetInfo", lambda: (1 << 20, 1 << 30))
    with pytest.raises(CudaOutOfMemoryError):
        fake.decoder.CudaDecoder(model, n_ctx=64)


def test_serve_counts_the_kv_caches_the_gpu_holds(fake, tmp_path, monkeypatch, capsys):
    """hearth serve on CUDA: each concurrent request takes a KV cache of --ctx positions (and its decode
    scratch) on the GPU, so the server says how many fit, warns below --max-seqs and refuses to start
    when none does (the load's estimate counts a single cache)."""
    import argparse

    from engine.commands_server import _check_gpu_room
    from engine.server.errors import ServeError

    model = _model(tmp_path, "llama")
    dec = fake.decoder.CudaDecoder(model, n_ctx=64)
    cache = dec.new_cache(256, np.float16)
    each = dec.cache_bytes(256, np.float16)
    assert each >= cache.k.nbytes + cache.v.nbytes
    assert dec.cache_bytes(256, np.float32) - each == cache.k.nbytes + cache.v.nbytes
    dec.forward([1, 2], cache)
    dec.forward([3], cache)  # its decode step's buffers count too: activations, logits, records
    step = vars(dec._steps[cache])
    arrays = [a for v in step.values() for a in (v if isinstance(v, list) else [v]) if hasattr(a, "nbytes")]
    assert each - cache.k.nbytes - cache.v.nbytes >= sum(a.nbytes for a in arrays) > 4 * model.cfg.vocab_size
    free = fake.decoder.MARGIN_BYTES + 5 * each + each // 2
    monkeypatch.setattr(fake.cp.cuda.runtime, "memGetInfo", lambda: (free, 1 << 40))
    assert dec.caches_that_fit(256, np.float16) == 5
    args = argparse.Namespace(ctx=256, max_seqs=4)
    _check_gpu_room(dec, args, np.float16)
    out = capsys.readouterr().out
    assert "room for 5 concurrent" in out and "warning" not in out
    args.max_seqs = 16
    _check_gpu_room(dec, args, np.float16)
    assert "warning: only 5 requests can run at once" in capsys.readouterr().out
    monkeypatch.setattr(fake.cp.cuda.runtime, "memGetInfo", lambda: (fake.decoder.MARGIN_BYTES, 1 << 40))
    with pytest.raises(ServeError, match="no room left for one request's KV cache.*--ctx"):
        _check_gpu_room(dec, args, np.float16)
    _check_gpu_room(model, args, np.float16)  # a CPU model: nothing to check or say
    assert capsys.readouterr().out == ""


def test_gpu_memory_running_out_is_a_typed_error_and_loses_nothing(fake, tmp_path, monkeypatch):
    """CuPy's out-of-memory error in a prefill, a decode step or a new KV cache comes out as
    CudaMemoryExhaustedError saying what ran out and what to do (it reaches the app typed, through the
    worker's error payload, and is a MemoryError as CuPy's is); the cache is not advanced, the kept
    captures are dropped for the retry, and the same decoder works once memory is there again."""
    from engine.backends.cuda.device import CudaMemoryExhaustedError
    from engine.client import _rebuild_error, error_payload

    model = _model(tmp_path, "llama")
    dec = fake.decoder.CudaDecoder(model, n_ctx=64)
    cache = dec.new_cache(64)
    dec.forward([1, 2, 3], cache)
    cache.trim(cache.offset)
    dec.forward([1, 2, 3], cache)  # a new chat on the cache: its prefill captured and kept
    assert dec._prefill_graphs[cache]
    empty = fake.cp.empty

    def short_of_memory(shape, dtype=np.float32):  # the 20-token prompt's buffers do not fit
        if isinstance(shape, tuple) and shape and shape[0] == 20:
            raise MemoryError("out of memory allocating 1,234 bytes")
        return empty(shape, dtype)

    monkeypatch.setattr(fake.cp, "empty", short_of_memory)
    with pytest.raises(CudaMemoryExhaustedError, match="GPU 0 ran out of memory prefilling 20 tokens") as e:
        dec.forward(list(range(1, 21)), cache)
    assert "--gpu-layers" in str(e.value) and "--device cpu" in str(e.value)
    assert cache.offset == 3 and not dec._prefill_graphs.get(cache) and dec.prefill_graph_error is None
    back = _rebuild_error(error_payload(e.value))
    assert type(back) is CudaMemoryExhaustedError and str(back) == str(e.value)
    assert isinstance(back, MemoryError)  # hearth serve waits for a running request's cache on one
    monkeypatch.setattr(fake.cp, "empty", empty)
    dec.forward(list(range(1, 21)), cache)
    assert cache.offset == 23
    def no_memory(shape, dtype=np.float32):
        raise MemoryError("out of memory")

    monkeypatch.setattr(fake.cp, "zeros", no_memory)
    with pytest.raises(CudaMemoryExhaustedError, match="allocating a KV cache of 4096 positions"):
        dec.new_cache(4096)


def test_unsupported_weight_type_is_a_typed_error(fake, tmp_path):
    from engine.weights import Weight

    model = _model(tmp_path, "llama")
    w = model.layers[0].wq
    model.layers[0].wq = Weight(16, w.raw[:, :66], w.rows, w.cols)  # IQ2_XXS: no CUDA kernel
    with pytest.raises(fake.decoder.UnsupportedCudaModelError, match="--device cpu"):
        fake.decoder.CudaDecoder(model, n_ctx=64)


@pytest.fixture(scope="module")
def simt(tmp_path_factory):
    from tests.engine.cuda.simt import Simt

    try:
        return Simt(tmp_path_factory.mktemp("simt"))
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def check_decoder_against_cpu(fake, model, dec, prompt: list[int], tol: float = 1e-3) -> list[str]:
    """dec (a CudaDecoder over model, float32 prefill) against the CPU model on host threads: prefill
    logits, two graph decode steps (the capture, then a replay), the GPU argmax, a batched step of this
    sequence and a second one at another position, and partial offload (layer 0 on the GPU), each within
    tol (relative). Returns the launches of the two decode steps."""
    cpu_cache, cache = model.new_cache(32), dec.new_cache(32, np.float32)
    ref = model.forward(prompt, cpu_cache, all_logits=True)
    assert _rel(dec.forward(prompt, cache, all_logits=True), ref) < tol
    token = int(np.argmax(ref[-1]))
    fake.launches.clear()
    for _ in range(2):
        ref_step = model.forward([token], cpu_cache)
        assert _rel(dec.forward([token], cache), ref_step) < tol
        token = int(np.argmax(ref_step[-1]))
    steps = list(fake.launches)
    assert dec.greedy_step(token, cache) == int(np.argmax(model.forward([token], cpu_cache)[-1]))
    other_cpu, other = model.new_cache(32), dec.new_cache(32, np.float32)
    model.forward([4, 5], other_cpu)
    dec.forward([4, 5], other)
    ref_batch = model.forward_batch([7, 8], [cpu_cache, other_cpu]).copy()
    assert _rel(dec.forward_batch([7, 8], [cache, other]), ref_batch) < tol
    hyb = fake.hybrid.HybridDecoder(model, 1, n_ctx=32, prefill_dtype="float32")
    cpu_cache, cache = model.new_cache(32), hyb.new_cache(32, np.float32)
    ref = model.forward(prompt, cpu_cache)
    assert _rel(hyb.forward(prompt, cache), ref) < 1e-3
    token = int(np.argmax(ref[-1]))
    assert _rel(hyb.forward([token], cache), model.forward([token], cpu_cache)) < 1e-3
    return steps


# One host thread per CUDA thread is slow on a 2-core CI machine: CI runs a one-layer llama and a two-layer
# Gemma 3 case; HEARTH_CUDA_SIMT=1 runs every family with a longer prompt (about 4 minutes there).
FULL_SIMT = bool(os.environ.get("HEARTH_CUDA_SIMT"))


@pytest.mark.parametrize(
    "kind",
    ["llama-1layer", "gemma3-2layer", "llama-mixed"]
    + [
        pytest.param(k, marks=pytest.mark.skipif(not FULL_SIMT, reason="set HEARTH_CUDA_SIMT=1 (minutes)"))
        for k in ("llama", "qwen2", "gemma3")
    ],
)
def test_decoder_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path, kind):
    """The kernels executed on host threads (tests/engine/cuda/simt.py) through the decoder: prefill,
    captured-graph decode steps and the GPU argmax give the CPU model's logits and greedy tokens."""
    STATE.simt = simt
    model = _model(tmp_path, kind)
    full = kind not in ("llama-1layer", "gemma3-2layer", "llama-mixed")
    prompt = [1, 2, 3, 4, 5, 6, 7] if full else [1, 2, 3]
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    # the step's matvecs hand their outputs on as records (ops.Emit) where both ends run matvec_qb; each
    # stack's weights take one kernel, so a batch reads every weight once
    assert dec.handoff and dec.batchable
    plan, head = dec._handoff_plan()
    if kind == "llama-mixed":  # layer 0's down and layer 1's wo are float16: no records into or out of them
        assert [tuple(k for k, v in p.items() if v) for p in plan] == [("wo", "gu"), ("down",)] and head
    elif kind == "qwen2":
        assert not any(any(p.values()) for p in plan) and not head
    else:
        assert not plan[0]["qkv"] and all(plan[0][k] for k in ("gu", "down")) and head
    cpu_cache, gpu_cache = model.new_cache(32), dec.new_cache(32, np.float32)
    ref = model.forward(prompt, cpu_cache, all_logits=True)
    got = dec.forward(prompt, gpu_cache, all_logits=True)
    assert _rel(got, ref) < 1e-3  # the CPU's small-batch kernels quantize activations (int16 per 32)
    token = int(np.argmax(ref[-1]))
    for _ in range(3 if full else 2):  # graph capture on the first step, replays after
        ref_step = model.forward([token], cpu_cache)
        got_step = dec.forward([token], gpu_cache)
        assert _rel(got_step, ref_step) < 1e-3
        token = int(np.argmax(ref_step[-1]))
    assert dec.greedy_step(token, gpu_cache) == int(np.argmax(model.forward([token], cpu_cache)[-1]))
    # head size 32 (llama-1layer): wo read attention's records
    assert (dec._steps[gpu_cache].attn_rec is not None) == (dec.cfg.head_dim % 32 == 0)
    if full:  # float16 prefill tiles and KV cache: close
        fast = fake.decoder.CudaDecoder(model, n_ctx=32)
        assert _rel(fast.forward(prompt, fast.new_cache(32))[-1], ref[-1]) < 3e-2


def test_prefill_graph_replays_prompts_at_position_zero_on_host_threads(fake, simt, tmp_path, monkeypatch):
    """Captured prefills (the default; HEARTH_CUDA_PREFILL_GRAPHS=0 turns them off): a prompt at
    position 0 of a cache that starts over is one captured
    prefill padded to PREFILL_GRAPH_STEP tokens (its cuBLAS calls through capture_blas), replayed for
    later prompts of up to that length there (new chats on the same cache): the logits of the last real
    token as the CPU's, and decode after it as the CPU's (the padding's keys and values lie past the
    cache's offset). A cache's first prefill, and prompts after cached tokens, go launch by launch."""
    STATE.simt = simt
    monkeypatch.delenv("HEARTH_CUDA_PREFILL_GRAPHS", raising=False)
    model = _model(tmp_path, "llama-1layer")
    dec = fake.decoder.CudaDecoder(model, n_ctx=160, prefill_dtype="float32")
    cache = dec.new_cache(160, np.float32)
    Stream = fake.cp.cuda.Stream
    for i, prompt in enumerate(([1, 2, 3], [4, 5, 6, 7, 8], [9, 3], [5] * 70)):
        cache.trim(cache.offset)  # a new chat
        cpu_cache = model.new_cache(160)
        ref = model.forward(prompt, cpu_cache)[-1]
        before = len(Stream.captures)
        got = dec.forward(prompt, cache)[-1]
        assert _rel(got, ref) < 1e-3 and cache.offset == len(prompt)
        # the first prefill (and the first decode step's capture after it); size 64 captured, replayed;
        # 70 tokens: size 128 captured
        assert len(Stream.captures) - before == (0, 2, 0, 2)[i], dec.prefill_graph_error
        step = dec.forward([7], cache)[-1]
        assert _rel(step, model.forward([7], cpu_cache)[-1]) < 1e-3
    assert dec.prefill_graph_error is None
    assert sorted(g.size for g in dec._prefill_graphs[cache].values()) == [64, 128]
    before = len(Stream.captures)
    dec.forward([1, 2], cache)  # after cached tokens: launch by launch
    assert len(Stream.captures) == before
    monkeypatch.setenv("HEARTH_CUDA_PREFILL_GRAPHS", "0")
    assert not fake.decoder.CudaDecoder(model, n_ctx=160).prefill_graphs


def test_prefill_weights_resident_in_place_or_tiles_on_host_threads(fake, simt, tmp_path, monkeypatch):
    """Prefill's GEMMs read float16 copies of the quantized layer matrices made at load ("resident"; "auto"
    within RESIDENT_SHARE of the memory left), float16 matrices in place, and dequantize tiles of the
    rest at each prefill ("tiles"): the same logits every way, the CPU model's within float16's
    rounding, and no dequantization launch in a prefill for a matrix that has a copy."""
    STATE.simt = simt
    monkeypatch.delenv("HEARTH_CUDA_PREFILL_WEIGHTS", raising=False)
    model = _model(tmp_path, "llama-mixed")  # Q8_0, with float16 blk.0.ffn_down and blk.1.attn_output
    prompt = [1, 2, 3, 4]
    ref = model.forward(prompt, model.new_cache(32), all_logits=True)
    stacks = ("qkv", "wo", "gu", "down")

    def kept(dec):  # per layer, the stacks read in place ("=") or from a copy ("c"); tiles: absent
        marks = []
        for L in dec.layers:
            row = ""
            for name, keys in zip(stacks, fake.decoder.PREFILL_STACKS):
                ws = [L[k] for k in keys]
                parts = dec._resident.get(tuple(map(id, ws)))
                if parts is not None:
                    same = np.shares_memory(parts[0][1], ws[0].raw)
                    row += ("=" if same else "c") + name + " "
            marks.append(row.strip())
        return marks

    def prefill(dec):
        fake.launches.clear()
        got = dec.forward(prompt, dec.new_cache(32), all_logits=True)
        return got, [n for n in fake.launches if n.startswith("dequant_")]

    resident = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_weights="resident")
    assert kept(resident) == ["cqkv cwo cgu =down", "cqkv =wo cgu cdown"]
    assert resident.prefill_weights.startswith("resident: 6 of 6 dequantized")
    assert resident.prefill_weights.endswith("2 read in place")
    got, dequants = prefill(resident)
    # the embedding's rows, and tiles of the tied output matrix (all_logits: logits of every row)
    assert dequants == ["dequant_qb"] * 2
    assert _rel(got, ref) < 3e-2  # float16 GEMM inputs
    tiles = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_weights="tiles")
    assert kept(tiles) == ["=down", "=wo"] and tiles.prefill_resident_bytes == 0
    got_tiles, dequants = prefill(tiles)
    assert dequants == ["dequant_qb"] * 8  # and one a quantized stack
    assert _rel(got_tiles, got) < 1e-6  # the same float16 values multiplied
    # "auto" within a share of what is left: here room for layer 0's q|k|v and wo copies, in layer order
    L0 = resident.layers[0]
    qkv_wo = sum(L0[k].rows for k in ("wq", "wk", "wv", "wo")) * L0["wq"].cols * 2
    free = fake.cp.cuda.runtime.memGetInfo()[0]
    reserve = fake.decoder.estimate_vram(model, 32) - resident.weight_bytes
    monkeypatch.setattr(fake.decoder, "RESIDENT_SHARE", (qkv_wo + 0.5) / (free - reserve))
    auto = fake.decoder.CudaDecoder(model, n_ctx=32)
    assert kept(auto) == ["cqkv cwo =down", "=wo"] and auto.prefill_resident_bytes == qkv_wo
    got_auto, dequants = prefill(auto)
    assert dequants == ["dequant_qb"] * 6 and _rel(got_auto, got) < 1e-6
    monkeypatch.setenv("HEARTH_CUDA_PREFILL_WEIGHTS", "tiles")
    assert kept(fake.decoder.CudaDecoder(model, n_ctx=32)) == ["=down", "=wo"]
    monkeypatch.setenv("HEARTH_CUDA_PREFILL_WEIGHTS", "all")
    with pytest.raises(ValueError, match="auto, resident, tiles.*HEARTH_CUDA_PREFILL_WEIGHTS"):
        fake.decoder.CudaDecoder(model, n_ctx=32)


def _opt_in(*values):
    mark = pytest.mark.skipif(not FULL_SIMT, reason="set HEARTH_CUDA_SIMT=1 (minutes)")
    return [pytest.param(v, marks=mark) for v in values]


# CI: one type per kernel macro shape (32-element blocks, 256-element K-quant blocks, float loads), and MXFP4
# (17-byte blocks: every byte alignment)
@pytest.mark.parametrize("t", [2, 12, 1, 23, 39, *_opt_in(0, 30, 8, 3, 6, 7, 10, 11, 13, 14, 20)])
def test_matvec_and_dequant_kernels_on_host_threads(fake, simt, t):
    """tests/engine/cuda/test_kernels_gpu.py's per-type parity check, its kernels run on host threads."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_matvec_and_dequant_match_cpu(0, t)


@pytest.mark.parametrize("t", [12, 13, 11, 8, 6, 20, 39, *_opt_in(14, 10, 2, 3, 7, 23)])
def test_int_dot_matvec_on_host_threads(fake, simt, t):
    """The graph path's integer-dot matvec (matvec_qb, step.cu's row_dot) on host threads: every prologue,
    accumulate, and one launch over stacked weights of different types."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_stacked_matvec_prologues_and_accumulate(0, t, True)
    if t == 12:
        gpu_tests.test_int_dot_matvec_stacks_mixed_types(0, 512)
        gpu_tests.test_int_dot_matvec_stacks_mixed_types(0, 4096)  # a thread quantizes several quarters
    assert {n for n in fake.launches if n.startswith("matvec_")} == {"matvec_qb"}


def test_batched_matvec_on_host_threads(fake, simt):
    """matvec_qb over 10 vectors against one vector at a time (test_kernels_gpu), on host threads."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_matvec_batch_matches_one_vector_at_a_time(0)
    assert fake.launches.count("matvec_qb") == 2 * (2 + 10)  # two prologues: 8 + 2 vectors, then 10 alone


@pytest.mark.parametrize("t", [1, 30, 8, *_opt_in(0, 12)])  # FP8 and NVFP4: test_fp_formats.py
def test_float_batched_matvec_on_host_threads(fake, simt, monkeypatch, t):
    """The float kernels over a batch (test_kernels_gpu), on host threads: 2 launches of 2 vectors and
    one of 1, each prologue, against 5 single-vector launches."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_float_matvec_batch_matches_one_vector_at_a_time(0, t, monkeypatch)
    name = "matvec_" + fake.ops.TYPES[t][0]
    launched = [n for n in fake.launches if n in (name, name + "_batch")]
    # the float types' batches go to the batch kernel (a vector alone to the one-vector kernel); the
    # block types' float kernel takes both
    assert len(launched) == 2 * (3 + 5)
    assert launched.count(name + "_batch") == (0 if t in fake.ops.BLOCK_TYPES else 2 * 2)


@pytest.mark.parametrize("split", [2, *_opt_in(4, 8)])
def test_split_rows_on_host_threads(fake, simt, monkeypatch, split):
    """matvec_qb_split (HEARTH_CUDA_SPLIT: several warps a row) against one warp a row
    (test_kernels_gpu), on host threads. CI: one stack of each shape of row_dot's loops at split 2."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    stacks = gpu_tests.SPLIT_STACKS if FULL_SIMT else ((gpu_tests.SPLIT_STACKS[0][0], (6, 8), (10, 16)),)
    gpu_tests.test_matvec_split_rows_match_one_warp_a_row(0, monkeypatch, split, stacks)
    assert "matvec_qb_split" in fake.launches and "matvec_qb" in fake.launches
    # records that leave no room for the shares' static shared memory: one warp a row after all
    ops, cp = fake.ops, fake.cp
    w = ops.upload(gpu_tests._weight(12, 64, 4096, 1)[0])
    records = 3 * 4 * ops.records_width(4096)
    monkeypatch.setattr(ops, "max_shared", lambda: records + ops.SPLIT_STATIC_SHARED - 1)
    fake.launches.clear()
    ops.matvec_batch(cp.zeros((3, 64), cp.float32), [w], cp.ones((3, 4096), cp.float32))
    assert fake.launches == ["matvec_qb"]


def test_row_split_fills_the_gpus_warps_for_few_rows(fake, monkeypatch):
    """ops.row_split: "auto" doubles the warps a row while twice the rows' warps fit the 132 SMs' 4224
    warp slots (4 blocks of 8 warps each); numbers as given; one warp a row by default; a bad value names
    the variable."""
    ops = fake.ops
    monkeypatch.delenv(ops.ROW_SPLIT_ENV, raising=False)
    assert ops.row_split(2048) == 1
    assert [ops.row_split(n, "auto") for n in (256, 1024, 2048, 3072, 8192, 128256)] == [8, 4, 2, 1, 1, 1]
    assert ops.row_split(2048, "4") == 4
    monkeypatch.setenv(ops.ROW_SPLIT_ENV, "auto")
    assert ops.row_split(2048) == 2
    monkeypatch.setenv(ops.ROW_SPLIT_ENV, "3")
    with pytest.raises(ValueError, match="HEARTH_CUDA_SPLIT='3'"):
        ops.row_split(2048)


def test_batched_matvec_within_the_devices_shared_memory_on_host_threads(fake, simt, monkeypatch, tmp_path):
    """On a device whose blocks hold the records of only 3 vectors, matvec_qb takes 3 a launch (4
    launches for 10) with the same results; a model whose widest matrix needs more shared memory for one
    vector than the device has is a typed error at load, not a failed launch."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    monkeypatch.setitem(DEVICE_ATTRIBUTES, 97, 3 * 4 * fake.ops.records_width(256) + 64)
    gpu_tests.test_matvec_batch_matches_one_vector_at_a_time(0)
    assert fake.launches.count("matvec_qb") == 2 * (4 + 10)
    model = _model(tmp_path, "llama")  # Q8_0, 64 and 96 columns: 640 bytes of records a vector (8 units)
    monkeypatch.setitem(DEVICE_ATTRIBUTES, 97, 600)
    fake.ops._max_shared_of.cache_clear()
    unsupported = fake.decoder.UnsupportedCudaModelError
    with pytest.raises(unsupported, match=r"64 columns needs 0.6 KiB.*allows 0.6 KiB"):
        fake.decoder.CudaDecoder(model, n_ctx=32)


def test_attention_batch_on_host_threads(fake, simt):
    """ops.attention_batch (test_kernels_gpu), on host threads."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_attention_batch_matches_one_sequence_at_a_time(0, 40)


def test_matvec_hand_off_on_host_threads(fake, simt):
    """matvec_qb's activation records (ops.Emit, prologues 4/5; test_kernels_gpu), on host threads."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_matvec_hand_off_records_match_the_float_input(0)


# (ggml type, rows) stacks over 256 columns for the decode step's matvecs over B rows
STEP_STACKS = {"q8_0|q4_k": ((8, 5), (12, 4)), "f16|q8_0": ((1, 3), (8, 5))}


@pytest.mark.parametrize("int_dot", [True, False])
def test_step_matvecs_over_a_batch_on_host_threads(fake, simt, int_dot):
    """The decode step's matvecs over B = 3 rows (decoder._matvecs), SwiGLU prologue on [x | x2] rows,
    added into wider rows: the run of weights at the start of the stack is one launch for the batch
    (matvec_qb, or a float kernel); a run after a weight of another kernel goes a launch per row. All
    equal the dense products."""
    from tests.engine.cuda.test_kernels_gpu import _weight

    STATE.simt = simt
    B, cols = 3, 256
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B, 2 * cols)).astype(np.float32)
    act = x[:, :cols] / (1 + np.exp(-x[:, :cols])) * x[:, cols:]
    launches = {}
    for name, stack in STEP_STACKS.items():
        parts = [_weight(t, rows, cols, seed) for seed, (t, rows) in enumerate(stack, 1)]
        ws = [fake.ops.upload(w) for w, _ in parts]
        want = act.astype(np.float64) @ np.concatenate([d for _, d in parts]).astype(np.float64).T
        base = rng.standard_normal((B, want.shape[1] + 2)).astype(np.float32)
        out = fake.cp.asarray(base)
        fake.launches.clear()
        fake.decoder._matvecs(out, ws, fake.cp.asarray(x), int_dot, cols_x2=True, prologue=2, accumulate=True)
        launches[name] = sorted(fake.launches)
        got, n = np.asarray(out), want.shape[1]
        np.testing.assert_allclose(got[:, :n], base[:, :n] + want, atol=2e-3 * np.abs(want).max())
        np.testing.assert_array_equal(got[:, n:], base[:, n:])  # beyond the stack's rows: untouched
    if int_dot:
        assert launches == {"q8_0|q4_k": ["matvec_qb"], "f16|q8_0": ["matvec_f16_batch"] + ["matvec_qb"] * 3}
    else:
        assert launches == {
            "q8_0|q4_k": ["matvec_q4_k"] * 3 + ["matvec_q8_0"],
            "f16|q8_0": ["matvec_f16_batch"] + ["matvec_q8_0"] * 3,
        }


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("neox,window,qk_norm,cap,sinks", ATTENTION_CASES)
def test_rope_and_decode_attention_on_host_threads(fake, simt, kv_dtype, neox, window, qk_norm, cap, sinks):
    """test_kernels_gpu's RoPE + cache write (prefill's rope_store over 3 tokens, then attention_prefill
    over its grouped queries) and one-launch decode attention (the same 3 tokens one at a time, 10 splits,
    the last block of a head combining them) against the CPU kernels, on host threads; Gemma 2's
    soft-capped scores and gpt-oss's sinks included."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_rope_store_and_attention_match_cpu(0, kv_dtype, neox, window, qk_norm, cap, sinks)
    assert fake.launches.count("attn_decode") == 3


@pytest.mark.skipif(not FULL_SIMT, reason="set HEARTH_CUDA_SIMT=1 (about 9 minutes on 2 cores)")
def test_op_kernels_on_host_threads(fake, simt):
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_stacked_matvec_prologues_and_accumulate(0, 12, False)
    gpu_tests.test_rmsnorm(0, True)
    gpu_tests.test_glu_argmax_and_sampling(0)


def test_mamba2_mixer_on_host_threads(fake, simt):
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_mamba2_mixer(0, 0.3)


def test_argmax_over_blocks_on_host_threads(fake, simt):
    """ops.argmax: blocks' bests, then the last block's pick (first index on ties), its counter reset."""
    STATE.simt = simt
    rng = np.random.default_rng(3)
    x = rng.standard_normal(5000).astype(np.float32)
    tok, parts = fake.cp.zeros(1, np.int32), fake.ops.argmax_parts()
    for best in ((17, 4000), (4999,), (0, 2500)):
        x[list(best)] = x.max() + 1.0
        fake.ops.argmax(tok, fake.cp.asarray(x), parts)
        assert int(tok[0]) == best[0] == int(np.argmax(x)) and not parts[2].any()
    assert fake.launches.count("argmax") == 3


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("window,cap,with_sinks", [(0, 0.0, False), (5, 0.0, False), (5, 1.5, True)])
def test_prefill_attention_gemms_on_host_threads(fake, simt, monkeypatch, window, cap, with_sinks, kv_dtype):
    """ops.attention_prefill (batched GEMMs around the masked-softmax kernel) against a numpy reference:
    GQA, queries after earlier cached tokens, a sliding window, and a GEMM budget so small that KV heads
    go one batch at a time and queries in chunks (and ungroup_heads' grid strides over the tokens).
    Float16 caches take float16 queries, float16 probabilities and give a float16 output (the output
    projection's input), through cublasGemmStridedBatchedEx; float32 ones are float32 throughout
    (cublasSgemmStridedBatched). Both read the caches in place. Gemma 2's soft-capped scores and gpt-oss's
    sink logits (each head its own, also when KV heads go one batch at a time) join the softmax."""
    STATE.simt = simt
    rng = np.random.default_rng(7)
    n, H, KV, hd, n_ctx, pos0 = 6, 4, 2, 16, 32, 5
    rep = H // KV
    sinks = rng.normal(0.5, 1.0, H).astype(np.float32) if with_sinks else None
    q = rng.normal(size=(n, H, hd)).astype(np.float32)
    k = rng.normal(size=(KV, n_ctx, hd)).astype(kv_dtype)
    v = rng.normal(size=(KV, n_ctx, hd)).astype(kv_dtype)
    scale = hd**-0.5
    want = np.zeros((n, H, hd))
    for t in range(n):
        pos = pos0 + t
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            g = h // rep
            s = k[g, lo : pos + 1].astype(np.float64) @ q[t, h] * scale
            if cap:
                s = cap * np.tanh(s / cap)
            top = s.max() if sinks is None else max(s.max(), sinks[h])
            p = np.exp(s - top)
            total = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            want[t, h] = (p / total) @ v[g, lo : pos + 1]
    qg = np.ascontiguousarray(q.reshape(n, KV, rep, hd).transpose(1, 0, 2, 3)).reshape(KV, n * rep, hd)
    tol = 1e-5 if kv_dtype == np.float32 else 4e-3  # float16 queries, probabilities and output
    per_score = 6 if kv_dtype == np.float16 else 4
    calls = []
    for name in ("sgemmStridedBatched", "gemmStridedBatchedEx"):
        fn = getattr(fake.cp.cuda.cublas, name)
        counted = lambda *a, fn=fn, name=name: calls.append(name) or fn(*a)  # noqa: E731
        monkeypatch.setattr(fake.cp.cuda.cublas, name, counted)
    for budget in (None, per_score * 2 * 2 * (pos0 + n)):  # whole, then one head x 2 queries
        if budget:
            monkeypatch.setattr(fake.ops, "ATTN_GEMM_BYTES", budget)
            monkeypatch.setattr(fake.ops, "GRID_Y_MAX", 4)  # ungroup_heads strides over the 6 tokens
        out = fake.cp.zeros((n, H, hd), kv_dtype)
        gq = fake.cp.asarray(qg.astype(kv_dtype))
        args = gq, fake.cp.asarray(k), fake.cp.asarray(v), pos0, scale, window
        gsinks = None if sinks is None else fake.cp.asarray(sinks)
        fake.ops.attention_prefill(out, *args, softcap=cap, sinks=gsinks)
        assert np.max(np.abs(out.astype(np.float64) - want)) < tol
    assert fake.launches.count("softmax_causal") == 1 + 2 * 3  # then 2 KV heads x 3 chunks of 2 queries
    assert fake.launches.count("ungroup_heads") == 2
    assert not fake.ops._gemm_ex_failed  # every product through cuBLAS
    assert set(calls) == {"sgemmStridedBatched" if kv_dtype == np.float32 else "gemmStridedBatchedEx"}
    assert len(calls) == 2 * (1 + 2 * 3)
    with pytest.raises(ValueError, match="queries"):
        fake.ops.attention_prefill(out, fake.cp.asarray(qg.astype(np.float64)), *args[1:])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("stack", ["q8_0|q4_0|q8_0", "q4_k|q4_k|q6_k", "q8_0|f16|q8_0"])
def test_stacked_prefill_linear_on_host_threads(fake, simt, dtype, stack):
    """test_kernels_gpu's stacked-tile check: the dequant kernels on host threads, the GEMMs through the
    host emulation of cublasGemmEx. Block types take one dequant_qb launch per tile whatever weights it
    spans (3 tiles, twice); a float16 weight among them makes it a launch per weight part (4 a pass)."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    gpu_tests.test_linear_prefill_stacks_weights_across_tiles(0, dtype, stack)
    dequants = [n for n in fake.launches if n.startswith("dequant_")]
    if "f16" in stack:
        assert dequants == 2 * ["dequant_qb", "dequant_f16", "dequant_qb", "dequant_qb"]
    else:
        assert dequants == ["dequant_qb"] * 6
    assert not fake.ops._gemm_ex_failed


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gemm_nt_through_gemm_ex(fake, dtype):
    """ops.gemm_nt's cublasGemmEx call (its column-major arguments, checked by a host emulation of the
    cuBLAS contract) writes a @ b.T into a column slice of a wider float32 array, or adds it there."""
    rng = np.random.default_rng(3)
    a = fake.cp.asarray(rng.normal(size=(5, 32)).astype(dtype))
    b = fake.cp.asarray(rng.normal(size=(7, 32)).astype(dtype))
    want = a.astype(np.float64) @ b.astype(np.float64).T
    wide = fake.cp.zeros((5, 12), np.float32)
    wide[:, 3:10] = 1.0
    fake.ops.gemm_nt(wide[:, 3:10], a, b)
    assert np.max(np.abs(wide[:, 3:10] - want)) < 1e-4 and not wide[:, :3].any() and not wide[:, 10:].any()
    fake.ops.gemm_nt(wide[:, 3:10], a, b, accumulate=True)
    assert np.max(np.abs(wide[:, 3:10] - 2 * want)) < 1e-4
    assert not fake.ops._gemm_ex_failed


@pytest.mark.parametrize("grid_y", [65535, 2])  # 2: the tokens grid-strided, as past 65535 of them
def test_norm_and_activation_write_float16_gemm_inputs_on_host_threads(fake, simt, monkeypatch, grid_y):
    """rmsnorm and glu write the float16 inputs of the prefill GEMMs directly (no float32 copy)."""
    STATE.simt = simt
    monkeypatch.setattr(fake.ops, "GRID_Y_MAX", grid_y)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    w = rng.normal(1, 0.1, 64).astype(np.float32)
    out = fake.cp.zeros((3, 64), np.float16)
    fake.ops.rmsnorm(out, fake.cp.asarray(x), fake.cp.asarray(w), 1e-5)
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=1e-3, atol=1e-4)  # float16 rounding
    with pytest.raises(ValueError, match="float32 only"):
        fake.ops.rmsnorm(out, fake.cp.asarray(x), fake.cp.asarray(w), 1e-5, accumulate=True)
    # glu: 16-byte pieces (ff % 4 == 0) and element by element, into float16 and float32
    for ff, dtype in ((50, np.float16), (64, np.float16), (50, np.float32), (1100, np.float32)):
        gate, up = rng.normal(size=(2, 5, ff)).astype(np.float32)
        act = fake.cp.zeros((5, ff), dtype)
        fake.ops.glu(act, fake.cp.asarray(np.concatenate([gate, up], axis=1)), fake.ops.GLU_SILU)
        want = gate / (1 + np.exp(-gate)) * up
        tol = 1e-3 if dtype == np.float16 else 1e-5
        np.testing.assert_allclose(act.astype(np.float32), want, rtol=tol, atol=tol / 10)


def test_pdl_params_marshal_arrays_and_numpy_scalars(fake):
    """pdl.params: device arrays as their pointers, numpy scalars as their own C types (the driver copies
    each parameter by its size); anything else is refused before a launch could misread it."""
    import ctypes

    from engine.backends.cuda import pdl

    arr = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0x7F00_0000_1000))
    got = pdl.params((arr, np.int32(-3), np.int64(1 << 40), np.float32(0.5), np.uint64(0), np.uint32(7)))
    assert [type(v) for v in got] == [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint32
    ]
    assert [v.value for v in got] == [0x7F00_0000_1000, -3, 1 << 40, 0.5, 0, 7]
    with pytest.raises(TypeError, match="numpy scalar"):
        pdl.params((3,))
    with pytest.raises(TypeError, match="numpy scalar"):
        pdl.params((np.float64(1.0),))


def test_decode_step_as_programmatic_dependent_launches_on_host_threads(fake, simt, tmp_path, monkeypatch):
    """HEARTH_CUDA_PDL=1: the captured decode step sends its matvecs and attention through pdl.launch
    (every other kernel as before) and gives the plain step's logits; a driver that refuses the launches
    turns them off for the decoder (pdl_error) and the step runs plain."""
    from engine.backends.cuda import pdl

    STATE.simt = simt
    model = _model(tmp_path, "llama-1layer")
    sent = []

    def launch(k, grid, block, args, shared, stream_ptr):
        sent.append(k.name)
        k(grid, block, args, shared_mem=shared)

    monkeypatch.setattr(pdl, "launch", launch)
    monkeypatch.setenv("HEARTH_CUDA_PDL", "1")
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    plain = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    plain.pdl = False
    assert dec.pdl
    steps = []
    for d in (dec, plain):
        cache = d.new_cache(32, np.float32)
        d.forward([1, 2, 3], cache)
        steps.append([np.array(d.forward([t], cache)[-1]) for t in (4, 5)])
    assert dec.pdl_error is None
    for got, want in zip(*steps):
        np.testing.assert_array_equal(got, want)
    # per step (warm-up, capture): q|k|v, attention, wo, gate|up, down, the output projection
    assert sent and set(sent) == {"matvec_qb", "attn_decode"}
    assert sent.count("matvec_qb") == 5 * sent.count("attn_decode")

    def refuse(*args):
        raise pdl.PdlLaunchError("cuLaunchKernelEx returned CUresult 801")

    monkeypatch.setattr(pdl, "launch", refuse)
    refused = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    cache = refused.new_cache(32, np.float32)
    refused.forward([1, 2, 3], cache)
    got = [np.array(refused.forward([t], cache)[-1]) for t in (4, 5)]
    assert not refused.pdl and "801" in refused.pdl_error
    for g, want in zip(got, steps[1]):
        np.testing.assert_array_equal(g, want)


def test_flash_prefill_on_host_threads(fake, simt):
    """flash.cu's prefill attention against float64 attention (test_kernels_gpu) on host threads, the
    warps' mma.sync multiplied on the host from the PTX ISA's fragment layout: smaller prompts than on
    a GPU, the same kinds of cases."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    cases = (64, 4, 21, 0, 0), (64, 1, 70, 37, 0), (128, 2, 40, 30, 16), (64, 2, 33, 90, 0)
    gpu_tests.test_flash_prefill_matches_attention(0, cases)


def test_flash_prefill_in_the_decoder_on_host_threads(fake, simt, tmp_path, monkeypatch):
    """HEARTH_CUDA_FLASH=1: the decoder checks the flash kernel against the cuBLAS path once at load,
    then its prefills take it (a float16 cache's logits as without it, a follow-up after cached tokens
    too); a kernel that disagrees (here: one that leaves its output at zero) is not used, and
    flash_error says why. Off by default."""
    from engine.loader import load_model

    STATE.simt = simt
    path = tmp_path / "hd64.gguf"
    write_tiny_gguf(path, TinySpec(hidden=128, heads=2, kv_heads=1, layers=1, ffn=64))
    model = load_model(path).model
    assert not fake.decoder.CudaDecoder(model, n_ctx=48).flash

    def logits(dec):
        cache = dec.new_cache(48, np.float16)
        first = dec.forward([1, 2, 3, 4, 5], cache)[-1]
        return first, dec.forward([6, 7, 8], cache)[-1]

    want = logits(fake.decoder.CudaDecoder(model, n_ctx=48))
    monkeypatch.setenv("HEARTH_CUDA_FLASH", "1")
    calls = []
    real = fake.ops.attention_prefill_flash
    monkeypatch.setattr(fake.ops, "attention_prefill_flash", lambda *a, **k: calls.append(1) or real(*a, **k))
    dec = fake.decoder.CudaDecoder(model, n_ctx=48)
    assert dec.flash and dec.flash_error is None and calls == [1]  # the self-check
    for a, b in zip(logits(dec), want):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())
    assert len(calls) == 3  # then each prefill's one layer
    monkeypatch.setattr(fake.ops, "attention_prefill_flash", lambda *a, **k: None)
    broken = fake.decoder.CudaDecoder(model, n_ctx=48)
    assert not broken.flash and "differs from the cuBLAS path" in broken.flash_error


def test_gpu_sampling_on_host_threads(fake, simt):
    """ops.sample_topk (blocks' candidates, the last block's merge and draw) against the CPU's
    distribution (test_kernels_gpu), on host threads: smaller vocabularies and fewer draws than on a
    GPU (a block's k passes are 2k barriers of 256 host threads), the same kinds of cases."""
    from tests.engine.cuda import test_kernels_gpu as gpu_tests

    STATE.simt = simt
    cases = (300, 20, 0.7, 0.95, 0.05), (300, 1, 1.0, 1.0, 0.0), (150, 100, 1.3, 0.9, 0.1)
    cases += ((7, 40, 1.0, 1.0, 0.0), (600, 0, 0.3, 1.0, 0.0), (600, 0, 1.0, 0.9, 0.0))
    cases += ((200, 0, 1.0, 0.9, 0.0), (600, 0, 8.0, 0.99, 0.0))
    gpu_tests.test_sampling_draws_from_the_cpu_distribution(0, cases, draws=6)
    gpu_tests.test_sample_rows_draws_each_row_as_sample_topk(0, n=400)


def _tiny_chat(fake, tmp_path):
    """A one-layer Q8_0 tiny model, its tokenizer, and a CUDA decoder of it (float32 prefill)."""
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer
    from models.formats.gguf import open_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, layers=1))
    tokenizer = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
    model = load_model(path).model
    return model, tokenizer, fake.decoder.CudaDecoder(model, n_ctx=48, prefill_dtype="float32")


def test_generate_picks_tokens_on_the_gpu_on_host_threads(fake, simt, tmp_path, monkeypatch):
    """engine.generate with a CUDA decoder: after the prefill's token, each step decodes and picks on
    the GPU (greedy_step / sample_step: only the token comes back), greedy replies equal the CPU
    model's (with a repetition penalty too, applied on the GPU), a seed repeats a sampled reply (top-k
    off too), and a top-k wider than the device sampler's candidates decodes with forward() and samples
    on the host."""
    from engine.generate import GenerationParams, generate

    STATE.simt = simt
    model, tokenizer, dec = _tiny_chat(fake, tmp_path)
    calls = []
    for name in ("greedy_step", "sample_step", "forward"):
        real = getattr(dec, name)
        spy = lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(dec, name, spy)

    def reply(m, params):
        cache = m.new_cache(48) if m is model else m.new_cache(48, np.float32)
        return [e.token for e in generate(m, tokenizer, [1, 2, 3], cache, params)]

    greedy = GenerationParams(max_tokens=4, temperature=0.0)
    want = reply(model, greedy)
    calls.clear()
    assert reply(dec, greedy) == want
    assert calls == ["forward"] + ["greedy_step"] * (len(want) - 1)  # the prefill, then a step a token
    sampled = GenerationParams(max_tokens=4, temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=3)
    calls.clear()
    first = reply(dec, sampled)
    assert calls == ["forward"] + ["sample_step"] * (len(first) - 1)
    assert reply(dec, sampled) == first and all(0 <= t < tokenizer.vocab_size for t in first)
    open_k = GenerationParams(max_tokens=4, temperature=0.9, top_k=0, top_p=0.9, seed=3)
    calls.clear()
    first = reply(dec, open_k)
    assert calls == ["forward"] + ["sample_step"] * (len(first) - 1) and reply(dec, open_k) == first
    # the repetition penalty on the GPU: the CPU model's greedy reply, a seeded sampled one repeats
    penalized = GenerationParams(max_tokens=8, temperature=0.0, repetition_penalty=3.0, repeat_last_n=4)
    want = reply(model, penalized)
    calls.clear()
    assert reply(dec, penalized) == want != reply(model, GenerationParams(max_tokens=8, temperature=0.0))
    assert calls == ["forward"] + ["greedy_step"] * (len(want) - 1)
    penalized = GenerationParams(max_tokens=4, temperature=0.9, top_k=40, repetition_penalty=1.3, seed=3)
    calls.clear()
    first = reply(dec, penalized)
    assert calls == ["forward"] + ["sample_step"] * (len(first) - 1) and reply(dec, penalized) == first
    calls.clear()
    reply(dec, GenerationParams(max_tokens=3, temperature=0.9, seed=3, top_k=300))
    assert "sample_step" not in calls and calls.count("forward") >= 2
    # a tokenizer with fewer tokens than embedding rows: the padding rows are never picked
    cache = dec.new_cache(48, np.float32)
    logits = model.forward([1, 2, 3], cpu := model.new_cache(48))[-1]
    dec.forward([1, 2, 3], cache)
    tok = int(np.argmax(logits))
    step = model.forward([tok], cpu)[-1]
    assert dec.greedy_step(tok, cache, vocab=50) == int(np.argmax(step[:50]))


def test_server_engine_picks_on_the_gpu_on_host_threads(fake, simt, tmp_path, monkeypatch):
    """The server's engine over a CUDA decoder picks its rows on the GPU (pick_batch: only the tokens
    come back) and replies as it does over the CPU model: greedy, seeded sampling with top-k off (the
    same uniforms, host or device), a request that ignores end-of-turn (banned on the device); a
    logprobs request's row comes back as logits and is sampled on the host."""
    import threading

    from engine.server.scheduler import Engine, SeqParams

    STATE.simt = simt
    model, tokenizer, dec = _tiny_chat(fake, tmp_path)
    specs = []
    real = dec.pick_batch
    monkeypatch.setattr(dec, "pick_batch", lambda *a, **kw: specs.append(a[2]) or real(*a, **kw))
    requests = [
        SeqParams([1, 2, 3], 5, temperature=0.0),
        SeqParams([4, 5], 5, temperature=0.9, top_p=0.9, seed=5),
        SeqParams([6], 5, temperature=1.2, seed=6, ignore_eos=True),
        SeqParams([7, 8], 4, temperature=0.0, logprobs=2),
    ]

    def replies(m):
        kw = dict(n_ctx=48, max_seqs=4, prefill_chunk=16, prefix_cache_bytes=0, kv_dtype=np.float32)
        engine = Engine(m, tokenizer, **kw)
        got = [[] for _ in requests]
        done = [threading.Event() for _ in requests]
        engine.start()
        try:
            for i, params in enumerate(requests):
                emit = lambda d, i=i: got[i].append(d) or (d.finish_reason or d.error) and done[i].set()  # noqa: E731
                engine.submit(params, emit)
            assert all(ev.wait(120) for ev in done)
        finally:
            engine.stop()
        assert all(d[-1].error is None for d in got)
        return [[d.token for d in deltas if d.token is not None] for deltas in got]

    want = replies(model)
    assert replies(dec) == want and all(want)
    assert specs and max(map(len, specs)) >= 2  # rows decoded together
    for rows in specs:  # rows in the batch's order: the logprobs request's, when decoding, is None
        assert sum(r is None for r in rows) <= 1
        assert all(r is None or (r[0] == 0.0) == (r[4] == 0.0) for r in rows)  # greedy rows draw no u
    assert any(r is None for rows in specs for r in rows)
    assert any(r is not None and r[5] == tuple(tokenizer.eot_ids) for rows in specs for r in rows)
