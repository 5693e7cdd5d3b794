"""CUDA decode/prefill benchmark on a randomly initialised Llama-3.2-1B-shaped model (GPU machine).

Writes a GGUF per quantization with the repo's own encoder and writer (engine.quant.encode,
engine.quant.gguf_writer): Llama-3.2-1B shapes (hidden 2048, ffn 8192, 16 layers, 32 heads / 8 KV
heads of 64, vocab 128256, tied embeddings, RoPE base 500000). Every tensor is stored separately in
the file (and so on the GPU); to keep the build fast, layers reuse the bytes of one random matrix
per shape and the embedding tiles one random 4096-row block.

For each file it measures, with engine.backends.cuda.bench.bench_decoder:
  decode tok/s and the fraction of peak memory bandwidth (weights + KV bytes per token / time / peak),
  for both decode paths: the captured CUDA graph of per-op kernels ("graphs"; its matvecs with integer
  dot products, and again with float ones) and the fused persistent step ("fused",
  engine.backends.cuda.fused), with the fused step's logits and greedy tokens checked against the
  graph path's on the same prompt;
  prefill tok/s at --prompt tokens, against cupy float16 GEMMs of the same shapes (the 7 layer
  matrices x 16 layers at --prompt rows): prefill_vs_cublas = the GEMMs' GPU time (launch overhead left
  out; prefill_vs_cublas_wall: their wall time) / our prefill's wall time, for a new
  chat on a used cache (the captured prefill's replay, the default) and prefill_first_vs_cublas for a
  fresh cache's first prompt (launch by launch); where prefill time goes (linears, attention: wall
  clock and, *_gpu_s, the GPU's time in a graph), whether launch by launch is host-bound
  (prefill_issue_s: the host's time to enqueue it; prefill_gpu_s: the GPU's time with every launch
  queued beforehand, and prefill_gpu_vs_cublas from it), the captured prefill alone (prefill_graph_*,
  prefill_graph_vs_cublas; it reads the decoder's resident float16 copies of the matrices, see
  prefill_weights) and without them, dequantizing tiles of 64, 8, 16 and 32 MiB at each prefill
  (prefill_graph_tps_tile_*, prefill_tiles_vs_cublas for the default tile);
  decode with programmatic dependent launches (pdl_*: the same logits and greedy tokens, tok/s);
  decode with several warps a row in the matvecs of few rows (split_*: HEARTH_CUDA_SPLIT=auto against 1);
  decode with and without the matvecs' hand-off of quantized records (handoff_*; the default has it);
  prefill attention in one flash kernel (flash_*: its GPU time against the cuBLAS GEMMs', the captured
  prefill with it and flash_prefill_vs_cublas, a follow-up turn, the logits against the default's);
  the GPU sampler (sample_topk_*_gpu_us: one draw's GPU time with top-k 40 and off; sampled decode tok/s);
  batched decode (forward_batch, as `hearth serve` runs it) over 4 and 8 sequences, total tok/s, with the
  logits to the host and with the tokens picked on the GPU (pick_batch);
  decode in a chat-sized cache (LONG_CTX positions) near its start and near its end, with the default
  number of attention splits and with 16 (long_ctx_*: a short position leaves most of the default's
  heads x splits blocks without keys).

Usage: python3 scripts/cuda_bench_1b.py --out results.json [--types Q4_K,Q8_0] [--prompt 512] [--gen 128]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8192, 16, 32, 8, 64, 128256
LONG_CTX = 8192  # a chat's context for long_ctx_* (the headline decode runs in a cache just big enough)


def _metadata() -> dict:
    a = "llama"
    return {
        "general.architecture": a,
        "general.name": "random Llama-3.2-1B shape",
        f"{a}.block_count": LAYERS,
        f"{a}.context_length": 131072,
        f"{a}.embedding_length": HIDDEN,
        f"{a}.feed_forward_length": FFN,
        f"{a}.attention.head_count": HEADS,
        f"{a}.attention.head_count_kv": KV_HEADS,
        f"{a}.attention.key_length": HEAD_DIM,
        f"{a}.rope.freq_base": 500000.0,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
    }


def _shapes() -> dict[str, tuple[int, int]]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        "attn_q": (q, HIDDEN),
        "attn_k": (kv, HIDDEN),
        "attn_v": (kv, HIDDEN),
        "attn_output": (HIDDEN, q),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }


def build_gguf(path: Path, qtype: str, seed: int = 0) -> float:
    """Write the model quantized to qtype; returns seconds taken."""
    from engine.quant.encode import quantize, type_id
    from engine.quant.gguf_writer import GGUFWriter

    t0 = time.perf_counter()
    t = type_id(qtype)
    rng = np.random.default_rng(seed)
    blocks = {
        name: quantize(t, rng.normal(0, 0.02, shape).astype(np.float32)) for name, shape in _shapes().items()
    }
    embd_block = quantize(t, rng.normal(0, 0.02, (4096, HIDDEN)).astype(np.float32))
    embd = np.concatenate([embd_block] * (-(-VOCAB // 4096)))[:VOCAB]
    norm = np.ones(HIDDEN, np.float32)
    tensors = [("token_embd.weight", t, (VOCAB, HIDDEN)), ("output_norm.weight", 0, (HIDDEN,))]
    for i in range(LAYERS):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", 0, (HIDDEN,)), (p + "ffn_norm.weight", 0, (HIDDEN,))]
        tensors += [(p + n + ".weight", t, s) for n, s in _shapes().items()]
    with open(path, "wb") as fh:
        w = GGUFWriter(fh, _metadata(), tensors)
        w.write_header()
        for name, _, _ in tensors:
            if name == "token_embd.weight":
                w.write_tensor(name, embd)
            elif name.endswith("norm.weight"):
                w.write_tensor(name, norm.view(np.uint8))
            else:
                w.write_tensor(name, blocks[name.split(".")[2]])
        w.finish()
    return time.perf_counter() - t0


def open_model(path: Path):
    """The CPU LlamaModel over the file (no tokenizer needed)."""
    from engine.arch.llama import LlamaConfig, LlamaModel
    from engine.loader import GGUFWeights
    from models.formats.gguf import open_gguf

    g = open_gguf(path)
    return LlamaModel(LlamaConfig.from_gguf(g.metadata, VOCAB), GGUFWeights(g))


def cublas_reference(n_tokens: int, repeats: int = 5) -> tuple[float, float]:
    """The float16 GEMMs of one prefill (7 matrices x 16 layers at n_tokens rows) through cp.matmul:
    (wall seconds, GPU seconds), each the best of `repeats`. The GPU figure times the GEMMs between two
    events with all of them queued behind a spinning kernel first, so it leaves out the host's launch
    overhead: the stricter reference."""
    import cupy as cp

    x = {
        c: cp.random.standard_normal((n_tokens, c), dtype=cp.float32).astype(cp.float16)
        for c in (HIDDEN, FFN)
    }
    ws = [cp.random.standard_normal(s, dtype=cp.float32).astype(cp.float16) for s in _shapes().values()]

    def gemms():
        for _ in range(LAYERS):
            for w in ws:
                cp.matmul(x[w.shape[1]], w.T)

    best = float("inf")
    for _ in range(repeats + 1):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        gemms()
        cp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
    spin = cp.RawKernel(SPIN, "spin")
    stream = cp.cuda.get_current_stream()
    gpu = float("inf")
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        spin((1,), (1,), (np.int64(100_000_000),))  # 0.1 s: longer than issuing the GEMMs takes
        start.record(stream)
        gemms()
        end.record(stream)
        end.synchronize()
        gpu = min(gpu, cp.cuda.get_elapsed_time(start, end) / 1e3)
    return best, gpu


def bench_file(path: Path, n_prompt: int, n_gen: int, repetitions: int, entry: dict, save) -> None:
    """Every measurement on one file into `entry`, calling save() after each part: a run cut short (the
    device budget's timeout) keeps the figures measured so far. The headline ones come first."""
    import cupy as cp

    from engine.backends.cuda.bench import bench_decoder
    from engine.backends.cuda.decoder import CudaDecoder

    model = open_model(path)
    n_ctx = n_prompt + n_gen + 8
    t0 = time.perf_counter()
    dec = CudaDecoder(model, n_ctx=n_ctx, decode_kernel="graphs")
    upload_s = time.perf_counter() - t0
    prompt = np.random.default_rng(1).integers(0, VOCAB, n_prompt).tolist()
    r = bench_decoder(dec, prompt, n_gen, n_ctx, repetitions)
    gemm_wall_s, gemm_s = cublas_reference(n_prompt)
    prefill_s = n_prompt / r["prefill_tps"]
    first_s = n_prompt / r["prefill_first_tps"]
    entry.update(
        {
            "file_gb": round(path.stat().st_size / 1e9, 3),
            "weights_gb": round(dec.weight_bytes / 1e9, 3),
            "upload_s": round(upload_s, 2),
            "prefill_tokens": n_prompt,
            "prefill_tps": round(r["prefill_tps"], 1),
            "prefill_s": round(prefill_s, 5),
            "cublas_f16_gemm_s": round(gemm_s, 6),
            "cublas_f16_gemm_wall_s": round(gemm_wall_s, 5),
            "prefill_vs_cublas_wall": round(gemm_wall_s / prefill_s, 3),
            "prefill_vs_cublas": round(gemm_s / prefill_s, 3),
            "prefill_graphs": dec.prefill_graphs and dec.prefill_graph_error is None,
            "prefill_weights": dec.prefill_weights,
            "prefill_first_tps": round(r["prefill_first_tps"], 1),
            "prefill_first_vs_cublas": round(gemm_s / first_s, 3),
            "decode_tokens": n_gen,
            "decode_tps": round(r["decode_tps"], 1),
            "decode_gb_per_token": round(r["decode_bytes_per_token"] / 1e9, 4),
            "decode_bandwidth_gbs": round(r["decode_bandwidth_gbs"], 1),
            "peak_bandwidth_gbs": round(r["peak_bandwidth_gbs"], 1),
            "decode_bandwidth_fraction": round(r["decode_bandwidth_fraction"], 3),
        }
    )
    if dec.prefill_graph_error is not None:  # why the headline prefill went launch by launch
        entry["prefill_graph_error"] = dec.prefill_graph_error
    save()
    # the same step launched kernel by kernel: what the CUDA graph saves
    dec.use_graphs = False
    cache = dec.new_cache(n_ctx)
    dec.forward(prompt[:8], cache)
    tok = 0
    for _ in range(4):
        tok = dec.greedy_step(tok, cache)
    cp.cuda.Device().synchronize()
    t1 = time.perf_counter()
    for _ in range(32):
        tok = dec.greedy_step(tok, cache)
    entry["decode_tps_without_graph"] = round(32 / (time.perf_counter() - t1), 1)
    dec.use_graphs = True
    # the graph path with float dot products in its matvecs (the default takes integer ones)
    dec.int_dot = False
    try:
        f = bench_decoder(dec, prompt, n_gen, n_ctx, 1)
        entry["float_matvec_decode_bandwidth_fraction"] = round(f["decode_bandwidth_fraction"], 3)
    except Exception as e:  # noqa: BLE001 - the figures above stand
        entry["float_matvec_error"] = f"{type(e).__name__}: {e}"
    finally:
        dec.int_dot = True
    save()
    parts = (
        ("prefill_breakdown", _prefill_breakdown, n_prompt),
        ("prefill_host_and_gpu", _prefill_host_and_gpu, prompt),
        ("prefill_graph", _prefill_graph, prompt),
        ("pdl", _bench_pdl, prompt),
        ("split", _bench_split, prompt),
        ("handoff", _bench_handoff, prompt),
        ("flash", _bench_flash, prompt),
        ("sampling", _bench_sampling, prompt),
        ("batch", _bench_batches, prompt),
        ("long_ctx", _bench_long_context, prompt),
        ("prefill_by_tile", _prefill_by_tile, prompt),  # the prefill without the resident copies
    )
    for name, part, arg in parts:
        try:
            entry.update(part(dec, arg, n_ctx))
        except Exception as e:  # noqa: BLE001 - the figures above stand
            entry[f"{name}_error"] = f"{type(e).__name__}: {e}"
        save()
    if "prefill_gpu_s" in entry:  # what the prefill would reach without the host's launch overhead
        entry["prefill_gpu_vs_cublas"] = round(gemm_s / entry["prefill_gpu_s"], 3)
    if "prefill_graph_s" in entry:
        entry["prefill_graph_vs_cublas"] = round(gemm_s / entry["prefill_graph_s"], 3)
    tiles = entry.get(f"prefill_graph_tps_tile_{dec._tile.nbytes >> 20}mib")
    if isinstance(tiles, float):  # the captured prefill dequantizing tiles (no resident copies)
        entry["prefill_tiles_vs_cublas"] = round(gemm_s / (n_prompt / tiles), 3)
    if "flash_prefill_graph_s" in entry:  # the captured prefill with flash attention (HEARTH_CUDA_FLASH=1)
        entry["flash_prefill_vs_cublas"] = round(gemm_s / entry["flash_prefill_graph_s"], 3)
        entry["flash_prefill_vs_cublas_wall"] = round(gemm_wall_s / entry["flash_prefill_graph_s"], 3)
    # last: a fault in the fused kernel would leave this process's CUDA context unusable
    entry.update(_bench_fused(dec, prompt, n_gen, n_ctx, repetitions))
    save()
    del dec
    cp.get_default_memory_pool().free_all_blocks()


def _prefill_breakdown(dec, n_tokens: int, n_ctx: int) -> dict:
    """Where a prefill's time goes: every layer's linears (GEMMs, and tile dequantization for matrices
    without a resident copy) and attention (the GEMMs around the masked softmax) timed alone, each over
    all layers, best of 3 (wall clock, synchronised: it includes the host's launch overhead, which is
    what a host-bound prefill shows)."""
    import cupy as cp

    from engine.backends.cuda import ops
    from engine.backends.cuda.decoder import PREFILL_STACKS

    cfg = dec.cfg
    # the prefill's GEMM inputs, one contiguous array per width (a column slice would not be contiguous
    # and would take gemm_nt's cp.matmul fallback)
    x16 = {
        c: cp.random.standard_normal((n_tokens, c), dtype=cp.float32).astype(dec.prefill_dtype)
        for c in {cfg.hidden_size, cfg.q_dim, cfg.intermediate_size}
    }
    width = max(cfg.q_dim + 2 * cfg.kv_dim, 2 * cfg.intermediate_size, cfg.hidden_size)
    out = cp.empty((n_tokens, width), cp.float32)
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    cache = dec.new_cache(n_ctx)
    q = cp.random.standard_normal((KV, n_tokens * (H // KV), cfg.head_dim), dtype=cp.float32)  # grouped
    q = q.astype(cache.k[0].dtype)
    attn = cp.empty((n_tokens, H, cfg.head_dim), dec.prefill_dtype)

    def linears():  # the stacked projections as the prefill runs them
        for L in dec.layers:
            for names in PREFILL_STACKS:
                ws = [L[name] for name in names]
                dec._linear(out[:, : sum(w.rows for w in ws)], ws, x16[ws[0].cols])

    def attention():
        for i in range(len(dec.layers)):
            ops.attention_prefill(attn, q, cache.k[i], cache.v[i], 0, dec.scale)

    res = {}
    with cp.cuda.Device(dec.device), dec.stream:
        for name, fn in (("linears", linears), ("attention", attention)):
            best = float("inf")
            for _ in range(3):
                dec.stream.synchronize()
                t0 = time.perf_counter()
                fn()
                dec.stream.synchronize()
                best = min(best, time.perf_counter() - t0)
            res[f"prefill_{name}_s"] = round(best, 5)
            try:  # the GPU's time alone: the same launches captured, the graph replayed
                res[f"prefill_{name}_gpu_s"] = round(graph_seconds(dec.stream, fn), 6)
            except Exception as e:  # noqa: BLE001 - the wall-clock figure stands
                res[f"prefill_{name}_gpu_error"] = f"{type(e).__name__}: {e}"
    res["prefill_gemm_ex"] = not ops._gemm_ex_failed
    if ops._gemm_ex_failed:
        res["prefill_gemm_ex_error"] = ops._gemm_ex_failed[0]
    return res


def graph_seconds(stream, fn, replays: int = 5, reps: int = 1) -> float:
    """GPU seconds of one call of fn's launches: fn run once (it loads the kernels), then `reps` calls
    captured (allocations from a pool of the graph's own), the graph replayed `replays` times between
    two events; their mean."""
    import cupy as cp

    pool = cp.cuda.MemoryPool()
    with stream:
        fn()
        stream.begin_capture()
        try:
            with cp.cuda.using_allocator(pool.malloc):
                for _ in range(reps):
                    fn()
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / (replays * reps)


# a GPU kept busy for `ns` nanoseconds (its global timer), so that launches queue up behind it
SPIN = r"""extern "C" __global__ void spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < (unsigned long long)ns);
}
"""


def _prefill_host_and_gpu(dec, prompt: list[int], n_ctx: int, repeats: int = 3) -> dict:
    """Is the prefill host-bound? prefill_issue_s: the host's time to enqueue one prefill's launches;
    prefill_gpu_s: the GPU's time for them when all were queued before the first ran (behind a kernel
    that spins for longer than issuing takes), i.e. the prefill without launch overhead. Best of
    `repeats`, after a warm-up prefill (kernels loaded, memory pool filled)."""
    import cupy as cp

    spin = cp.RawKernel(SPIN, "spin")
    cache = dec.new_cache(n_ctx)
    issue, gpu = [], []
    with cp.cuda.Device(dec.device), dec.stream:
        ids = cp.asarray(np.asarray(prompt, np.int32))
        pos = cp.asarray(np.zeros(1, np.int32))
        dec._prefill_kernels(ids, pos, cache, False)  # the prefill writes the cache, never advances it
        for _ in range(repeats):
            dec.stream.synchronize()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            spin((1,), (1,), (np.int64(300_000_000),))  # 0.3 s
            start.record(dec.stream)
            t0 = time.perf_counter()
            dec._prefill_kernels(ids, pos, cache, False)
            issue.append(time.perf_counter() - t0)
            end.record(dec.stream)
            end.synchronize()
            gpu.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    res = {"prefill_issue_s": round(min(issue), 5), "prefill_gpu_s": round(min(gpu), 5)}
    if min(issue) > 0.25:  # the host waited for the GPU while issuing: the GPU figure includes host time
        res["prefill_gpu_note"] = "issuing waited for the GPU: prefill_gpu_s includes launch overhead"
    return res


def _prefill_graph(dec, prompt: list[int], n_ctx: int, repeats: int = 3) -> dict:
    """The opt-in captured prefill (HEARTH_CUDA_PREFILL_GRAPHS): new chats on one cache, the first
    prompt launch by launch, the second captures the graph (prefill_graph_capture_s), then the best of
    `repeats` replays (prefill_graph_s, logits back on the host as forward() returns them), and how far
    their logits are from the launch-by-launch prefill's."""
    import cupy as cp

    was = dec.prefill_graphs
    dec.prefill_graphs = True
    dec._prefill_graphs.clear()
    try:
        cache = dec.new_cache(n_ctx)
        times, logits = [], []
        for _ in range(2 + repeats):
            cache.trim(cache.offset)
            cp.cuda.Device(dec.device).synchronize()
            t0 = time.perf_counter()
            logits.append(dec.forward(prompt, cache)[-1])
            times.append(time.perf_counter() - t0)
        if dec.prefill_graph_error is not None:
            return {"prefill_graph_error": dec.prefill_graph_error}
        ref = logits[0].astype(np.float64)
        scale = float(np.abs(ref).max()) or 1.0
        return {
            "prefill_graph_s": round(min(times[2:]), 5),
            "prefill_graph_capture_s": round(times[1], 5),
            "prefill_graph_tps": round(len(prompt) / min(times[2:]), 1),
            "prefill_graph_vs_eager_rel": round(float(np.abs(logits[-1] - ref).max()) / scale, 6),
        }
    finally:
        dec.prefill_graphs = was
        dec._prefill_graphs.clear()


def _bench_flash(dec, prompt: list[int], n_ctx: int) -> dict:
    """Prefill attention in one flash kernel (CudaDecoder.flash, HEARTH_CUDA_FLASH=1; opt-in until
    these figures say so) against the default cuBLAS GEMMs around a masked softmax: the decoder's
    self-check (flash_check_error when it fails), the GPU time of every layer's attention at the
    prompt's length (flash_attention_gpu_s vs attention_gemm_gpu_s), how far flash's output is from the
    GEMMs' (flash_vs_gemm_rel), then the whole captured prefill with flash (flash_prefill_graph_s, its
    logits against the default prefill's: flash_prefill_logits_rel) and a follow-up turn's prompt after
    the first (flash_followup_*: launch by launch, both ways)."""
    import cupy as cp

    from engine.backends.cuda import ops

    cfg = dec.cfg
    H, KV, hd, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, len(prompt)
    cache = dec.new_cache(n_ctx)
    if not ops.flash_applies(cache.k[0].dtype, hd):
        return {"flash_error": "flash prefill does not apply (cache dtype, head size or GPU)"}
    normal = cp.random.standard_normal
    for i in range(len(dec.layers)):  # a filled cache: the keys and values of a prompt
        cache.k[i][:, :n] = normal((KV, n, hd), dtype=cp.float32).astype(cp.float16)
        cache.v[i][:, :n] = normal((KV, n, hd), dtype=cp.float32).astype(cp.float16)
    q = normal((KV, n * (H // KV), hd), dtype=cp.float32).astype(cp.float16)
    outs = {flag: cp.empty((n, H, hd), dec.prefill_dtype) for flag in (False, True)}
    with cp.cuda.Device(dec.device), dec.stream:
        check = ops.flash_check(H, KV, hd)
    res = {} if check is None else {"flash_check_error": check}
    was = dec.flash
    try:
        with cp.cuda.Device(dec.device), dec.stream:
            for flag, name in ((False, "attention_gemm_gpu_s"), (True, "flash_attention_gpu_s")):

                def attention(out=outs[flag], flag=flag):
                    for i in range(len(dec.layers)):
                        ops.attention_prefill(out, q, cache.k[i], cache.v[i], 0, dec.scale, flash=flag)

                res[name] = round(graph_seconds(dec.stream, attention), 6)
            dec.stream.synchronize()
        a, b = (cp.asnumpy(outs[f]).astype(np.float64) for f in (False, True))
        res["flash_vs_gemm_rel"] = round(float(np.abs(a - b).max() / (np.abs(a).max() or 1.0)), 6)
        dec.flash = False
        ref = _prefill_graph(dec, prompt, n_ctx)
        first = prompt[: n // 2]
        follow = {}
        for flag in (False, True):  # a follow-up turn: prompt after cached tokens, launch by launch
            dec.flash = flag
            c = dec.new_cache(n_ctx)
            dec.forward(first, c)
            cp.cuda.Device(dec.device).synchronize()
            t0 = time.perf_counter()
            follow[flag] = dec.forward(prompt[n // 2 :], c)[-1]
            res[f"flash_followup_s_{'flash' if flag else 'gemm'}"] = round(time.perf_counter() - t0, 5)
        scale = float(np.abs(follow[False]).max()) or 1.0
        res["flash_followup_logits_rel"] = round(float(np.abs(follow[True] - follow[False]).max()) / scale, 6)
        dec.flash = True
        got = _prefill_graph(dec, prompt, n_ctx)
        res["flash_prefill_graph_s"] = got.get("prefill_graph_s")
        res["flash_prefill_graph_tps"] = got.get("prefill_graph_tps")
        if "prefill_graph_error" in got or "prefill_graph_error" in ref:
            res["flash_prefill_graph_error"] = got.get("prefill_graph_error", ref.get("prefill_graph_error"))
        res["flash_prefill_default_graph_s"] = ref.get("prefill_graph_s")
    finally:
        dec.flash = was
    # the logits of a whole prefill with flash against the default's (a fresh cache each, launch by launch)
    logits = {}
    try:
        for flag in (False, True):
            dec.flash = flag
            logits[flag] = dec.forward(prompt, dec.new_cache(n_ctx))[-1]
    finally:
        dec.flash = was
    scale = float(np.abs(logits[False]).max()) or 1.0
    res["flash_prefill_logits_rel"] = round(float(np.abs(logits[True] - logits[False]).max()) / scale, 6)
    res["flash_greedy_matches"] = int(np.argmax(logits[True])) == int(np.argmax(logits[False]))
    return res


def _prefill_by_tile(dec, prompt: list[int], n_ctx: int) -> dict:
    """The captured prefill without the decoder's resident prefill weights (prefill_weights "tiles":
    every prefill dequantizes tiles of each matrix before its GEMM), with the default tile and smaller
    ones: a tile that stays in L2 between its dequantization and its GEMM saves the float16 round trip
    through DRAM, at the cost of more, smaller launches (which a graph replays without the host).
    prefill_graph_tps_tile_* (the headline's prefill_weights says what it read instead)."""
    import cupy as cp

    default, resident = dec._tile, dec._resident
    res = {}
    try:
        dec._resident = {}
        for mib in (default.nbytes >> 20, 8, 16, 32):
            dec._tile = cp.empty((mib << 20) // default.itemsize, default.dtype)
            got = _prefill_graph(dec, prompt, n_ctx)
            tps = got.get("prefill_graph_tps", got.get("prefill_graph_error"))
            res[f"prefill_graph_tps_tile_{mib}mib"] = tps
    finally:
        dec._tile, dec._resident = default, resident
        dec._prefill_graphs.clear()
    res["prefill_tile_default_mib"] = round(default.nbytes / 2**20, 1)
    return res


def _bench_pdl(dec, prompt: list[int], n_ctx: int) -> dict:
    """The graph path with programmatic dependent launches (HEARTH_CUDA_PDL, engine/backends/cuda/pdl.py)
    against the plain graph: pdl_* (_bench_switch)."""
    return _bench_switch(dec, prompt, n_ctx, "pdl")


def _bench_handoff(dec, prompt: list[int], n_ctx: int) -> dict:
    """The step's matvecs handing their outputs on as the next one's quantized records (the default,
    decoder.handoff; HEARTH_CUDA_HANDOFF=0 turns it off) against every matvec quantizing its float
    input in every block: handoff_* (_bench_switch; the headline decode figures have it on)."""
    return _bench_switch(dec, prompt, n_ctx, "handoff")


def _bench_split(dec, prompt: list[int], n_ctx: int) -> dict:
    """matvec_qb with several warps a row for the stacks of few rows (HEARTH_CUDA_SPLIT=auto: the 1B
    shape's wo and down projections take 2 a row on an H200) against one warp a row: split_*
    (_bench_switch's figures). The variable is restored after."""
    from engine.backends.cuda import ops

    was = os.environ.get(ops.ROW_SPLIT_ENV)

    def toggle(on):
        value = was if on is None else "auto" if on else "1"
        if value is None:
            os.environ.pop(ops.ROW_SPLIT_ENV, None)
        else:
            os.environ[ops.ROW_SPLIT_ENV] = value

    return _bench_switch(dec, prompt, n_ctx, "split", toggle)


def _bench_switch(dec, prompt: list[int], n_ctx: int, flag: str, toggle=None) -> dict:
    """The decoder's boolean `flag` off and on (or toggle(on), toggle(None) restoring it, for a switch
    that is not a decoder attribute): the step's logits and 16 greedy tokens one way against the other
    ({flag}_vs_plain_rel, {flag}_greedy_matches), then decode figures each way ({flag}_decode_tps and
    _bandwidth_fraction on, {flag}_off_decode_tps off; as many tokens as the headline's: the context left
    after the prompt). The flag is restored after."""
    from engine.backends.cuda.bench import bench_decoder

    n_gen = n_ctx - len(prompt) - 8  # bench_file's context: prompt + gen + 8
    error = f"{flag}_error"
    if toggle is None:
        was = getattr(dec, flag)

        def toggle(on):
            setattr(dec, flag, was if on is None else on)

    def run(on: bool):
        toggle(on)
        cache = dec.new_cache(n_ctx)
        logits = dec.forward(prompt[: n_ctx // 2], cache)[-1]
        tok = int(np.argmax(logits))
        step = np.asarray(dec.forward([tok], cache)[-1], np.float64)
        tokens = [tok]
        for _ in range(16):
            tokens.append(dec.greedy_step(tokens[-1], cache))
        return step, tokens

    try:
        plain, plain_tokens = run(False)
        got, got_tokens = run(True)
        if getattr(dec, error, None) is not None:
            return {error: getattr(dec, error)}
        res = {
            f"{flag}_vs_plain_rel": round(float(np.abs(got - plain).max() / (np.abs(plain).max() or 1.0)), 8),
            f"{flag}_greedy_matches": got_tokens == plain_tokens,
        }
        for on in (True, False):
            toggle(on)
            r = bench_decoder(dec, prompt, n_gen, n_ctx, 1)
            res[f"{flag}_decode_tps" if on else f"{flag}_off_decode_tps"] = round(r["decode_tps"], 1)
            if on:
                res[f"{flag}_decode_bandwidth_fraction"] = round(r["decode_bandwidth_fraction"], 3)
        if getattr(dec, error, None) is not None:
            res[error] = getattr(dec, error)
        return res
    finally:
        toggle(None)


def _bench_sampling(dec, prompt: list[int], n_ctx: int, steps: int = 64) -> dict:
    """The GPU sampler: sample_topk's GPU time on a step's logits row (top-k 40 and top-k off, both
    with temperature 0.8, top-p 0.95, min-p 0.05; sample_topk_*_gpu_us), then sampled decode through
    sample_step (sampled_decode_tps_*; the random model's flat rows push top-k off to the host's draw
    more often than a trained model's would: host_draws_* counts those)."""
    import cupy as cp

    from engine.backends.cuda import ops

    cache = dec.new_cache(n_ctx)
    logits = dec.forward(prompt[: len(prompt) // 2], cache)[-1]
    row = cp.asarray(np.ascontiguousarray(logits, np.float32))
    token, parts = cp.zeros(1, cp.int32), ops.sample_parts()
    res = {}
    with cp.cuda.Device(dec.device), dec.stream:
        for k, name in ((40, "k40"), (0, "open")):
            fn = lambda k=k: ops.sample_topk(token, row, k, 0.8, 0.95, 0.5, 0.05, parts)  # noqa: E731
            res[f"sample_topk_{name}_gpu_us"] = round(graph_seconds(dec.stream, fn) * 1e6, 2)
    tok = int(np.argmax(logits))
    rng = np.random.default_rng(0)
    steps = min(steps, n_ctx - len(prompt) // 2 - 2)  # what the context holds after the half prompt
    for k, name in ((40, "k40"), (0, "open")):
        dec.host_draws = 0
        c = dec.new_cache(n_ctx)
        dec.forward(prompt[: len(prompt) // 2], c)
        t = dec.sample_step(tok, c, 0.8, k, 0.95, float(rng.random()), 0.05)  # the step's graph captured
        cp.cuda.Device(dec.device).synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            t = dec.sample_step(t, c, 0.8, k, 0.95, float(rng.random()), 0.05)
        res[f"sampled_decode_tps_{name}"] = round(steps / (time.perf_counter() - t0), 1)
        res[f"host_draws_{name}"] = dec.host_draws
    return res


def _bench_long_context(dec, prompt: list[int], n_ctx: int, steps: int = 64) -> dict:
    """Greedy decode tok/s in a cache of LONG_CTX positions, after the prompt (start) and after all but
    the last ~300 positions of it (end), with ops.ATTN_SPLITS as it is and at 16
    (long_ctx_{start,end}_splits{S}_decode_tps). The split count is fixed by the cache's size (the
    captured step's grid), so near the start most blocks of the default's grid find no keys."""
    import cupy as cp

    from engine.backends.cuda import ops

    long_prompt = np.random.default_rng(2).integers(0, VOCAB, LONG_CTX - 300).tolist()
    default, res = ops.ATTN_SPLITS, {}
    try:
        for splits in (default, 16):
            ops.ATTN_SPLITS = splits  # read when a cache's step is built and captured
            for where, p in (("start", prompt), ("end", long_prompt)):
                cache = dec.new_cache(LONG_CTX)
                tok = int(np.argmax(dec.forward(p, cache)[-1]))
                for _ in range(4):  # the step's capture and warm-up
                    tok = dec.greedy_step(tok, cache)
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    tok = dec.greedy_step(tok, cache)
                cp.cuda.Device().synchronize()
                tps = steps / (time.perf_counter() - t0)
                res[f"long_ctx_{where}_splits{splits}_decode_tps"] = round(tps, 1)
                del cache
    finally:
        ops.ATTN_SPLITS = default
    return res


def _bench_batches(dec, prompt: list[int], n_ctx: int, steps: int = 16) -> dict:
    """Batched decode (forward_batch, what `hearth serve` runs): total tok/s over B sequences with the
    logits back on the host (batch{B}_decode_tps_total), and with each row's token picked on the GPU
    (pick_batch, the server's step: half greedy, half sampled at temperature 0.8, top-p 0.95;
    batch{B}_pick_tps_total)."""
    import cupy as cp

    res = {"batched_decode": dec.batchable}
    for B in (4, 8):
        caches = [dec.new_cache(n_ctx) for _ in range(B)]
        for c in caches:
            dec.forward(prompt[:32], c)
        tokens = list(range(1, B + 1))
        picks = [(0.0 if b % 2 else 0.8, 0, 0.95, 0.0, 0.5, ()) for b in range(B)]
        runs = (
            ("decode", functools.partial(dec.forward_batch, tokens, caches)),
            ("pick", functools.partial(dec.pick_batch, tokens, caches, picks)),
        )
        for name, step in runs:
            for _ in range(2):  # capture, then a replay
                step()
            cp.cuda.Device(dec.device).synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            res[f"batch{B}_{name}_tps_total"] = round(B * steps / (time.perf_counter() - t0), 1)
    return res


def _bench_fused(dec, prompt: list[int], n_gen: int, n_ctx: int, repetitions: int) -> dict:
    """The fused step on the same decoder: its logits and greedy tokens against the graph path's,
    then its decode figures (errors are recorded, the graph figures stand)."""
    from engine.backends.cuda.bench import bench_decoder
    from engine.backends.cuda.fused import FusedStep

    out: dict = {}
    try:
        t0 = time.perf_counter()
        fused = FusedStep(dec)
        out["fused_blocks"] = fused.blocks
        caches = [dec.new_cache(n_ctx), dec.new_cache(n_ctx)]
        first = int(np.argmax(dec.forward(prompt[:32], caches[0])[-1]))
        dec.forward(prompt[:32], caches[1])
        rels, tokens = [], [[first], [first]]
        for i, step in enumerate((None, fused)):  # graphs, then fused, from the same prefix
            dec.fused = step
            cache = caches[i]
            logits = dec.forward([first], cache)[-1]
            if i == 0:
                ref = logits
            else:
                rels.append(float(np.max(np.abs(logits - ref)) / max(float(np.max(np.abs(ref))), 1e-30)))
            for _ in range(15):
                tokens[i].append(dec.greedy_step(tokens[i][-1], cache))
        out["fused_vs_graphs_rel"] = round(max(rels), 6)
        out["fused_greedy_matches_graphs"] = tokens[0] == tokens[1]
        out["fused_greedy_same_prefix"] = next((i for i, (a, b) in enumerate(zip(*tokens)) if a != b), 16)
        r = bench_decoder(dec, prompt, n_gen, n_ctx, repetitions)
        out["fused_setup_s"] = round(time.perf_counter() - t0, 2)
        out["fused_decode_tps"] = round(r["decode_tps"], 1)
        out["fused_decode_bandwidth_gbs"] = round(r["decode_bandwidth_gbs"], 1)
        out["fused_decode_bandwidth_fraction"] = round(r["decode_bandwidth_fraction"], 3)
        # the knobs a GPU session would try first: block size and L2 prefetching
        for name, kw in (("t256", {"threads": 256}), ("noprefetch", {"prefetch_budget": -1})):
            dec.fused = FusedStep(dec, **kw)
            r = bench_decoder(dec, prompt, n_gen, n_ctx, 1)
            out[f"fused_{name}_decode_bandwidth_fraction"] = round(r["decode_bandwidth_fraction"], 3)
    except Exception as e:  # noqa: BLE001 - keep the graph path's figures
        import traceback

        out["fused_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        dec.fused = None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--types", default="Q4_K,Q8_0")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where the GGUF files go (default: a temp dir)")
    args = ap.parse_args()
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    results: dict = {"device": name, "shape": "Llama-3.2-1B", "models": {}}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hearth-1b-"))
    work.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=2))

    for qtype in args.types.split(","):
        path = work / f"llama-1b-random.{qtype}.gguf"
        entry: dict = results["models"].setdefault(qtype, {})
        try:
            entry["build_s"] = round(build_gguf(path, qtype), 1)
            print(f"{qtype}: wrote {path} in {entry['build_s']} s", flush=True)
            bench_file(path, args.prompt, args.gen, args.repetitions, entry, save)
        except Exception as e:  # noqa: BLE001 - record the failure, keep the other types' figures
            import traceback

            entry["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            path.unlink(missing_ok=True)
        print(json.dumps({qtype: entry}), flush=True)
        save()
    return 0 if all("error" not in e for e in results["models"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
