"""`hearth bench --device cuda`: prefill and decode tok/s and decode's share of peak memory bandwidth.

Decode bytes per token = every weight byte read once (the matvecs read each matrix in full) plus
the KV cache positions read by attention; the fraction is bytes/token / time/token / peak, with
peak = memoryClockRate (kHz) * 1e3 * 2 (DDR) * busWidth (bits) / 8 from the device attributes.
"""

from __future__ import annotations

import time

import numpy as np


def peak_bandwidth(device: int = 0) -> float:
    """Theoretical DRAM bandwidth of a CUDA device in bytes/s."""
    import cupy as cp

    attrs = cp.cuda.Device(device).attributes
    return float(attrs["MemoryClockRate"]) * 1e3 * 2 * float(attrs["GlobalMemoryBusWidth"]) / 8


def kv_bytes_read(cfg, positions: float, itemsize: int) -> float:
    """K and V bytes attention reads at one decode step that sees `positions` keys, all layers."""
    per_pos = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        window = cfg.window(i)
        total += per_pos * (min(positions, window) if window else positions)
    return total


def bench_decoder(
    dec, prompt: list[int], n_gen: int, n_ctx: int, repetitions: int = 1, kv_dtype=np.float16
) -> dict:
    """Best-of-repetitions prefill and greedy decode (GPU argmax, CUDA graph) on a CudaDecoder.

    Each repetition is a new chat on one cache, as the chat runner reuses its cache: the decoder's
    captured prefill replays there (prefill_tps, ttft_s; the first repetition, a warm-up, captures it).
    prefill_first_tps: the best prompt on a fresh cache (launch by launch, as a server request's or a
    chat's first prompt runs)."""
    import cupy as cp

    best = {"prefill_tps": 0.0, "prefill_first_tps": 0.0, "decode_tps": 0.0, "ttft_s": float("inf")}
    cache = dec.new_cache(n_ctx, kv_dtype)
    for rep in range(repetitions + 2):  # the first two warm up (kernels, cuBLAS, the graphs' captures)
        fresh = dec.new_cache(n_ctx, kv_dtype)
        cp.cuda.Device(dec.device).synchronize()
        t0 = time.perf_counter()
        dec.forward(prompt, fresh)
        cp.cuda.Device(dec.device).synchronize()
        first = time.perf_counter() - t0
        del fresh
        cache.trim(cache.offset)  # a new chat
        t0 = time.perf_counter()
        logits = dec.forward(prompt, cache)
        token = int(np.argmax(logits[-1]))
        ttft = time.perf_counter() - t0
        token = dec.greedy_step(token, cache)  # captures the graph outside the timed loop
        t1 = time.perf_counter()
        for _ in range(n_gen):
            token = dec.greedy_step(token, cache)
        decode_s = time.perf_counter() - t1
        if rep < 2:
            continue
        best["prefill_tps"] = max(best["prefill_tps"], len(prompt) / ttft)
        best["prefill_first_tps"] = max(best["prefill_first_tps"], len(prompt) / first)
        best["ttft_s"] = min(best["ttft_s"], ttft)
        best["decode_tps"] = max(best["decode_tps"], n_gen / decode_s)
    cfg = dec.cfg
    mean_pos = len(prompt) + 1 + n_gen / 2
    bytes_per_token = dec.decode_weight_bytes + kv_bytes_read(cfg, mean_pos, np.dtype(kv_dtype).itemsize)
    peak = peak_bandwidth(dec.device)
    best["decode_bytes_per_token"] = bytes_per_token
    best["decode_bandwidth_gbs"] = bytes_per_token * best["decode_tps"] / 1e9
    best["peak_bandwidth_gbs"] = peak / 1e9
    best["decode_bandwidth_fraction"] = bytes_per_token * best["decode_tps"] / peak
    return best


def cmd_bench_cuda(args, lm, load_s: float) -> dict:
    """The figures `hearth bench --device cuda` prints, for a model already placed on the GPU."""
    import cupy as cp

    from engine.commands import bench_prompt

    dec = lm.model
    n_ctx = min(args.ctx, lm.context_length)
    prompt = bench_prompt(lm, args.prompt_tokens)
    r = bench_decoder(dec, prompt, args.gen_tokens, n_ctx, args.repetitions)
    props = cp.cuda.runtime.getDeviceProperties(dec.device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {
        "model": lm.name,
        "file": str(lm.path),
        "file_mb": round(lm.file_size / 2**20, 1),
        "device": f"cuda:{dec.device} ({name})",
        "decode_path": dec.decode_path,
        "matvec": "integer dot products (dp4a)" if dec.int_dot else "float dot products",
        "load_s": round(load_s, 3),
        "prefill_tokens": args.prompt_tokens,
        "prefill_tps": round(r["prefill_tps"], 2),
        "prefill_first_tps": round(r["prefill_first_tps"], 2),
        "prefill_graphs": dec.prefill_graphs and dec.prefill_graph_error is None,
        "prefill_weights": dec.prefill_weights,
        "decode_tokens": args.gen_tokens,
        "decode_tps": round(r["decode_tps"], 2),
        "ttft_s": round(r["ttft_s"], 4),
        "decode_gb_per_token": round(r["decode_bytes_per_token"] / 1e9, 4),
        "decode_bandwidth_gbs": round(r["decode_bandwidth_gbs"], 1),
        "peak_bandwidth_gbs": round(r["peak_bandwidth_gbs"], 1),
        # three significant figures: a tiny model's fraction is far below 0.001
        "decode_bandwidth_fraction": float(f"{r['decode_bandwidth_fraction']:.3g}"),
        "vram_used_mb": round(cp.get_default_memory_pool().used_bytes() / 2**20, 1),
    }
