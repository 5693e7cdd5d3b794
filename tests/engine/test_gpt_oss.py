"""gpt-oss: MXFP4 experts in OpenAI's layout and llama.cpp's, attention sinks, windows, the harmony format.

The tiny checkpoints (tests/fixtures/tiny/gpt-oss, gpt-oss-bf16; scripts/make_tiny_checkpoints.py) hold the
same numbers: experts as MXFP4 blocks and scales (OpenAI's release layout) and dequantized to BF16
(transposed, as transformers saves them); their golden logits come from transformers.
test_hf_repo.py checks both folders against it; here: the repack, GGUF files, the harmony reply.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf.quants import dequantize

from engine.convert import convert
from engine.generate import GenerationParams, generate
from engine.harmony import reply_decoder
from engine.hf_experts import mxfp4_blocks_from_hf
from engine.loader import load_model
from engine.reasoning import split_reasoning

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
MXFP4 = 39
# OpenAI's E2M1 code table (the release's reference decoder reads codes through it)
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _golden() -> dict:
    return json.loads((TINY / "gpt-oss" / "golden.json").read_text())


def _close_to_golden(logits: np.ndarray, golden: dict, tol: float = 1e-4) -> None:
    ref = np.array(golden["logits"])
    assert np.abs(logits - ref).max() < tol * max(1.0, np.abs(ref).max())
    assert np.array_equal(logits.argmax(1), ref.argmax(1))


def test_mxfp4_repack_gives_ggml_blocks_of_the_same_numbers():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 5, 4), dtype=np.uint8)
    rows = mxfp4_blocks_from_hf(blocks, scales)
    assert rows.shape == (3, 5, 4 * 17)
    # OpenAI's reading: element 2j the low nibble of byte j, 2j + 1 the high one, times 2^(scale - 127)
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(3, 5, 4, 32)
    ref = FP4[codes] * np.exp2(scales.astype(np.float32) - 127)[..., None]
    ggml = dequantize(rows.reshape(-1, 4 * 17), MXFP4).reshape(3, 5, 128)
    np.testing.assert_array_equal(ggml, ref.reshape(3, 5, 128))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_blocks_from_hf(blocks, scales[..., :3])


def test_the_folder_runs_its_experts_as_mxfp4_with_sinks_and_a_window():
    m = load_model(TINY / "gpt-oss").model
    cfg = m.cfg
    assert cfg.architecture == "gpt-oss" and cfg.expert_act == "swiglu_oai"
    assert (cfg.window(0), cfg.window(1)) == (4, None)
    assert cfg.rope_scaling.kind == "yarn" and not cfg.rope_scaling.truncate
    layer = m.layers[0]
    assert layer.moe.gate[0].ggml_type == MXFP4 and layer.moe.stacks is not None
    assert layer.sinks.shape == (cfg.num_attention_heads,) and layer.bo is not None
    assert layer.moe.router_bias is not None and layer.moe.gate_bias.shape == (4, cfg.intermediate_size)


def test_decode_steps_and_a_verify_pass_give_the_same_bits():
    # one token at a time takes the merged experts' one-token path (cpu.linear_experts over MXFP4 rows);
    # three at once the grouped small-batch path: both give each token the same logits
    m = load_model(TINY / "gpt-oss").model
    tokens = _golden()["tokens"][:9]
    cache = m.new_cache(32)
    m.forward(tokens[:6], cache)
    steps = [m.forward([t], cache)[0].copy() for t in tokens[6:]]
    cache2 = m.new_cache(32)
    m.forward(tokens[:6], cache2)
    together = m.forward(tokens[6:], cache2, all_logits=True)
    np.testing.assert_array_equal(np.array(steps), together)


def test_conversion_keeps_mxfp4_experts_as_they_are(tmp_path):
    golden = _golden()
    out = convert(TINY / "gpt-oss", "Q8_0", tmp_path / "q8.gguf")
    types = out.result.tensor_types
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.1.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_gate_exps.bias"] == "F32"
    gguf_model = load_model(out.output).model
    folder_model = load_model(TINY / "gpt-oss").model
    for a, b in zip(gguf_model.layers, folder_model.layers):
        for kind in ("gate", "up", "down"):  # the repacked bytes, written as they are
            np.testing.assert_array_equal(a.moe.stacks[("gate", "up", "down").index(kind)].raw,
                                          b.moe.stacks[("gate", "up", "down").index(kind)].raw)
    logits = gguf_model.forward(golden["tokens"], gguf_model.new_cache(64), all_logits=True)
    _close_to_golden(logits, golden, tol=0.05)  # Q8_0 attention weights


@pytest.mark.parametrize("source", ["gpt-oss", "gpt-oss-bf16"])
def test_a_float_gguf_matches_transformers(tmp_path, source):
    golden = _golden()
    out = convert(TINY / source, "F16", tmp_path / "f16.gguf")
    assert out.result.tensor_types["blk.0.ffn_up_exps.weight"] == "F16"
    m = load_model(out.output).model
    assert m.cfg.swiglu_limit == 1.5 and m.cfg.window(0) == 4 and m.cfg.window(1) is None
    _close_to_golden(m.forward(golden["tokens"], m.new_cache(64), all_logits=True), golden)


def test_llama_cpp_names(tmp_path):
    """llama.cpp's gpt-oss GGUF calls the pre-FFN norm post_attention_norm, and so does our converter; a file
    naming it ffn_norm (Hearth's conversions before 2026-12) still loads."""
    from models.formats.gguf import open_gguf
    from tests.engine.model_checks import rewrite_gguf

    golden = _golden()
    src = convert(TINY / "gpt-oss", "Q8_0", tmp_path / "ours.gguf").output
    g = open_gguf(src)
    assert "blk.0.post_attention_norm.weight" in g.tensors and "blk.0.ffn_norm.weight" not in g.tensors
    g.close()
    path = rewrite_gguf(src, tmp_path / "old-names.gguf",
                        lambda name: name.replace("post_attention_norm.weight", "ffn_norm.weight"))
    m = load_model(path).model
    _close_to_golden(m.forward(golden["tokens"], m.new_cache(64), all_logits=True), golden, tol=0.05)


def _decode(tokenizer, text: str) -> str:
    d = reply_decoder(tokenizer, [], text_start=True)
    out = ""
    for i in tokenizer.encode(text):
        if i in tokenizer.eot_ids:
            break
        out += d.push(i)
    return out + d.flush()


def test_harmony_reply_reads_as_thinking_and_answer():
    tok = load_model(TINY / "gpt-oss").tokenizer
    ids = tok.harmony
    assert ids is not None
    assert ids["<|return|>"] in tok.eot_ids and ids["<|call|>"] in tok.eot_ids
    assert ids["<|end|>"] not in tok.eot_ids  # a message ends; the reply goes on
    reply = (
        "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>analysis<|message|>"
        "So four.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>ignored"
    )
    text = _decode(tok, reply)
    assert split_reasoning(text) == split_reasoning("<think>\nTwo and two.\nSo four.\n</think>\n\nIt is 4.")
    assert split_reasoning(text).thinking == "Two and two.\nSo four."
    assert split_reasoning(text).answer == "It is 4."
    # straight to the answer; commentary counts as answer; thinking after the answer is not shown
    assert _decode(tok, "<|channel|>final<|message|>Hi there<|return|>") == "Hi there"
    late = "<|channel|>final<|message|>A<|end|><|start|>assistant<|channel|>analysis<|message|>hidden<|end|>"
    assert _decode(tok, late + "<|start|>assistant<|channel|>commentary<|message|>B<|call|>") == "A\n\nB"
    # cut off while thinking: the block stays open
    assert split_reasoning(_decode(tok, "<|channel|>analysis<|message|>hmm")).thinking_done is False
    # a reply that never opens a message is shown as it is
    assert _decode(tok, "plain text") == "plain text"


def test_harmony_tool_calls_become_the_servers_tool_calls():
    from engine.server.protocol import parse_tool_calls

    tok = load_model(TINY / "gpt-oss").tokenizer
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    text = _decode(tok, reply)
    assert split_reasoning(text).thinking == "Need the weather."
    rest, calls = parse_tool_calls(split_reasoning(text).answer)
    assert rest == ""
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    # the recipient may also stand before the channel
    text = _decode(tok, "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>")
    assert parse_tool_calls(text)[1][0]["function"] == {"name": "now", "arguments": "{}"}


def test_a_partial_reply_is_spelled_back_as_open_harmony_messages():
    from engine.harmony import continuation

    assert continuation("Hel") == "<|channel|>final<|message|>Hel"
    assert continuation("<think>\nweighing it") == "<|channel|>analysis<|message|>weighing it"
    assert continuation("<think>\nTwo and two.\n</think>\n\nIt is") == (
        "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>It is"
    )


def _scripted(monkeypatch, model, script: list[int], n_prompt: int) -> None:
    # the model's forward runs; its last logits row then picks the script's token for the position that
    # follows (the prompt may be prefilled in chunks)
    forward = model.forward

    def scripted(tokens, cache, all_logits=False):
        logits = forward(tokens, cache, all_logits)
        logits[-1] = -10.0
        logits[-1, script[min(max(cache.offset - n_prompt, 0), len(script) - 1)]] = 10.0
        return logits

    monkeypatch.setattr(model, "forward", scripted)


def test_generate_streams_a_harmony_reply_as_thinking_and_answer(monkeypatch):
    """generate() on the tiny model made to pick a scripted harmony reply (its forward runs, its logits
    are replaced by the script's next token): the streamed text is the reasoning convention's, the
    reply goes on past <|end|> and stops at <|return|>."""
    lm = load_model(TINY / "gpt-oss")
    tok, model = lm.tokenizer, lm.model
    prompt = tok.encode(lm.template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    assert tok.decode(prompt).endswith("<|start|>assistant")
    script = tok.encode(
        "<|channel|>analysis<|message|>the user greets<|end|><|start|>assistant<|channel|>final<|message|>"
        "hello<|return|>"
    )
    _scripted(monkeypatch, model, script, len(prompt))
    events = list(generate(model, tok, prompt, model.new_cache(256), GenerationParams(max_tokens=64)))
    assert [e.token for e in events] == script and events[-1].finish_reason == "stop"
    text = "".join(e.text for e in events)
    assert text == "<think>\nthe user greets\n</think>\n\nhello"


def test_the_worker_chats_with_the_folder_and_reuses_the_cache():
    """ChatRunner (the app, `hearth serve`) on OpenAI's layout: a second turn, whose history holds the
    first reply with a thinking block, renders that reply as its final message and reuses the prompt."""
    from engine.client import LoadOptions
    from engine.worker import ChatRunner

    runner = ChatRunner.load(TINY / "gpt-oss", LoadOptions(n_ctx=512, batch_size=64, prefix_cache_mb=0))
    params = GenerationParams(max_tokens=4, temperature=0.0)
    first = list(runner.chat([{"role": "user", "content": "hi"}], params))
    assert first[-1].generated_tokens == 4 and first[-1].cached_tokens == 0
    turn2 = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "<think>\ngreeting\n</think>\n\nHello"},
             {"role": "user", "content": "more"}]
    ids = runner.encode(turn2)
    text = runner.lm.tokenizer.decode(ids)
    assert "<|channel|>final<|message|>Hello<|end|>" in text and "greeting" not in text
    again = list(runner.chat(turn2, params))[-1]
    assert again.cached_tokens > 100 and again.generated_tokens == 4


@pytest.mark.parametrize("partial, script, more", [
    # stopped while thinking: the analysis goes on in the same block, then the answer
    ("<think>\nthe user", " greets<|end|><|start|>assistant<|channel|>final<|message|>hello<|return|>",
     " greets\n</think>\n\nhello"),
    # stopped in the answer: it goes on
    ("<think>\nthe user greets\n</think>\n\nhel", "lo there<|return|>", "lo there"),
    ("hel", "lo<|return|>", "lo"),
])
def test_continue_goes_on_inside_the_open_message(monkeypatch, partial, script, more):
    """The app's Continue on a gpt-oss reply: the prompt spells the partial reply as open harmony messages,
    and the new text goes on from it in Hearth's convention (one <think> block, then the answer)."""
    from engine.client import LoadOptions
    from engine.worker import ChatRunner

    runner = ChatRunner.load(TINY / "gpt-oss", LoadOptions(n_ctx=512, batch_size=64, prefix_cache_mb=0))
    tok, model = runner.lm.tokenizer, runner.lm.model
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": partial, "continue": True}]
    ids = runner.encode(list(messages))
    prompt = tok.decode(ids)
    assert prompt.endswith(partial.split("\n")[-1]) and "<|start|>assistant<|channel|>" in prompt
    _scripted(monkeypatch, model, tok.encode(script), len(ids))
    events = list(runner.chat(messages, GenerationParams(max_tokens=32)))
    text = "".join(e.text for e in events if e.text)
    assert text == more
    whole = split_reasoning(partial + text)
    assert whole.answer.startswith(("hello", "hello there"))
