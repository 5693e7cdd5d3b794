"""Test helpers: a GGUF rewritten with other names, blocks or keys (as llama.cpp or older Hearth versions
write a family), a prompt run in chunks, and the batched decode step checked against one sequence at a
time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.quant.gguf_writer import GGUFWriter
from models.formats.gguf import open_gguf


def rewrite_gguf(src: Path, dst: Path, rename=None, metadata=None, drop_keys=(), extra=None) -> Path:
    """Copy GGUF src to dst with each tensor under the names rename(name) gives (a name or a tuple of
    names: copies; an empty tuple drops it), metadata updated by `metadata` and without the keys in drop_keys,
    plus the tensors in `extra` (name -> (ggml type, shape, raw bytes)). Returns dst."""
    g = open_gguf(src)
    md = {k: v for k, v in g.metadata.items() if k != "general.alignment" and k not in drop_keys}
    md.update(metadata or {})
    specs, data = [], {}
    for name, t in g.tensors.items():
        new = rename(name) if rename is not None else name
        for n in (new,) if isinstance(new, str) else new:
            specs.append((n, t.ggml_type, tuple(t.shape)))
            data[n] = np.ascontiguousarray(t.raw()).reshape(-1)
    g.close()
    for n, (ggml_type, shape, raw) in (extra or {}).items():
        specs.append((n, ggml_type, tuple(shape)))
        data[n] = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with open(dst, "wb") as fh:
        w = GGUFWriter(fh, md, specs)
        w.write_header()
        for n, _, _ in specs:
            w.write_tensor(n, data[n])
        w.finish()
    return dst


def block_fp8_twins(src: Path, dst: Path, is_linear) -> tuple[Path, Path]:
    """Hugging Face folder src written twice under dst: dst/"fp8" with the tensors is_linear(name) picks in
    block-wise FP8 (weight_scale_inv per 128 x 128, as Qwen3's and DeepSeek-V3's FP8 checkpoints keep them),
    dst/"dense" with those weights decoded to float32 (the reference decoder); the rest float32 in both.
    Returns (fp8 folder, dense folder)."""
    import shutil

    from engine.quant.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
    from models.formats.safetensors import open_safetensors
    from tests.engine.test_fpquant import _write_st

    st = open_safetensors(src / "model.safetensors")
    fp8, dense = {}, {}
    for name, t in st.tensors.items():
        a = np.array(st.array(name))
        x = (a.astype(np.uint32) << 16).view(np.float32) if t.dtype == "BF16" else a.astype(np.float32)
        if is_linear(name):
            codes, scale = quantize_fp8_blocks(x)
            fp8[name] = ("F8_E4M3", x.shape, codes.tobytes())
            fp8[name[: -len("weight")] + "weight_scale_inv"] = ("F32", scale.shape, scale.tobytes())
            x = dequantize_fp8_blocks(codes, scale)
        else:
            fp8[name] = ("F32", x.shape, x.tobytes())
        dense[name] = ("F32", x.shape, np.ascontiguousarray(x, np.float32).tobytes())
    st.close()
    for folder, tensors in (("fp8", fp8), ("dense", dense)):
        shutil.copytree(src, dst / folder, ignore=shutil.ignore_patterns("*.safetensors"))
        _write_st(dst / folder / "model.safetensors", tensors)
    return dst / "fp8", dst / "dense"


def greedy_tokens(model, prompt, n: int, n_ctx: int = 64) -> list[int]:
    """n greedy tokens after `prompt`, decoded one step at a time through a fresh KV cache."""
    cache = model.new_cache(n_ctx)
    step, tokens = model.forward(prompt, cache), []
    for _ in range(n):
        tokens.append(int(np.argmax(step[-1])))
        step = model.forward([tokens[-1]], cache)
    return tokens


def chunked_logits(model, tokens, sizes) -> np.ndarray:
    """All logits of `tokens` run through one cache in passes of the given sizes."""
    cache = model.new_cache(len(tokens) + 1)
    rows, start = [], 0
    for size in sizes:
        rows.append(model.forward(tokens[start : start + size], cache, all_logits=True))
        start += size
    return np.concatenate(rows)


def check_batched_decode(model, prompts, tokens, rtol: float = 1e-4) -> None:
    """model.forward_batch(tokens) after each prompt gives each sequence the logits of its own decode step."""
    caches = [model.new_cache(16) for _ in prompts]
    for p, c in zip(prompts, caches, strict=True):
        model.forward(p, c)
    batched = model.forward_batch(list(tokens), caches).copy()
    for b, (p, tok) in enumerate(zip(prompts, tokens, strict=True)):
        cache = model.new_cache(16)
        model.forward(p, cache)
        single = model.forward([tok], cache)[0]
        np.testing.assert_allclose(batched[b], single, atol=rtol * np.abs(batched).max())


def check_speculation_keeps_greedy(model, tokenizer, prompt) -> list:
    """Prompt lookup speculating on `prompt` (a repeated one, so drafts are proposed and some rejected, each
    rejection trimming the cache) gives the plain greedy reply. Returns the speculative events."""
    from engine.generate import GenerationParams, generate
    from engine.lookup import PromptLookup
    from engine.speculative import speculative_generate

    params = GenerationParams(max_tokens=16, temperature=0.0)
    plain = [e.token for e in generate(model, tokenizer, prompt, model.new_cache(64), params)]
    events = list(speculative_generate(model, tokenizer, prompt, model.new_cache(64), params, PromptLookup(),
                                       k=4, adaptive=False))
    assert [e.token for e in events] == plain
    return events


def check_recurrent_trims_and_chat_turns(model, tokenizer, tokens, ref, tol: float) -> None:
    """A model whose cache keeps recurrent states at its end (RecurrentKVCache): a trim lands on the latest
    snapshot at or before its target (5 for 10, here) and continuing gives the reference logits ref; a second
    chat turn reuses the whole first one and replies as a fresh cache does."""
    from engine.generate import GenerationParams, generate

    cache = model.new_cache(32)
    model.forward(tokens[:6], cache)
    model.forward(tokens[6:12], cache)  # snapshots at 5 and 11: each pass's end - 1
    for t in tokens[12:]:
        model.forward([t], cache)
    assert cache.trim(len(tokens) - 10) == len(tokens) - 5 and cache.offset == 5
    np.testing.assert_allclose(model.forward(tokens[5:9], cache, all_logits=True), ref[5:9], atol=tol)
    params = GenerationParams(max_tokens=6, temperature=0.0)
    cache = model.new_cache(128)
    reply = [e.token for e in generate(model, tokenizer, tokens, cache, params)]
    turn2 = list(tokens) + reply + [5, 17, 42, 99]
    second = list(generate(model, tokenizer, turn2, cache, params))
    assert second[-1].cached_tokens == len(tokens) + len(reply) - 1
    fresh = [e.token for e in generate(model, tokenizer, turn2, model.new_cache(128), params)]
    assert [e.token for e in second] == fresh


def check_recurrent_regenerate_and_edit_reuse(model, tokenizer, tol: float) -> None:
    """A recurrent cache keeps the states a chat returns to, through prompts of many passes (prefill_chunk 4):
    a regenerate recomputes the prompt's last token only (from the snapshot one token before its end); after
    a second turn of eleven passes, an edit of that turn's message restarts at the first turn's end (the
    second turn's first pass's start) and a regenerate of the first turn recomputes one token again. Each
    prefill's logits, and each greedy reply, are a fresh cache's."""
    from engine.generate import GenerationParams, generate, prefill

    params = GenerationParams(max_tokens=4, temperature=0.0, prefill_chunk=4)
    cache = model.new_cache(128)
    computed = []  # tokens of each pass into `cache`
    advance = cache.advance

    def counted(tokens) -> None:
        computed.append(len(tokens))
        advance(tokens)

    cache.advance = counted

    def reused(ids) -> int:
        """prefill(ids): how many tokens the cache kept (and all the others computed), its logits checked"""
        computed.clear()
        logits, kept = prefill(model, cache, ids, params.prefill_chunk)
        assert sum(computed) == len(ids) - kept and cache.tokens == ids
        np.testing.assert_allclose(logits, prefill(model, model.new_cache(128), ids, 4)[0], atol=tol)
        return kept

    def reply(ids) -> list:
        events = list(generate(model, tokenizer, ids, cache, params))
        fresh = [e.token for e in generate(model, tokenizer, ids, model.new_cache(128), params)]
        assert [e.token for e in events] == fresh
        return events

    turn1 = [(37 * i + 11) % 240 + 3 for i in range(9)]  # passes of 4, 3 and 2 (chunk_end)
    reply(turn1)
    assert reused(turn1) == len(turn1) - 1  # regenerate
    assert computed == [1]
    assert reply(turn1)[-1].cached_tokens == len(turn1) - 1
    boundary = cache.tokens  # the first turn and its reply (but the last token, never fed)
    turn2 = boundary + [(53 * i + 7) % 240 + 3 for i in range(44)]
    reply(turn2)
    edit = boundary + [(29 * i + 5) % 240 + 3 for i in range(6)]
    assert edit[len(boundary)] != turn2[len(boundary)]
    assert reused(edit) == len(boundary)
    assert reused(turn1) == len(turn1) - 1  # the first turn regenerated, after all that
    assert len(cache._snapshots) + len(cache._spare) <= cache.MAX_SNAPSHOTS
