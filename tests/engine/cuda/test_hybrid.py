"""Partial offload (engine.backends.cuda.hybrid): the first layers on the GPU, the rest on the CPU.

Run without a GPU over test_decoder_dry's stand-in CuPy: launch checks, the VRAM plan, placement and
the joined KV cache; with the kernels executed on host threads (tests/engine/cuda/simt.py), the
hybrid decoder's logits against the CPU model's, also after a prefix-store round trip.
"""
# ruff: noqa: F811 - the stand-in CuPy fixtures are imported from test_decoder_dry

from __future__ import annotations

import numpy as np
import pytest

from engine.loader import load_model
from engine.prefix_cache import PrefixCache
from tests.engine.cuda.test_decoder_dry import STATE, _opt_in, _rel, fake, ptx_params, simt  # noqa: F401 - fixtures
from tests.engine.tiny_models import T, TinySpec, write_tiny_gguf


def _lm(tmp_path, layers: int = 2):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, layers=layers))
    return load_model(path)


def test_hybrid_runs_only_its_layers_on_the_gpu(fake, tmp_path):
    model = _lm(tmp_path, layers=3).model
    hyb = fake.hybrid.HybridDecoder(model, 1, n_ctx=64)
    assert hyb.gpu.output is None and len(hyb.gpu.layers) == 1 and hyb.placement == "cuda:0 (1/3 layers)"
    full = fake.decoder.CudaDecoder(model, n_ctx=64)
    assert hyb.weight_bytes < full.weight_bytes and hyb.gpu.decode_weight_bytes < full.decode_weight_bytes
    cache = hyb.new_cache(64)
    assert cache.gpu.k.shape[0] == 1 and cache.cpu.k.shape[0] == 2
    logits = hyb.forward([1, 2, 3, 4], cache)
    assert logits.shape == (1, model.cfg.vocab_size) and cache.offset == 4 and cache.gpu.offset == 4
    assert hyb.forward([5], cache).shape == (1, model.cfg.vocab_size) and cache.tokens == [1, 2, 3, 4, 5]
    assert hyb.forward([6, 7], cache, all_logits=True).shape == (2, model.cfg.vocab_size)
    assert cache.trim(3) == 3 and cache.gpu.offset == cache.cpu.offset == 4
    with pytest.raises(ValueError, match="hidden"):
        hyb.gpu.forward([1], cache.gpu)  # a head decoder has no logits
    with pytest.raises(ValueError, match="CPU computes the logits"):
        hyb.gpu.greedy_step(1, cache.gpu)
    with pytest.raises(ValueError, match="n_gpu_layers"):
        fake.hybrid.HybridDecoder(model, 3)


def test_cpu_half_failing_rolls_the_gpu_half_back(fake, tmp_path, monkeypatch):
    model = _lm(tmp_path).model
    hyb = fake.hybrid.HybridDecoder(model, 1, n_ctx=32)
    cache = hyb.new_cache(32)
    hyb.forward([1, 2], cache)

    def boom(*a, **k):
        raise MemoryError("out of memory in the CPU layers")

    monkeypatch.setattr(model, "forward_from", boom)
    with pytest.raises(MemoryError):
        hyb.forward([3], cache)
    assert cache.gpu.tokens == cache.cpu.tokens == [1, 2]


def test_vram_plan_suggests_the_layers_that_fit(fake, tmp_path, monkeypatch):
    model = _lm(tmp_path, layers=4).model
    est = [fake.decoder.estimate_vram(model, 64, n_layers=n) for n in range(5)]
    assert est == sorted(est) and est[4] == fake.decoder.estimate_vram(model, 64)
    assert est[4] - est[3] > est[3] - est[2]  # the output projection only comes with every layer
    free = (est[2] + est[3]) // 2
    assert fake.decoder.layers_that_fit(model, 64, free) == 2
    assert fake.decoder.layers_that_fit(model, 64, est[0] - 1) == 0
    assert fake.decoder.layers_that_fit(model, 64, est[4]) == 4
    monkeypatch.setattr(fake.cp.cuda.runtime, "memGetInfo", lambda: (free, 1 << 40))
    from engine.backends.cuda.device import CudaOutOfMemoryError

    with pytest.raises(CudaOutOfMemoryError, match=r"offload only 2 of the 4 layers \(--gpu-layers 2\)") as e:
        fake.decoder.CudaDecoder(model, n_ctx=64)
    assert e.value.layers_fit == 2
    fake.hybrid.HybridDecoder(model, 2, n_ctx=64)  # what the message suggests loads


def test_place_model_gpu_layers(fake, tmp_path):
    from engine.backends.cuda.placement import place_model

    lm = _lm(tmp_path, layers=3)
    cpu_model = lm.model
    assert place_model(lm, "cuda", n_ctx=32, gpu_layers=0).device.kind == "cpu" and lm.model is cpu_model
    with pytest.raises(ValueError, match="gpu_layers"):
        place_model(lm, "cuda", gpu_layers=-1)
    assert str(place_model(lm, "cuda", n_ctx=32, gpu_layers=2).device) == "cuda:0"
    assert lm.model.placement == "cuda:0 (2/3 layers)"
    lm.model = cpu_model
    place_model(lm, "cuda:0", n_ctx=32, gpu_layers=99)
    assert lm.model.placement == "cuda:0" and not lm.model.head_only


@pytest.mark.parametrize("gpu_layers", [None, 1])
@pytest.mark.parametrize(
    "family, reason",
    [("gemma4", "Gemma4Model"), ("deepseek_v3", "latent attention"), ("gemma3n", "Gemma3nModel")],
)
def test_a_model_without_cuda_kernels_stays_on_the_cpu_with_a_notice(fake, gpu_layers, family, reason):
    """Gemma 4, DeepSeek-V3 or Gemma 3n (no CUDA kernels yet) asked onto the GPU, wholly or in part,
    runs on the CPU; the notice says why (the app shows it as a load warning)."""
    from pathlib import Path

    from engine.backends.cuda.placement import place_model

    lm = load_model(Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / family)
    cpu_model, notices = lm.model, []
    choice = place_model(lm, "cuda", n_ctx=32, notify=notices.append, gpu_layers=gpu_layers)
    assert choice.device.kind == "cpu" and lm.model is cpu_model
    assert notices == [choice.notice] and reason in choice.notice
    assert choice.notice.endswith("running on the CPU instead") and "--device cpu" not in choice.notice


def test_a_weight_type_without_cuda_kernels_stays_on_the_cpu_with_its_name(fake, tmp_path):
    """A matrix of a type without CUDA kernels (IQ2_XXS's type id on Q8_0 bytes: the check looks at the
    type alone) in a model the CUDA backend otherwise runs."""
    from engine.backends.cuda.placement import place_model
    from engine.weights import Weight

    lm = _lm(tmp_path)
    w = lm.model.layers[1].w_down
    lm.model.layers[1].w_down = Weight(16, w.raw[:, :66], w.rows, w.cols)
    cpu_model, notices = lm.model, []
    choice = place_model(lm, "cuda", n_ctx=32, notify=notices.append)
    assert choice.device.kind == "cpu" and lm.model is cpu_model
    assert notices == ["IQ2_XXS has no CUDA kernel; running on the CPU instead"]


def test_hybrid_cache_read_write_round_trip(fake, tmp_path):
    model = _lm(tmp_path, layers=3).model
    hyb = fake.hybrid.HybridDecoder(model, 1, n_ctx=16)
    cache = hyb.new_cache(16)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, model.cfg.num_key_value_heads, 5, model.cfg.head_dim)).astype(np.float32)
    v = -k
    cache.write(2, k, v)
    got_k, got_v = cache.read(2, 7)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    np.testing.assert_array_equal(np.asarray(cache.gpu.k[0, :, 2:7]), k[0])
    np.testing.assert_array_equal(cache.cpu.k[1, :, 2:7], k[2])
    assert cache.bytes_per_token == 2 * 3 * model.cfg.num_key_value_heads * model.cfg.head_dim * 4


def test_hybrid_decoder_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path):
    """1 of 2 layers on (emulated) GPU threads: prefill, graph-captured decode steps, and a restore
    from the prefix store into a fresh hybrid cache give the CPU model's logits."""
    STATE.simt = simt
    model = _lm(tmp_path).model
    hyb = fake.hybrid.HybridDecoder(model, 1, n_ctx=32, prefill_dtype="float32")
    prompt = [1, 2, 3]
    cpu_cache, cache = model.new_cache(32), hyb.new_cache(32, np.float32)
    ref = model.forward(prompt, cpu_cache, all_logits=True)
    assert _rel(hyb.forward(prompt, cache, all_logits=True), ref) < 1e-3
    token = int(np.argmax(ref[-1]))
    for _ in range(2):  # capture, then replay
        ref_step = model.forward([token], cpu_cache)
        assert _rel(hyb.forward([token], cache), ref_step) < 1e-3
        token = int(np.argmax(ref_step[-1]))
    store = PrefixCache(1 << 20)
    store.insert(cache)
    fresh = hyb.new_cache(32, np.float32)
    assert store.restore(cache.tokens + [token], fresh) == cache.offset and fresh.tokens == cache.tokens
    assert _rel(hyb.forward([token], fresh), model.forward([token], cpu_cache)) < 1e-3


def test_forward_batch_keeps_a_step_per_batch(fake, tmp_path):
    """forward_batch on the GPU (full and hybrid): a batch of caches gets its own step (buffers and
    graph), dropped once one of its caches is gone; one-sequence steps stay per cache; bad batches are
    refused as on the CPU."""
    import gc

    model = _lm(tmp_path, layers=2).model
    full = fake.decoder.CudaDecoder(model, n_ctx=32)
    caches = [full.new_cache(32) for _ in range(3)]
    for i, c in enumerate(caches):
        full.forward([1, 2, 3, 4][: i + 2], c)
    out = full.forward_batch([4, 5, 6], caches)
    assert out.shape == (3, model.cfg.vocab_size) and [c.offset for c in caches] == [3, 4, 5]
    assert len(full._batches) == 1 and len(full._steps) == 0  # prefills take no step
    full.forward([7], caches[0])
    assert len(full._steps) == 1
    with pytest.raises(ValueError, match="its own KV cache"):
        full.forward_batch([1, 2], [caches[0], caches[0]])
    del caches, c
    gc.collect()
    assert len(full._steps) == 0
    pair = [full.new_cache(32) for _ in range(2)]
    full.forward_batch([1, 2], pair)
    assert list(full._batches.values())[0].holds(pair) and len(full._batches) == 1  # the dead batch went
    hyb = fake.hybrid.HybridDecoder(model, 1, n_ctx=32)
    hc = [hyb.new_cache(32) for _ in range(2)]
    for c in hc:
        hyb.forward([1, 2], c)
    assert hyb.forward_batch([3, 4], hc).shape == (2, model.cfg.vocab_size)
    assert all(c.gpu.tokens == c.cpu.tokens == [1, 2, t] for c, t in zip(hc, [3, 4]))
    with pytest.raises(ValueError, match="hidden_batch|every layer"):
        full.hidden_batch([1], [full.new_cache(8)])


def test_hybrid_forward_batch_matches_the_cpu_on_host_threads(fake, simt, tmp_path):
    """Two sequences at different positions, one batched step: the CPU model's forward_batch logits."""
    STATE.simt = simt
    model = _lm(tmp_path).model
    hyb = fake.hybrid.HybridDecoder(model, 1, n_ctx=32, prefill_dtype="float32")
    prompts = [[1, 2, 3], [4, 5]]
    cpu_caches = [model.new_cache(32) for _ in prompts]
    caches = [hyb.new_cache(32, np.float32) for _ in prompts]
    for p, cc, c in zip(prompts, cpu_caches, caches):
        model.forward(p, cc)
        hyb.forward(p, c)
    ref = model.forward_batch([7, 8], cpu_caches).copy()
    assert _rel(hyb.forward_batch([7, 8], caches), ref) < 1e-3


def test_batched_decode_shares_weight_reads_and_a_graph_per_batch(fake, tmp_path):
    """forward_batch: one matvec launch per matrix group (matvec_qb, or a float kernel) and one attention
    launch per layer for the whole batch (no per-sequence launches), captured once per batch of caches
    and replayed; a new batch gets its own capture, and only the latest BATCH_GRAPHS batches are kept."""
    model = _lm(tmp_path, layers=2).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32)
    assert dec.batchable
    caches = [dec.new_cache(32) for _ in range(6)]
    for i, c in enumerate(caches):
        dec.forward([1, 2, 3][: 1 + i % 3], c)
    fake.launches.clear()
    captures = fake.cp.cuda.Stream.captures
    n0 = captures.count("begin")
    out = dec.forward_batch([4, 5, 6], caches[:3])
    assert out.shape == (3, model.cfg.vocab_size) and captures.count("begin") == n0 + 1
    step = fake.launches[: len(fake.launches) // 2]  # the warm-up run, then the capture's replay
    # one launch per matrix group for all 3 sequences: qkv, wo, gate|up, down per layer; logits
    assert step.count("matvec_qb") == 4 * 2 + 1
    assert step.count("attn_decode") == 2 and "rope_store" not in step  # RoPE inside attention
    dec.forward_batch([7, 8, 9], caches[:3])
    assert captures.count("begin") == n0 + 1  # replayed
    for k in range(3, 6):  # more batches than are kept
        dec.forward_batch([1, 2], [caches[k - 3], caches[k]])
    assert len(dec._batches) == fake.decoder.BATCH_GRAPHS and captures.count("begin") == n0 + 4
    bs = next(iter(dec._batches.values()))
    assert not bs.holds([dec.new_cache(32), dec.new_cache(32)])
    dec.int_dot = False  # float dot products: the float kernels read each row once for the batch too
    fake.launches.clear()
    dec.forward_batch([1, 2], caches[:2])
    step = fake.launches[: len(fake.launches) // 2]
    assert "matvec_qb" not in step and step.count("matvec_q8_0") == 4 * 2 + 1
    assert captures.count("begin") == n0 + 5


def test_a_stack_mixing_kernels_runs_its_later_part_per_sequence(fake, tmp_path):
    """q|k|v as Q8_0, Q8_0 and float16: the batch's q|k launch reads them once for all 3 sequences and v
    takes a float16 launch per sequence (it starts inside the stack's rows); batchable says so."""
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, types=(("blk.0.attn_v.weight", T.F16),)))
    dec = fake.decoder.CudaDecoder(load_model(path).model, n_ctx=32)
    assert not dec.batchable
    caches = [dec.new_cache(32) for _ in range(3)]
    for c in caches:
        dec.forward([1, 2], c)
    fake.launches.clear()
    dec.forward_batch([3, 4, 5], caches)
    step = fake.launches[: len(fake.launches) // 2]  # the warm-up run, then the capture
    assert step.count("matvec_f16") == 3 and step.count("matvec_qb") == 4 * 2 + 1


@pytest.mark.parametrize("int_dot", [True, False])
@pytest.mark.parametrize("kind", ["llama", *_opt_in("qwen2", "gemma3")])  # gemma3: ~4 min here
def test_batched_decode_matches_the_cpu_on_host_threads(fake, simt, tmp_path, kind, int_dot):
    """Three sequences at different positions, batched steps on host threads: the CPU model's
    forward_batch logits (1e-3), and the GPU's own one-sequence steps (1e-5: the same arithmetic).
    Integer and float dot products alike read each weight once for the batch: a matvec launch a
    stacked projection."""
    from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3

    STATE.simt = simt
    path = tmp_path / f"{kind}.gguf"
    if kind == "gemma3":
        write_tiny_gemma3(path, TinyGemmaSpec(matrix_type=T.Q8_0, final_softcap=3.0))
    else:
        write_tiny_gguf(path, TinySpec(arch=kind, matrix_type=T.Q8_0, qkv_bias=kind == "qwen2"))
    model = load_model(path).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32", int_dot=int_dot)
    assert dec.batchable
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    cpu = [model.new_cache(32) for _ in prompts]
    gpu = [dec.new_cache(32, np.float32) for _ in prompts]
    solo = [dec.new_cache(32, np.float32) for _ in prompts]
    for p, a, b, c in zip(prompts, cpu, gpu, solo):
        model.forward(p, a)
        dec.forward(p, b)
        dec.forward(p, c)
    for tokens in ([11, 12, 13], [14, 15, 16]):  # the second step replays the captured graph
        ref = model.forward_batch(tokens, cpu).copy()
        fake.launches.clear()
        got = dec.forward_batch(tokens, gpu)
        matvec = "matvec_qb" if int_dot else "matvec_q8_0"
        # a launch a stacked projection for the batch: run and captured at the first step, then replayed
        assert fake.launches.count(matvec) == 2 * (4 * dec.n_layers + 1) * (tokens[0] == 11)
        assert _rel(got, ref) < 1e-3
        one = np.concatenate([dec.forward([t], c) for t, c in zip(tokens, solo)])
        assert _rel(got, one) < 1e-5


def test_a_load_planned_for_the_gpu_that_stays_on_the_cpu_must_fit_in_ram(fake, monkeypatch):
    """ChatRunner.load plans RAM with the layers on the GPU; when the model then stays on the CPU (no CUDA
    kernels for it), the check runs again without them: too little RAM is a typed refusal, not a load that
    swaps."""
    from pathlib import Path

    from engine import memory_guard, worker
    from engine.client import LoadOptions
    from engine.memory_guard import InsufficientMemoryError

    folder = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "gemma3n"
    options = LoadOptions(device="cuda", n_ctx=128, batch_size=16, prefix_cache_mb=0)
    monkeypatch.setattr(worker, "gpu_layers_planned", lambda opts, n: n)  # the fake GPU takes every layer
    weights, shape = worker._model_shape(folder)
    on_gpu = memory_guard.estimate(weights, shape, 128, 16, 1 << 40, 2, shape.n_layers).total_bytes
    on_cpu = memory_guard.estimate(weights, shape, 128, 16, 1 << 40, 2, 0).total_bytes
    assert on_cpu > on_gpu
    between = int((on_gpu + on_cpu) / 2 / memory_guard.HEADROOM)
    warnings = []
    with pytest.raises(InsufficientMemoryError):
        worker.ChatRunner.load(folder, options, lambda p: warnings.append(p.message), available=between)
    assert any("Gemma3nModel" in w for w in warnings)
    runner = worker.ChatRunner.load(folder, options, available=int(on_cpu / memory_guard.HEADROOM) + 1)
    assert runner.estimate.weights_bytes == weights  # planned for the CPU after the fallback


def test_hybrid_cache_of_a_model_with_convolution_layers_round_trips_its_inputs(fake):
    """LFM2 with its first layer (a convolution) on the GPU: the two halves' caches keep convolution inputs
    (the GPU's one layer, the CPU's other two), and read / write (the prefix store's) carry them with the
    keys and values, the GPU's layers first."""
    from pathlib import Path

    from engine.loader import load_model

    model = load_model(Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "lfm2").model
    cache = fake.hybrid.HybridDecoder(model, 1, n_ctx=16).new_cache(16)
    assert cache.gpu.k.shape[0] == 0 and cache.gpu.conv.shape[0] == 1
    assert cache.cpu.k.shape[0] == 1 and cache.cpu.conv.shape[0] == 2
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, model.cfg.num_key_value_heads, 5, model.cfg.head_dim)).astype(np.float32)
    conv = rng.standard_normal((3, 1, 5, model.cfg.hidden_size)).astype(np.float32)
    cache.write(2, k, -k, conv)
    got = cache.read(2, 7)
    for a, b in zip(got, (k, -k, conv)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(cache.gpu.conv[0, 0, 2:7]), conv[0, 0])
    np.testing.assert_array_equal(cache.cpu.conv[1, 0, 2:7], conv[2, 0])
