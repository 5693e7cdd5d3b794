"""Gemma 3n (text): AltUp streams, LAuReL, per-layer embeddings, activation sparsity and shared-KV layers.

The fixture (tests/fixtures/tiny/gemma3n, scripts/make_tiny_checkpoints.py) is E2B-style: 6 layers (windowed,
windowed, global, windowed, windowed, global), the last 2 reusing layers 3's and 2's keys and values, the
first 2 sparsifying their gate activations, a per-layer embedding table shorter than the vocabulary.
test_hf_repo checks its logits at every position and its greedy tokens against transformers; here: the same
golden on the paths a chat takes (chunked prefill, the last-row prompt pass, trims, stored prefixes, a second
turn, batched decode, speculation), the released multimodal layout, memory estimates, and mutations of each
Gemma 3n piece missing the golden (so the test can fail).
"""

from __future__ import annotations

import json
import shutil
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from engine.kv_cache import GroupedKVCache
from engine.loader import load_model
from engine.prefix_cache import PrefixCache
from tests.engine.model_checks import (
    check_batched_decode,
    check_speculation_keeps_greedy,
    chunked_logits,
    rewrite_gguf,
)

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
GOLDEN = json.loads((TINY / "gemma3n" / "golden.json").read_text())
TOKENS, REF = GOLDEN["tokens"], np.array(GOLDEN["logits"])
TOL = 1e-4 * np.abs(REF).max()


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY / "gemma3n")


def _error(model) -> float:
    return float(np.abs(model.forward(TOKENS, model.new_cache(32), all_logits=True) - REF).max())


def test_config_and_cache_layout(lm):
    """Layers 4 and 5 read layers 3's and 2's keys and values and keep none: the cache holds 4 layers of one
    head shape; the first 2 layers sparsify (icdf(0.95) standard deviations); 4 AltUp streams."""
    m = lm.model
    cfg = m.cfg
    assert cfg.architecture == "gemma3n" and cfg.kv_sources == [0, 1, 2, 3, 3, 2]
    assert [layer.wk is None for layer in m.layers] == [False] * 4 + [True] * 2
    assert [layer.sparsity_std is not None for layer in m.layers] == [True, True] + [False] * 4
    assert m.layers[0].sparsity_std == pytest.approx(1.6448536, abs=1e-6)
    assert cfg.altup_num_inputs == 4 and len(m.altup_proj) == len(m.altup_unembd) == 3
    cache = m.new_cache(32)
    assert isinstance(cache, GroupedKVCache) and cache.partial_states
    assert [k.shape for k, _ in cache.groups] == [(4, 2, 32, 16)]
    assert cache.bytes_per_token == 2 * 4 * 2 * 16 * 4


def test_prompt_pass_for_the_last_logits_runs_shared_layers_on_the_last_row(lm):
    m = lm.model
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32))[-1], REF[-1], atol=TOL)


def test_prefill_in_chunks_matches_one_pass(lm):
    np.testing.assert_allclose(chunked_logits(lm.model, TOKENS, (5, 1, 2, 7, 1)), REF, atol=TOL)


def test_trim_restored_prefix_and_float16_cache(lm):
    m = lm.model
    cache = m.new_cache(32)
    m.forward(TOKENS[:12], cache)
    assert cache.trim(4) == 4
    np.testing.assert_allclose(m.forward(TOKENS[8:], cache, all_logits=True), REF[8:], atol=TOL)
    store = PrefixCache(1 << 20)
    assert store.insert(cache) == 16 * cache.bytes_per_token
    fresh = m.new_cache(32)
    assert store.restore(TOKENS[:9] + [77, 78], fresh) == 9
    np.testing.assert_allclose(m.forward(TOKENS[9:], fresh, all_logits=True), REF[9:], atol=TOL)
    half = m.new_cache(32, np.float16)
    assert np.abs(m.forward(TOKENS, half, all_logits=True) - REF).max() < 2e-2 * np.abs(REF).max()


def test_second_chat_turn_reuses_the_first_and_replies_as_a_fresh_run(lm):
    from engine.generate import GenerationParams, generate

    m, tok = lm.model, lm.tokenizer
    params = GenerationParams(max_tokens=6, temperature=0.0)
    cache = m.new_cache(128)
    reply = [e.token for e in generate(m, tok, TOKENS, cache, params)]
    assert len(reply) == 6
    turn2 = TOKENS + reply + [5, 17, 42, 99]
    second = list(generate(m, tok, turn2, cache, params))
    assert second[-1].cached_tokens == len(TOKENS) + len(reply) - 1
    fresh = [e.token for e in generate(m, tok, turn2, m.new_cache(128), params)]
    assert [e.token for e in second] == fresh


def test_batched_decode_matches_one_sequence_at_a_time(lm):
    check_batched_decode(lm.model, ([5, 17, 42], [99, 3, 250, 77, 1, 300], [8]), (8, 310, 33))


def test_speculation_with_rejections_keeps_greedy_output(lm):
    events = check_speculation_keeps_greedy(lm.model, lm.tokenizer, TOKENS[:6] * 3)
    assert events[-1].drafted_tokens > 0


@pytest.mark.parametrize("mutation", ["router_free_correction", "no_kv_sharing", "dense_mlp", "no_laurel"])
def test_each_gemma3n_piece_is_needed_for_the_golden(mutation):
    """Breaking one piece at a time misses transformers' logits by far more than the tolerance: correction
    coefficients not chosen by the router (each stream corrected by the bare innovation), the shared layers
    attending over the first layer of their kind rather than the last, no activation sparsity, and LAuReL's
    low-rank branch dropped (its output the normed input alone)."""
    m = load_model(TINY / "gemma3n").model
    assert _error(m) < TOL
    if mutation == "router_free_correction":
        for block in m.blocks:
            block.correct[:] = 0.0
    elif mutation == "no_kv_sharing":
        m.layers[4].kv_slot = 0
    elif mutation == "dense_mlp":
        for layer in m.layers:
            layer.sparsity_std = None
    else:
        for block in m.blocks:
            block.laurel_norm[:] = 0.0
    assert _error(m) > 10 * TOL


def _rename_safetensors(src: Path, dst: Path, rename, extra: dict[str, np.ndarray]) -> None:
    """src's tensors under rename(name), plus float32 `extra` tensors (the file's bytes otherwise kept)."""
    raw = src.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {rename(k): v for k, v in header.items() if k != "__metadata__"}
    blobs = [data]
    off = len(data)
    for name, array in extra.items():
        blob = np.ascontiguousarray(array, np.float32).tobytes()
        out[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    head = json.dumps(out).encode()
    dst.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_released_multimodal_folder_reads_its_language_model_and_no_images(lm, tmp_path):
    """Gemma3nForConditionalGeneration's layout (config text_config of model_type gemma3n_text, tensors under
    model.language_model., vision and audio towers beside them): the language model gives the golden, the
    towers are left out, and an image gets the typed "reads no images" error."""
    from engine.errors import ImageInputError
    from engine.vision import prepare_messages

    folder = tmp_path / "gemma3n-mm"
    shutil.copytree(TINY / "gemma3n", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    text = json.loads((TINY / "gemma3n" / "config.json").read_text())
    config = {"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"],
              "text_config": text, "vision_config": {"model_type": "gemma3n_vision"},
              "audio_config": {"model_type": "gemma3n_audio"}}
    (folder / "config.json").write_text(json.dumps(config))
    towers = {"model.vision_tower.timm_model.conv_stem.conv.weight": np.ones((4, 3, 3, 3)),
              "model.audio_tower.conformer.0.ffw_layer_start.post_layer_norm.weight": np.ones(4),
              "model.embed_vision.embedding.weight": np.ones((2, 64))}
    _rename_safetensors(TINY / "gemma3n" / "model.safetensors", folder / "model.safetensors",
                        lambda k: k.replace("model.", "model.language_model.", 1), towers)
    mm = load_model(folder)
    assert mm.model.cfg == lm.model.cfg
    logits = mm.model.forward(TOKENS, mm.model.new_cache(32), all_logits=True)
    np.testing.assert_allclose(logits, REF, atol=TOL)
    assert mm.vision is None
    image = {"type": "image", "image": b"\x89PNG"}
    with pytest.raises(ImageInputError, match="reads no images as loaded.*Gemma 3n's language model only"):
        prepare_messages(mm, [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}])


def test_memory_estimates_count_only_the_layers_keeping_keys_and_values(lm):
    from engine.memory_guard import kv_shape_from_config
    from models.fit import kv_bytes_per_token_config

    per_token = lm.model.new_cache(8).bytes_per_token
    assert kv_shape_from_config(lm.model.cfg).kv_bytes_per_token == per_token
    config = json.loads((TINY / "gemma3n" / "config.json").read_text())
    assert kv_bytes_per_token_config(config) == per_token
    assert kv_bytes_per_token_config({"model_type": "gemma3n", "text_config": config}) == per_token


def test_what_declines_the_model(lm):
    """No fused CPU draft step, no AWQ, no CUDA decoder (the model stays on the CPU with a notice)."""
    from engine.backends.cpu.draft import DraftForward
    from engine.errors import UnsupportedArchitectureError
    from engine.quant.awq import pick_group
    from engine.quant.source import open_source

    assert DraftForward.build(lm.model) is None
    with open_source(TINY / "gemma3n") as source, pytest.raises(UnsupportedArchitectureError,
                                                                match="Gemma 3n"):
        pick_group(source)


def test_gguf_in_llama_cpps_gemma3n_layout(lm, tmp_path):
    """Converted as llama.cpp's convert_hf_to_gguf writes Gemma 3n: FFN lengths per layer, window flags,
    AltUp's inputs, shared-KV layers, per-layer embeddings, the sparsity as normal quantiles (-inf: dense);
    norms as they are (w, not 1 + w); AltUp's stream projections stacked (3, hidden, hidden); the per-layer
    table grown to the vocabulary (its added rows row 0's); no keys or values in the shared layers. The F16
    file gives the golden; a Q8_0 one (AltUp's routers and coefficients kept F32) decodes as its own prompt
    pass."""
    from engine.convert import convert
    from engine.memory_guard import kv_shape_from_gguf
    from models.fit import kv_bytes_per_token
    from models.formats.gguf import open_gguf

    out = convert(TINY / "gemma3n", "F16", tmp_path / "g.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert list(md["gemma3n.feed_forward_length"]) == [96] * 6
    assert list(md["gemma3n.attention.sliding_window_pattern"]) == [True, True, False, True, True, False]
    assert md["gemma3n.attention.shared_kv_layers"] == 2
    assert md["gemma3n.embedding_length_per_layer_input"] == 8
    assert (md["gemma3n.altup.num_inputs"], md["gemma3n.altup.active_idx"]) == (4, 0)
    scale = np.asarray(md["gemma3n.activation_sparsity_scale"])
    assert scale[:2] == pytest.approx(1.6448536) and np.isneginf(scale[2:]).all()
    assert tuple(g.tensors["altup_proj.weight"].shape) == tuple(g.tensors["altup_unembd_proj.weight"].shape)
    assert tuple(g.tensors["altup_proj.weight"].shape) == (3, 64, 64)
    table = np.asarray(g.tensors["per_layer_token_embd.weight"].array())
    assert table.shape == (320, 48) and (table[300:] == table[0]).all()
    assert "blk.4.attn_k.weight" not in g.tensors and "blk.3.attn_v.weight" in g.tensors
    norm = np.asarray(g.tensors["blk.0.attn_norm.weight"].array())
    np.testing.assert_allclose(norm, lm.model.layers[0].attn_norm)
    assert kv_bytes_per_token(g.metadata) == kv_shape_from_gguf(g.metadata).kv_bytes_per_token
    assert kv_bytes_per_token(g.metadata) == lm.model.new_cache(8).bytes_per_token
    g.close()
    m = load_model(out).model
    assert m.cfg.laurel_rank == 8 and m.cfg.kv_sources == lm.model.cfg.kv_sources
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32), all_logits=True), REF, atol=TOL)
    # llama.cpp's older converter kept the table at vocab_size_per_layer_input rows: the same logits
    name = "per_layer_token_embd.weight"
    old = rewrite_gguf(out, tmp_path / "old.gguf", rename=lambda n: () if n == name else n,
                       extra={name: (1, (300, 48), table[:300].astype(np.float16))})
    m = load_model(old).model
    assert m.cfg.vocab_size_per_layer_input == 300
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32), all_logits=True), REF, atol=TOL)
    q8_file = convert(TINY / "gemma3n", "Q8_0", tmp_path / "q8.gguf").output
    g = open_gguf(q8_file)
    assert g.tensors["blk.0.altup_router.weight"].ggml_type == 0  # F32
    assert g.tensors["blk.0.attn_q.weight"].ggml_type == 8  # Q8_0
    g.close()
    q8 = load_model(q8_file).model
    cache = q8.new_cache(32)
    q8.forward(TOKENS[:-1], cache)
    step = q8.forward(TOKENS[-1:], cache)[0]
    whole = q8.forward(TOKENS, q8.new_cache(32), all_logits=True)[-1]
    # the decode step's Q8_0 matvecs take int16-quantized activations, the whole pass's GEMMs float ones:
    # within 1e-4 in CI up to 2026-12-06, 2.3e-4 apart in a fresh environment on 2026-12-07 (numpy 2.4.6,
    # numba 0.68.1; the same code fails 1e-4 there)
    np.testing.assert_allclose(step, whole, atol=5e-4)
    assert int(np.argmax(step)) == int(np.argmax(whole))


def test_serve_batches_concurrent_requests_and_reuses_a_turn(lm):
    """`hearth serve`'s engine over the model: concurrent requests share decode steps (forward_batch) and each
    reply is the one it gets alone; a second turn reuses the first's cache."""

    from engine.server.scheduler import Engine
    from tests.engine.server_harness import LiveServer

    engine = Engine(lm.model, lm.tokenizer, n_ctx=128, max_seqs=4, prefill_chunk=8,
                    prefix_cache_bytes=1 << 20)
    engine.start()
    server = LiveServer(engine, lm)
    try:
        client = server.openai(120)

        def ask(prompt: str, cached: list | None = None) -> str:
            reply = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
            if cached is not None:
                cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            return reply.choices[0].text

        prompts = ["hello there", "a b c d e f g", "the window is"]
        alone = [ask(p) for p in prompts]
        results: dict[int, str] = {}
        engine.max_batch_seen = 0
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(prompts[i])))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert engine.max_batch_seen >= 2
        assert [results[i] for i in range(len(prompts))] == alone
        turn = prompts[1] + alone[1] + " h i j"
        cached: list[int] = []
        reply = ask(turn, cached)
        assert ask(turn, cached) == reply  # from the stored prefix, as the first run
        assert cached[1] > len(lm.tokenizer.encode(prompts[1])) and cached[1] > cached[0]
    finally:
        server.close()
        engine.stop()
