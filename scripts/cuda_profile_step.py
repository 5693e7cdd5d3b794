"""Where a CUDA decode step's time goes, op by op (GPU machine): the 1B-shaped model of
scripts/cuda_bench_1b.py after a prompt, each launch of one layer's step (and the head's) captured
`--reps` times in a CUDA graph of its own and replayed between CUDA events, so that the figure is GPU
time per launch without Python's launch overhead; then the whole step's graph replayed back to back
(no host round trip) against greedy_step (which waits for each token on the host).

Usage: python3 scripts/cuda_profile_step.py --out profile.json [--type Q4_K] [--prompt 512]
  --ncu-quick: build, prefill and run a few steps kernel by kernel only (for a profiler's command line)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_bench_1b import VOCAB, build_gguf, graph_seconds, open_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hearth-1b"))
    ap.add_argument("--ncu-quick", action="store_true")
    args = ap.parse_args()

    import cupy as cp

    from engine.backends.cuda import ops
    from engine.backends.cuda.decoder import CudaDecoder, _matvecs

    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / f"llama-1b-random.{args.type}.gguf"
    if not path.exists():
        build_gguf(path, args.type)
    model = open_model(path)
    n_ctx = args.prompt + 256
    dec = CudaDecoder(model, n_ctx=n_ctx, decode_kernel="graphs")
    prompt = np.random.default_rng(1).integers(0, VOCAB, args.prompt).tolist()
    cache = dec.new_cache(n_ctx)
    tok = int(np.argmax(dec.forward(prompt, cache)[-1]))
    if args.ncu_quick:
        dec.use_graphs = False
        for _ in range(3):
            tok = dec.greedy_step(tok, cache)
        cp.cuda.Device().synchronize()
        return 0
    tok = dec.greedy_step(tok, cache)  # the step's buffers and graph
    s = dec._steps[cache]
    cfg, L, eps = dec.cfg, dec.layers[0], dec.cfg.rms_norm_eps
    mv = functools.partial(_matvecs, int_dot=dec.int_dot)
    rope = (L["inv_freq"], dec.n_rot, dec.neox, eps, L["q_norm"], L["k_norm"])
    keys = (cache.n_ctx, L["window"], s.parts[0])
    qkv, gu = [L["wq"], L["wk"], L["wv"]], [L["w_gate"], L["w_up"]]
    n_heads, kv0 = cfg.num_attention_heads, (cache.k[0], cache.v[0])
    wq = L["wq"]
    head256 = ops.GpuWeight(wq.ggml_type, wq.raw[:256], 256, wq.cols)

    def to_norm(norm):  # records of the residual stream for the next RMSNorm's matvec
        return ops.Emit(ops.EMIT_NORM, norm, s.x_rec, s.counts)

    ops_ = {
        "embed_dequant": lambda: ops.dequant(s.x, dec.token_embd, ids=s.ids, scale=dec.embed_scale),
        "qkv_matvec": lambda: mv(s.qkv, qkv, s.x, norm=L["attn_norm"], eps=eps, prologue=1),
        "attention": lambda: ops.attention(
            s.attn[0], s.qkv[0], n_heads, *kv0, s.pos[0:1], rope, dec.scale, *keys
        ),
        "wo_matvec": lambda: mv(s.o, [L["wo"]], s.attn),
        "gate_up_matvec": lambda: mv(s.gu, gu, s.x, norm=L["ffn_norm"], eps=eps, prologue=1),
        "down_matvec": lambda: mv(s.o, [L["w_down"]], s.gu, cols_x2=True, prologue=2),
        "lm_head_matvec": lambda: mv(s.logits, [dec.output], s.x, norm=dec.output_norm, eps=eps, prologue=1),
        "argmax": lambda: ops.argmax(s.ids[:1], s.logits[0], s.argmax_parts),
        # what a matvec costs beyond reading its weights: the same q|k|v without the RMSNorm prologue,
        # and 256 rows of wq alone (one row per warp: launch, input quantization and one row's latency)
        "qkv_matvec_no_norm": lambda: mv(s.qkv, qkv, s.x),
        "rows256_matvec": lambda: mv(s.qkv, [head256], s.x, norm=L["attn_norm"], eps=eps, prologue=1),
        # the hand-off (decoder.handoff, ops.Emit): each matvec reads the records the one before emitted
        # instead of quantizing its float input in every block, and emits its own for the next
        "qkv_matvec_handoff": lambda: mv(s.qkv, qkv, s.x_rec, eps=eps, prologue=5),
        "attention_handoff": lambda: ops.attention(
            s.attn[0], s.qkv[0], n_heads, *kv0, s.pos[0:1], rope, dec.scale, *keys, records=s.attn_rec[0]
        ),
        "wo_matvec_handoff": lambda: mv(s.o, [L["wo"]], s.attn_rec, prologue=4, emit=to_norm(L["ffn_norm"])),
        "gate_up_matvec_handoff": lambda: mv(
            s.gu, gu, s.x_rec, eps=eps, prologue=5, emit=ops.Emit(ops.EMIT_SILU, None, s.act_rec, s.counts)
        ),
        "down_matvec_handoff": lambda: mv(
            s.o, [L["w_down"]], s.act_rec, prologue=4, emit=to_norm(L["attn_norm"])
        ),
        "lm_head_matvec_handoff": lambda: mv(s.logits, [dec.output], s.x_rec, eps=eps, prologue=5),
    }
    nbytes = {
        "qkv_matvec": sum(L[k].nbytes for k in ("wq", "wk", "wv")),
        "qkv_matvec_no_norm": sum(L[k].nbytes for k in ("wq", "wk", "wv")),
        "wo_matvec": L["wo"].nbytes,
        "gate_up_matvec": L["w_gate"].nbytes + L["w_up"].nbytes,
        "down_matvec": L["w_down"].nbytes,
        "lm_head_matvec": dec.output.nbytes,
    }
    nbytes.update({f"{k}_handoff": v for k, v in list(nbytes.items()) if k != "qkv_matvec_no_norm"})
    layer_ops = ("qkv_matvec", "attention", "wo_matvec", "gate_up_matvec", "down_matvec")
    handoff_s = 0.0
    res: dict = {"type": args.type, "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    layer_s = 0.0
    for name, fn in ops_.items():
        try:
            t = graph_seconds(dec.stream, fn, replays=5, reps=args.reps)
        except Exception as e:  # noqa: BLE001 - the other ops' figures stand
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"
            print(name, res[f"{name}_error"], flush=True)
            continue
        res[f"{name}_us"] = round(t * 1e6, 2)
        if name in nbytes:
            res[f"{name}_gbs"] = round(nbytes[name] / t / 1e9, 1)
        if name in layer_ops:
            layer_s += t
        if name.endswith("_handoff") and name.removesuffix("_handoff") in layer_ops:
            handoff_s += t
        print(name, res[f"{name}_us"], "us", res.get(f"{name}_gbs", ""), flush=True)
    res["layer_sum_us"] = round(layer_s * 1e6, 1)
    res["handoff_layer_sum_us"] = round(handoff_s * 1e6, 1)  # the default step's layer (decoder.handoff)
    head_us = sum(res.get(f"{k}_us", 0.0) for k in ("lm_head_matvec", "argmax", "embed_dequant"))
    res["step_sum_estimate_us"] = round(layer_s * 1e6 * len(dec.layers) + head_us, 1)
    # a 32-element kernel's graph time: the floor of one launch inside a graph
    tiny = s.o[0, :32]
    tiny_s = graph_seconds(dec.stream, lambda: ops.softcap(tiny, 30.0), reps=50)
    res["tiny_launch_us"] = round(tiny_s * 1e6, 2)
    # the whole step: graph replays back to back, against greedy_step's host round trip per token
    graph = s.graphs[True]
    with dec.stream:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(dec.stream)
        for _ in range(20):
            graph.launch(dec.stream)
        end.record(dec.stream)
        end.synchronize()
    res["step_graph_us"] = round(cp.cuda.get_elapsed_time(start, end) * 1e3 / 20, 1)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        tok = dec.greedy_step(tok, cache)
    res["greedy_step_us"] = round((time.perf_counter() - t0) * 1e6 / 20, 1)
    res.update(_prefill_host_profile(dec, prompt, n_ctx, args.out.with_name("prefill_host_profile.txt")))
    print(json.dumps(res, indent=1))
    args.out.write_text(json.dumps(res, indent=1))
    return 0


def _prefill_host_profile(dec, prompt: list[int], n_ctx: int, path: Path) -> dict:
    """The host's side of a prefill: its wall time and the time to enqueue it (the second of five, no
    profiler), and cProfile's top functions (by own time) over the last three, written to path."""
    import cProfile
    import io
    import pstats

    import cupy as cp

    ids = cp.asarray(np.asarray(prompt, np.int32))
    times = []
    prof = cProfile.Profile()
    for i in range(5):
        cache = dec.new_cache(n_ctx)
        pos = cp.asarray(np.array([cache.offset], np.int32))
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        if i >= 2:
            prof.enable()
        with dec.stream:
            dec._prefill_kernels(ids, pos, cache, False)
        if i >= 2:
            prof.disable()
        t1 = time.perf_counter()
        dec.stream.synchronize()
        times.append((t1 - t0, time.perf_counter() - t0))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    path.write_text(out.getvalue())
    issue, total = times[1]
    return {"prefill_issue_ms": round(issue * 1e3, 2), "prefill_total_ms": round(total * 1e3, 2)}


if __name__ == "__main__":
    sys.exit(main())
