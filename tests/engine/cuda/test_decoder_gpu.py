"""The CUDA decoder against the CPU model of the same file: logits within tolerance, identical
greedy tokens (tiny random llama/gemma3 files and both starter models). Needs a GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.loader import load_model
from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3
from tests.engine.tiny_models import T, TinySpec, write_tiny_gguf

pytestmark = pytest.mark.cuda

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 116, 104, 101, 32, 99, 97]


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _cpu_greedy(model, prompt, n):
    cache = model.new_cache(128)
    logits = model.forward(prompt, cache)
    out = [int(np.argmax(logits[-1]))]
    for _ in range(n - 1):
        out.append(int(np.argmax(model.forward([out[-1]], cache)[-1])))
    return out


def _gpu_greedy(dec, prompt, n, kv=np.float32):
    cache = dec.new_cache(128, kv)
    logits = dec.forward(prompt, cache)
    out = [int(np.argmax(logits[-1]))]
    for _ in range(n - 1):
        out.append(dec.greedy_step(out[-1], cache))
    return out


def _check(model, prompt, n_tokens=16, logit_tol=1e-3):
    from engine.backends.cuda.decoder import CudaDecoder

    dec = CudaDecoder(model, n_ctx=128, prefill_dtype="float32")
    cpu_cache, gpu_cache = model.new_cache(128), dec.new_cache(128, np.float32)
    ref = model.forward(prompt, cpu_cache, all_logits=True)
    got = dec.forward(prompt, gpu_cache, all_logits=True)
    assert got.shape == ref.shape and _rel(got, ref) < logit_tol
    # one decode step through the captured graph and through plain launches agree with the CPU
    nxt = int(np.argmax(ref[-1]))
    step_ref = model.forward([nxt], cpu_cache)
    plain = CudaDecoder(model, n_ctx=128, prefill_dtype="float32", use_graphs=False)
    plain_cache = plain.new_cache(128, np.float32)
    plain.forward(prompt, plain_cache)
    a = dec.forward([nxt], gpu_cache)
    b = plain.forward([nxt], plain_cache)
    assert _rel(a, step_ref) < logit_tol
    np.testing.assert_array_equal(a, b)
    assert _gpu_greedy(dec, prompt, n_tokens) == _cpu_greedy(model, prompt, n_tokens)
    # the fast defaults (float16 prefill tiles and KV cache) stay close and pick the same first token
    fast = CudaDecoder(model, n_ctx=128)
    logits16 = fast.forward(prompt, fast.new_cache(128))
    assert _rel(logits16[-1], ref[-1]) < 5e-2
    assert int(np.argmax(logits16[-1])) == nxt
    # prefill dequantizing tiles at each prompt instead of reading copies made at load: the same halves
    tiles = CudaDecoder(model, n_ctx=128, prefill_weights="tiles")
    assert fast.prefill_resident_bytes > 0 and tiles.prefill_resident_bytes == 0
    assert _rel(tiles.forward(prompt, tiles.new_cache(128))[-1], logits16[-1]) < 1e-3
    return dec


def _check_hybrid(model, prompt, n_tokens=16, logit_tol=1e-3):
    """Half the layers on the GPU, half on the CPU: the CPU model's logits and greedy tokens."""
    from engine.backends.cuda.hybrid import HybridDecoder

    hyb = HybridDecoder(model, model.cfg.num_hidden_layers // 2, n_ctx=128, prefill_dtype="float32")
    cpu_cache, cache = model.new_cache(128), hyb.new_cache(128, np.float32)
    ref = model.forward(prompt, cpu_cache, all_logits=True)
    assert _rel(hyb.forward(prompt, cache, all_logits=True), ref) < logit_tol
    out = [int(np.argmax(ref[-1]))]
    for _ in range(n_tokens - 1):
        out.append(int(np.argmax(hyb.forward([out[-1]], cache)[-1])))
    assert out == _cpu_greedy(model, prompt, n_tokens)


def _check_fused(model, prompt, n_tokens=16, logit_tol=1e-3):
    """The fused decode step (one persistent kernel): each step's logits close to the CPU model's (its
    activations are two int8 levels, a 15-bit grade like the CPU's int16), the same greedy tokens, full and
    head-only (partial offload)."""
    from engine.backends.cuda.decoder import CudaDecoder
    from engine.backends.cuda.hybrid import HybridDecoder

    dec = CudaDecoder(model, n_ctx=128, prefill_dtype="float32", decode_kernel="fused")
    assert dec.decode_path == "fused"
    cpu_cache, cache = model.new_cache(128), dec.new_cache(128, np.float32)
    token = int(np.argmax(model.forward(prompt, cpu_cache)[-1]))
    dec.forward(prompt, cache)
    for _ in range(3):
        ref = model.forward([token], cpu_cache)
        assert _rel(dec.forward([token], cache), ref) < logit_tol
        token = int(np.argmax(ref[-1]))
    assert _gpu_greedy(dec, prompt, n_tokens) == _cpu_greedy(model, prompt, n_tokens)
    n_gpu = model.cfg.num_hidden_layers // 2
    hyb = HybridDecoder(model, n_gpu, n_ctx=128, prefill_dtype="float32", decode_kernel="fused")
    assert hyb.gpu.decode_path == "fused"
    c = hyb.new_cache(128, np.float32)
    out = [int(np.argmax(hyb.forward(prompt, c)[-1]))]
    for _ in range(n_tokens - 1):
        out.append(int(np.argmax(hyb.forward([out[-1]], c)[-1])))
    assert out == _cpu_greedy(model, prompt, n_tokens)


def _check_prefill_graph(model, prompt):
    """Captured prefills (the default): prompts at position 0 of one cache (new chats on it); the
    first prefill runs launch by launch, the later ones replay a captured prefill padded to 64 or 128
    tokens, its cuBLAS calls through capture_blas. Logits of the last real token and the greedy step
    after it as the CPU's, and no capture refused."""
    from engine.backends.cuda.decoder import CudaDecoder

    dec = CudaDecoder(model, n_ctx=256, prefill_dtype="float32")
    dec.prefill_graphs = True
    cache = dec.new_cache(256, np.float32)
    for p in (prompt, prompt[::-1] + [5, 6], prompt[:3], (prompt * 20)[:100], prompt[:2] + [7]):
        cache.trim(cache.offset)
        cpu_cache = model.new_cache(256)
        ref = model.forward(p, cpu_cache)[-1]
        assert _rel(dec.forward(p, cache)[-1], ref) < 1e-3, dec.prefill_graph_error
        token = int(np.argmax(ref))
        assert dec.greedy_step(token, cache) == int(np.argmax(model.forward([token], cpu_cache)[-1]))
    assert dec.prefill_graph_error is None
    assert sorted(g.size for g in dec._prefill_graphs[cache].values()) == [64, 128]


def _kquant_tiny(path, spec: TinySpec, monkeypatch) -> None:
    """A tiny file in a K-quant (the engine's encoder: gguf.quants has no K-quant encoder)."""
    import gguf

    from engine.quant.encode import quantize

    plain = gguf.quants.quantize
    monkeypatch.setattr(
        gguf.quants, "quantize",
        lambda v, t: quantize(int(t), np.asarray(v, np.float32)) if t in (T.Q4_K, T.Q6_K) else plain(v, t),
    )
    write_tiny_gguf(path, spec)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_fused_step_k_quants(gpu, tmp_path, monkeypatch, qtype):
    path = tmp_path / "tiny-k.gguf"
    _kquant_tiny(path, TinySpec(matrix_type=qtype, hidden=256, ffn=512, heads=4, kv_heads=2), monkeypatch)
    _check_fused(load_model(path).model, PROMPT)


# the fused step's checks are tests of their own ("fused" in the name): scripts/cuda_device_check.sh runs
# them in a process of their own, so a fault there cannot take the other GPU tests along
TINY_LLAMA = pytest.mark.parametrize(
    "spec",
    [
        TinySpec(),
        TinySpec(matrix_type=T.Q8_0, seed=1, heads=8, kv_heads=2),
        TinySpec(arch="qwen2", qkv_bias=True, seed=2),
    ],
    ids=["f32", "q8_0", "qwen2"],
)
TINY_GEMMA3 = pytest.mark.parametrize(
    "spec",
    [
        TinyGemmaSpec(),
        TinyGemmaSpec(matrix_type=T.Q8_0, seed=5),
        TinyGemmaSpec(pattern=2, layers=4, final_softcap=3.0, seed=4),
    ],
    ids=["f32", "q8_0", "final-softcap"],
)


@TINY_LLAMA
def test_tiny_llama(gpu, tmp_path, spec):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, spec)
    _check(load_model(path).model, PROMPT)
    _check_hybrid(load_model(path).model, PROMPT)


@TINY_LLAMA
def test_prefill_graph_tiny_llama(gpu, tmp_path, spec):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, spec)
    _check_prefill_graph(load_model(path).model, PROMPT)


@TINY_GEMMA3
def test_prefill_graph_tiny_gemma3(gpu, tmp_path, spec):
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma3(path, spec)
    _check_prefill_graph(load_model(path).model, [258] + PROMPT)


@TINY_LLAMA
def test_fused_tiny_llama(gpu, tmp_path, spec):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, spec)
    _check_fused(load_model(path).model, PROMPT)


@TINY_GEMMA3
def test_tiny_gemma3(gpu, tmp_path, spec):
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma3(path, spec)
    _check(load_model(path).model, [258] + PROMPT)
    _check_hybrid(load_model(path).model, [258] + PROMPT)


@TINY_GEMMA3
def test_fused_tiny_gemma3(gpu, tmp_path, spec):
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma3(path, spec)
    _check_fused(load_model(path).model, [258] + PROMPT)


def _starter_prompt(path):
    lm = load_model(path)
    return lm, lm.tokenizer.encode("The capital of France is", add_special=True)


@pytest.mark.slow
def test_smollm2_starter(gpu, smollm2_gpu_path):
    lm, prompt = _starter_prompt(smollm2_gpu_path)
    _check(lm.model, prompt, 24, 2e-3)
    _check_hybrid(load_model(smollm2_gpu_path).model, prompt, 24, 2e-3)


@pytest.mark.slow
def test_fused_smollm2_starter(gpu, smollm2_gpu_path):
    lm, prompt = _starter_prompt(smollm2_gpu_path)
    _check_fused(lm.model, prompt, 24, 2e-3)


@pytest.mark.slow
def test_flash_prefill_smollm2_starter(gpu, smollm2_gpu_path, monkeypatch):
    """HEARTH_CUDA_FLASH's prefill attention (head size 64, 3 query heads a KV head) on the starter, in
    float16 as chats run it: a first prompt and a follow-up after cached tokens give the logits of the
    cuBLAS path within float16 rounding, and the same next token."""
    from engine.backends.cuda.decoder import CudaDecoder

    lm, prompt = _starter_prompt(smollm2_gpu_path)
    monkeypatch.setenv("HEARTH_CUDA_FLASH", "1")
    dec = CudaDecoder(lm.model, n_ctx=128)
    assert dec.flash and dec.flash_error is None  # its self-check passed
    follow = lm.tokenizer.encode(" Paris. And the capital of Italy is", add_special=False)
    got = {}
    for flag in (False, True):
        dec.flash = flag
        cache = dec.new_cache(128)
        first = dec.forward(prompt, cache, all_logits=True)
        got[flag] = first, dec.forward(follow, cache)[-1]
    for a, b in zip(got[True], got[False]):
        assert _rel(a, b) < 2e-2 and int(np.argmax(a[-1] if a.ndim > 1 else a)) == int(
            np.argmax(b[-1] if b.ndim > 1 else b)
        )


@pytest.mark.slow
def test_gemma3_starter(gpu, gemma3_gpu_path):
    lm, prompt = _starter_prompt(gemma3_gpu_path)
    _check(lm.model, prompt, 24, 2e-3)
    _check_hybrid(load_model(gemma3_gpu_path).model, prompt, 24, 2e-3)


@pytest.mark.slow
def test_fused_gemma3_starter(gpu, gemma3_gpu_path):
    lm, prompt = _starter_prompt(gemma3_gpu_path)
    _check_fused(lm.model, prompt, 24, 2e-3)


def test_vram_estimate_too_large_is_a_typed_error(gpu, tmp_path, monkeypatch):
    import cupy as cp

    from engine.backends.cuda.decoder import CudaDecoder
    from engine.backends.cuda.device import CudaOutOfMemoryError

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    monkeypatch.setattr(cp.cuda.runtime, "memGetInfo", lambda: (1 << 20, 1 << 30))
    with pytest.raises(CudaOutOfMemoryError, match="--device cpu"):
        CudaDecoder(load_model(path).model)


def test_upload_progress_and_run_on_gpu(gpu, tmp_path, capsys):
    from engine.backends.cuda.placement import place_model

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    lm = load_model(path)
    seen = []
    choice = place_model(lm, "cuda", n_ctx=64, progress=lambda done, total: seen.append((done, total)))
    assert str(choice.device) == "cuda:0" and choice.notice is None
    assert seen and seen[-1][0] == seen[-1][1] and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))
    from engine.cli import main

    assert main(["run", "-m", str(path), "--device", "cuda", "--temperature", "0", "-n", "4", "ab"]) == 0
    assert "CUDA unavailable" not in capsys.readouterr().err


def test_bench_reports_bandwidth_fraction(gpu, tmp_path, capsys):
    import json

    from engine.cli import main

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(ctx=256))
    argv = ["bench", "-m", str(path), "--device", "cuda", "-p", "64", "-g", "32", "--ctx", "128", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"].startswith("cuda:0") and out["decode_tps"] > 0 and out["prefill_tps"] > 0
    assert 0 < out["decode_bandwidth_fraction"] < 1.5


def _tiny_chat_model(tmp_path):
    path = tmp_path / "tiny-chat.gguf"
    write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, layers=4, seed=3))
    return path


@pytest.mark.parametrize("gpu_layers", [None, 2])
def test_chat_runner_on_the_gpu(gpu, tmp_path, gpu_layers):
    """The app's engine worker path: a chat turn on the GPU (fully or 2 of 4 layers) and a second turn
    reusing the cache reply what the CPU runner replies (float32 KV; prefill tiles in float16)."""
    from engine.client import LoadOptions
    from engine.generate import GenerationParams
    from engine.worker import ChatRunner

    path = _tiny_chat_model(tmp_path)
    greedy = GenerationParams(max_tokens=12, temperature=0.0)
    messages = [{"role": "user", "content": "Name three colours."}]

    def reply(runner):
        return [e.token for e in runner.chat(messages, greedy) if e.token is not None]

    options = LoadOptions(n_ctx=128, batch_size=64, prefix_cache_mb=16)
    want = reply(ChatRunner.load(path, options))
    gpu_runner = ChatRunner.load(path, dataclasses.replace(options, device="cuda", gpu_layers=gpu_layers))
    assert gpu_runner.info.device == ("cuda:0" if gpu_layers is None else "cuda:0 (2/4 layers)")
    got = reply(gpu_runner)
    assert got[:4] == want[:4]
    assert reply(gpu_runner)[:4] == want[:4]  # the next turn reuses the GPU cache


@pytest.mark.parametrize("gpu_layers", [None, 2])
def test_server_engine_batches_on_the_gpu(gpu, tmp_path, gpu_layers):
    """`hearth serve --device cuda`: four concurrent greedy requests through the scheduler's
    forward_batch on the GPU (fully or 2 of 4 layers) start as the CPU engine's replies."""
    import threading

    from engine.backends.cuda.placement import place_model
    from engine.server.scheduler import Engine, SeqParams
    from engine.templates import ensure_chat_template

    path = _tiny_chat_model(tmp_path)

    def replies(lm) -> list[list[int]]:
        ensure_chat_template(lm)
        engine = Engine(lm.model, lm.tokenizer, n_ctx=128, max_seqs=4, prefill_chunk=64, prefix_cache_bytes=0)
        engine.start()
        outs, done = [[] for _ in range(4)], [threading.Event() for _ in range(4)]
        try:
            for i in range(4):
                ids = lm.tokenizer.encode(f"Count from {i} to {i + 9}:", add_special=True)

                def emit(d, i=i):
                    if d.token is not None:
                        outs[i].append(d.token)
                    if d.finish_reason or d.error:
                        done[i].set()

                engine.submit(SeqParams(prompt_ids=ids, max_tokens=8, temperature=0.0), emit)
            assert all(e.wait(120) for e in done)
        finally:
            engine.stop()
        return outs

    want = replies(load_model(path))
    lm = load_model(path)
    place_model(lm, "cuda", n_ctx=128, gpu_layers=gpu_layers)
    got = replies(lm)
    assert all(got) and [g[:3] for g in got] == [w[:3] for w in want]


@pytest.mark.parametrize("arch, shared", [("qwen3moe", False), ("qwen2moe", True), ("llama", False)])
def test_moe_models_match_the_cpu(gpu, tmp_path, arch, shared):
    """Tiny MoE GGUFs (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral-style llama; Q8_0 | Q4_0 experts):
    prefill, graph and plain decode steps and 16 greedy tokens as on the CPU."""
    from tests.engine.cuda.test_moe_cuda import write_tiny_moe_gguf

    model = load_model(write_tiny_moe_gguf(tmp_path / f"{arch}.gguf", arch, shared)).model
    _check(model, PROMPT)


@pytest.mark.parametrize(
    "family", ["gpt-oss", "gemma2", "mistral-swa", "exaone4", "glm4", "granite", "smollm3", "olmo2", "olmo3",
               "ministral3", "phi3-longrope", "cohere", "cohere2", "lfm2", "qwen3_5", "granite4-h",
               "nemotron_h"]
)
def test_model_families_match_the_cpu(gpu, family):
    """The tiny checkpoints of gpt-oss (sinks, windows, biases, MXFP4 experts with the clamped SwiGLU),
    Gemma 2 (soft-capping), Mistral v0.1 (a window on every layer), EXAONE 4, GLM-4 and OLMo 2/3 (norms of
    the branch outputs, layers without RoPE, whole-projection q/k norms, per-layer RoPE), Granite (its
    multipliers), SmolLM3 (NoPE layers), Ministral 3, Phi-4-mini's LongRoPE, Command R+ and R7B, LFM2 (short
    convolutions), Qwen3.5 (DeltaNet layers, gated attention), Granite 4.0-H (Mamba-2 layers) and Nemotron-H
    (blocks of one branch, relu^2 MLPs): prefill,
    graph and plain decode steps and 16 greedy tokens as on the CPU (test_families_cuda.py checks the same on
    CPU threads)."""
    from pathlib import Path

    tiny = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
    _check(load_model(tiny / family).model, PROMPT)
