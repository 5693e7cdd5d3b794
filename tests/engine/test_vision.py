"""Images in prompts: Gemma 3's SigLIP tower and projector, image ids in the prompt, the bidirectional mask
over an image's tokens, passes that never split an image, KV reuse across turns, the mmproj GGUF both ways,
and the errors a user meets.

tests/fixtures/tiny/gemma3-vision (scripts/make_tiny_checkpoints.py) is a Gemma 3 with a 2-layer SigLIP
(56 px images, 4x4 patches pooled 2x2 into 4 rows) and a Gemma-style template; golden_vision.json holds,
from transformers' Gemma3ForConditionalGeneration and its PIL image processor, a chat prompt with two images:
its token ids, logits at every position, 8 greedy tokens and each image's projected rows.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.client import LoadOptions
from engine.convert import convert
from engine.errors import ImageInputError
from engine.generate import GenerationParams, generate, prefill
from engine.loader import load_model
from engine.vision import encode_with_images, prepare_messages
from engine.vision.gemma3 import Gemma3Vision
from engine.vision.tokens import ImageTable, chunk_end, safe_prefix
from engine.worker import ChatRunner

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
FOLDER = TINY / "gemma3-vision"
GOLDEN = json.loads((FOLDER / "golden_vision.json").read_text())
REF = np.array(GOLDEN["logits"])
TOL = 1e-4 * np.abs(REF).max()
IMAGES = [(FOLDER / name).read_bytes() for name in GOLDEN["images"]]
IMAGE_TOKEN = 317  # the fixture's <image_soft_token>, where transformers' prompt holds an image row


def _with_images(golden: dict, images: list[bytes]) -> list[dict]:
    """A golden's conversation with these images' bytes in its image parts, in order."""
    out = [dict(m) for m in golden["messages"]]
    pending = iter(images)
    out[-1]["content"] = [
        {"type": "image", "image": next(pending)} if p["type"] == "image" else p for p in out[-1]["content"]
    ]
    return out


def _messages(images=IMAGES) -> list[dict]:
    return _with_images(GOLDEN, images)


def _prompt(lm, messages) -> list[int]:
    template_messages, images = prepare_messages(lm, messages)
    return encode_with_images(lm, lm.template.render(template_messages, add_generation_prompt=True), images)


@pytest.fixture(scope="module")
def lm():
    return load_model(FOLDER)


@pytest.fixture(scope="module")
def ids(lm):
    return _prompt(lm, _messages())


def test_image_rows_match_transformers(lm):
    assert isinstance(lm.vision, Gemma3Vision)
    for data, ref in zip(IMAGES, GOLDEN["image_rows"], strict=True):
        ref = np.array(ref)
        rows = lm.vision.encode(lm.vision.pixels(data))
        np.testing.assert_allclose(rows, ref, atol=1e-4 * np.abs(ref).max())


def test_prompt_ids_are_transformers_with_image_ids(lm, ids):
    base = lm.model.images.base
    assert [IMAGE_TOKEN if t >= base else t for t in ids] == GOLDEN["tokens"]
    runs = lm.model.images.runs(np.array(ids))
    assert len(runs) == 2 and all(b - a == 4 for a, b in runs)
    assert ids[runs[0][0] : runs[0][1]] != ids[runs[1][0] : runs[1][1]]  # two images, two sets of ids


def test_logits_and_greedy_match_transformers(lm, ids):
    logits = lm.model.forward(ids, lm.model.new_cache(160), all_logits=True)
    np.testing.assert_allclose(logits, REF, atol=TOL)
    cache = lm.model.new_cache(160)
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out = [e.token for e in generate(lm.model, lm.tokenizer, ids, cache, params) if e.token is not None]
    assert out[: len(GOLDEN["greedy"])] == GOLDEN["greedy"][: len(out)]
    assert len(out) >= 4


def test_image_tokens_attend_both_ways(lm, ids, monkeypatch):
    """Without the image's bidirectional mask the logits leave transformers' (the check can fail)."""
    monkeypatch.setattr(ImageTable, "key_ends", lambda self, tokens, pos0: None)
    logits = lm.model.forward(ids, lm.model.new_cache(160), all_logits=True)
    assert np.abs(logits - REF).max() > 50 * TOL


@pytest.mark.parametrize("chunk", [3, 5, 8, 64])
def test_chunked_prefill_never_splits_an_image(lm, ids, chunk):
    cache = lm.model.new_cache(160)
    calls = []
    real = lm.model.forward

    def forward(tokens, c, all_logits=False):
        calls.append(len(tokens))
        return real(tokens, c, all_logits)

    lm.model.forward = forward
    try:
        last, _ = prefill(lm.model, cache, ids, chunk)
    finally:
        del lm.model.forward
    np.testing.assert_allclose(last, REF[-1], atol=TOL)
    assert sum(calls) == len(ids) and len(calls) > 1


def test_a_pass_holding_part_of_an_image_is_refused(lm, ids):
    start = lm.model.images.runs(np.array(ids))[0][0]
    cache = lm.model.new_cache(160)
    with pytest.raises(ValueError, match="part of an image"):
        lm.model.forward(ids[: start + 2], cache)


def test_chunk_end_and_safe_prefix():
    class Model:
        images = ImageTable(base=100, hidden=2, bidirectional=True)

    m = Model()
    first, second = (m.images.ids(m.images.add(d, np.zeros((4, 2), np.float32))) for d in ("a", "b"))
    ids = [1, 2, *first, 3, *second, 4]
    assert chunk_end(m, ids, 0, 2) == 2  # the cut falls before the image
    assert chunk_end(m, ids, 0, 4) == 2  # inside the first image: back to its start
    assert chunk_end(m, ids, 2, 2) == 6  # the image starts the pass: on to its end
    assert chunk_end(m, ids, 2, 5) == 7  # just after it
    assert chunk_end(m, ids, 6, 3) == 7  # cut inside the second: back to its start
    assert chunk_end(m, ids, 0, 50) == len(ids)
    assert [safe_prefix(m, ids, n) for n in (2, 3, 5, 6, 8, 12)] == [2, 2, 2, 6, 7, 12]
    assert chunk_end(object(), ids, 0, 4) == 4  # a model without images
    # never the prompt's last token alone (a recurrent cache keeps the state a token before a pass's end)
    assert [chunk_end(object(), ids, s, 4) for s in (4, 7, 10)] == [8, 10, 12]
    assert chunk_end(object(), ids, 10, 1) == 11
    m.images.bidirectional = False  # causal image rows (Mistral 3): any cut will do
    assert chunk_end(m, ids, 0, 4) == 4 and safe_prefix(m, ids, 3) == 3


def test_image_table_keeps_the_newest_and_never_reuses_a_slot():
    table = ImageTable(base=10, hidden=3, capacity=2)
    slots = [table.add(table.digest(bytes([i])), np.full((2 + i, 3), i, np.float32)) for i in range(3)]
    assert slots == [0, 1, 2]
    assert table.slot_of(table.digest(b"\x00")) is None  # the oldest was dropped
    assert len(table.ids(2)) == 4  # rows of its own count
    out = np.zeros((4, 3), np.float32)
    table.embed(out, np.array(table.ids(2)))
    assert (out == 2).all()
    with pytest.raises(KeyError, match="no longer held"):
        table.embed(out, np.array([10, 11]))  # slot 0's ids
    with pytest.raises(ValueError):
        table.add("x", np.zeros((3, 4), np.float32))


def test_chat_turns_reuse_the_image_and_a_new_image_is_not_reused():
    runner = ChatRunner.load(FOLDER, LoadOptions(n_ctx=256, batch_size=5, prefix_cache_mb=0))
    assert runner.info.vision
    params = GenerationParams(max_tokens=4, temperature=0.0)
    first = list(runner.chat(_messages(), params))
    reply = "".join(e.text for e in first)
    assert first[-1].finish_reason
    follow = _messages() + [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    second = list(runner.chat(follow, params))[-1]
    start = runner.lm.model.images.runs(np.array(runner.cache.tokens))[0][0]
    assert second.cached_tokens > start + 4  # both images came from the cache
    swapped = _messages([IMAGES[1], IMAGES[0]])
    third = list(runner.chat(swapped, params))[-1]
    assert third.cached_tokens <= start  # another image in that place: recomputed from its start
    fresh = ChatRunner.load(FOLDER, LoadOptions(n_ctx=256, batch_size=512, prefix_cache_mb=0))
    alone = list(fresh.chat(swapped, params))
    assert "".join(e.text for e in alone) == "".join(
        e.text for e in runner.chat(swapped, replace(params), reuse=False)
    )


def test_gguf_with_its_mmproj_matches_transformers(tmp_path):
    out = convert(FOLDER, "F16", tmp_path / "g3v.gguf")
    assert out.mmproj == tmp_path / "mmproj-g3v-f16.gguf" and out.mmproj.is_file()
    lm = load_model(out.output)
    assert lm.vision is not None and not lm.vision_notice
    ids = _prompt(lm, _messages())
    np.testing.assert_allclose(lm.model.forward(ids, lm.model.new_cache(160), all_logits=True), REF, atol=TOL)
    from engine.worker import _model_shape

    assert _model_shape(out.output)[0] == out.output.stat().st_size + out.mmproj.stat().st_size
    out.mmproj.unlink()
    assert load_model(out.output).vision is None  # no mmproj beside it: text only
    assert _model_shape(out.output)[0] == out.output.stat().st_size


def test_mmproj_of_another_model_is_refused(lm):
    """A tower whose rows are not the model's width (an mmproj of another model beside it) is refused, which
    the loader turns into images off with a notice (next test)."""
    from types import SimpleNamespace

    from engine.errors import ModelFormatError

    other = SimpleNamespace(cfg=SimpleNamespace(hidden_size=128, vocab_size=320))
    with pytest.raises(ModelFormatError, match="belongs to another model"):
        lm.vision.attach(other)


def test_broken_mmproj_leaves_images_off_with_a_notice(tmp_path):
    out = convert(FOLDER, "F16", tmp_path / "g3v.gguf")
    data = out.mmproj.read_bytes()
    out.mmproj.write_bytes(data[: len(data) // 2])  # a truncated download
    lm = load_model(out.output)
    assert lm.vision is None and "images are off" in lm.vision_notice
    assert lm.model.forward([1, 2, 3], lm.model.new_cache(8)).shape[1] == lm.model.cfg.vocab_size


def test_image_to_a_text_model_is_a_typed_error():
    lm = load_model(TINY / "gemma3")
    with pytest.raises(ImageInputError, match="does not read images"):
        prepare_messages(lm, _messages())
    lm.vision_notice = "images are off: a broken mmproj"  # a tower that could not be used says why
    with pytest.raises(ImageInputError, match="as loaded: images are off: a broken mmproj"):
        prepare_messages(lm, _messages())


def test_unreadable_and_oversized_images_are_typed_errors(lm, monkeypatch):
    with pytest.raises(ImageInputError, match="could not be read"):
        _prompt(lm, _messages([b"not an image at all", IMAGES[1]]))
    from PIL import Image

    from engine.vision import tower

    monkeypatch.setattr(tower, "MAX_PIXELS", 100)
    buf = io.BytesIO()
    Image.new("RGB", (20, 20)).save(buf, "PNG")
    with pytest.raises(ImageInputError, match="scale it down"):
        _prompt(lm, _messages([buf.getvalue(), IMAGES[1]]))


def test_template_that_places_no_images_is_a_typed_error(lm):
    text = "<|im_start|>user\nno markers here<|im_end|>\n"
    with pytest.raises(ImageInputError, match="placed 0 image"):
        encode_with_images(lm, text, IMAGES[:1])


def test_text_parts_only_stay_a_string(lm):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    template_messages, images = prepare_messages(lm, messages)
    assert template_messages[0]["content"] == "ab" and images == []


def test_cli_run_with_images(capsys, lm):
    """`hearth run --image A --image B PROMPT`: one user message, its images before its text, greedy."""
    from engine.cli import main

    paths = [str(FOLDER / name) for name in GOLDEN["images"]]
    argv = ["run", "-m", str(FOLDER), "--image", paths[0], "--image", paths[1], "-n", "4", "--temp", "0",
            "--json", "What is this?"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    messages = [{"role": "user", "content": [{"type": "image", "image": b} for b in IMAGES]
                 + [{"type": "text", "text": "What is this?"}]}]
    assert out["prompt_ids"] == _prompt(lm, messages)
    expected = lm.model.forward(out["prompt_ids"], lm.model.new_cache(64))[0].argmax()
    assert out["ids"][0] == expected


def test_cli_run_image_errors(capsys):
    from engine.cli import main

    assert main(["run", "-m", str(FOLDER), "--image", "/no/such.png", "hi"]) != 0
    assert "cannot read the image" in capsys.readouterr().err
    assert main(["run", "-m", str(TINY / "gemma3"), "--image", str(FOLDER / "image0.png"), "hi"]) != 0
    assert "does not read images" in capsys.readouterr().err


def test_reading_images_reports_progress_and_can_be_cancelled():
    params = GenerationParams(max_tokens=2, temperature=0.0)
    runner = ChatRunner.load(FOLDER, LoadOptions(n_ctx=256, prefix_cache_mb=0))
    events = list(runner.chat(_messages(), params))
    steps = [e.images_read for e in events if e.images_to_read]
    assert steps == [0.5, 1.0, 1.5, 2.0]  # two images of two encoder layers each, before the prefill
    assert events[-1].finish_reason == "length"
    assert not any(e.images_to_read for e in runner.chat(_messages(), params))  # both held now

    fresh = ChatRunner.load(FOLDER, LoadOptions(n_ctx=256, prefix_cache_mb=0))
    calls = []

    def should_stop() -> bool:  # no at the first layer, yes at the second
        calls.append(1)
        return len(calls) > 1

    events = list(fresh.chat(_messages(), params, should_stop=should_stop))
    assert events[-1].finish_reason == "cancelled" and events[-1].images_read < 2
    assert fresh.cache.offset == 0  # nothing was prefilled


def test_the_fallback_gemma_template_places_images():
    """A Gemma 3 file without a chat template gets resources/templates/gemma.jinja, which puts
    <start_of_image> where an image part is (as Google's template does)."""
    from engine.templates import ensure_chat_template

    lm = load_model(FOLDER)
    lm.template = None
    assert ensure_chat_template(lm)
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0]},
                                             {"type": "text", "text": "What is this?"}]}]
    ids = _prompt(lm, messages)
    base = lm.model.images.base
    assert sum(t >= base for t in ids) == 4
    assert "<start_of_turn>user\n\n\n<start_of_image><end_of_image>\n\nWhat is this?" in lm.tokenizer.decode(
        [t for t in ids if t < base])


# Mistral 3 (tests/fixtures/tiny/mistral3-vision): a Pixtral tower (2 layers, 2D RoPE, gated SiLU MLP),
# patches merged 2x2 through the merging layer, a GELU projector with biases; two images of different shapes
# (84 x 84 and 84 x 56 after the processor: 3 x 3 and 3 x 2 rows), laid out with [IMG_BREAK] / [IMG_END]
M3 = TINY / "mistral3-vision"
M3_GOLDEN = json.loads((M3 / "golden_vision.json").read_text())
M3_REF = np.array(M3_GOLDEN["logits"])
M3_TOL = 1e-4 * np.abs(M3_REF).max()
M3_IMAGES = [(M3 / name).read_bytes() for name in M3_GOLDEN["images"]]


def _m3_messages() -> list[dict]:
    return _with_images(M3_GOLDEN, M3_IMAGES)


@pytest.fixture(scope="module")
def m3():
    return load_model(M3)


def test_mistral3_rows_prompt_logits_and_greedy_match_transformers(m3):
    from engine.vision.pixtral import PixtralVision

    assert isinstance(m3.vision, PixtralVision)
    for data, ref in zip(M3_IMAGES, M3_GOLDEN["image_rows"], strict=True):
        ref = np.array(ref)
        rows = m3.vision.encode(m3.vision.pixels(data))
        np.testing.assert_allclose(rows, ref, atol=1e-4 * np.abs(ref).max())
    ids = _prompt(m3, _m3_messages())
    base = m3.model.images.base
    assert [IMAGE_TOKEN if t >= base else t for t in ids] == M3_GOLDEN["tokens"]
    # 3 rows of 3, then 3 rows of 2: [IMG_BREAK] after each row but the last, [IMG_END] after the last
    text = m3.tokenizer.decode([t if t < base else IMAGE_TOKEN for t in ids])
    assert "[IMG][IMG][IMG][IMG_BREAK][IMG][IMG][IMG][IMG_BREAK][IMG][IMG][IMG][IMG_END]" in text
    assert "[IMG][IMG][IMG_BREAK][IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]" in text
    np.testing.assert_allclose(m3.model.forward(ids, m3.model.new_cache(160), all_logits=True), M3_REF,
                               atol=M3_TOL)
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out = [e.token for e in generate(m3.model, m3.tokenizer, ids, m3.model.new_cache(160), params)
           if e.token is not None]
    assert out[: len(M3_GOLDEN["greedy"])] == M3_GOLDEN["greedy"][: len(out)] and len(out) >= 4


def test_mistral3_image_rows_are_causal_so_passes_split_anywhere(m3):
    ids = _prompt(m3, _m3_messages())
    assert m3.model.images.key_ends(np.array(ids), 0) is None
    cache = m3.model.new_cache(160)
    last, _ = prefill(m3.model, cache, ids, 5)  # passes that cut images
    np.testing.assert_allclose(last, M3_REF[-1], atol=M3_TOL)


def test_mistral3_gguf_with_its_mmproj_matches_transformers(tmp_path):
    out = convert(M3, "F16", tmp_path / "m3.gguf")
    assert out.mmproj is not None
    from models.formats.gguf import open_gguf

    with open_gguf(out.mmproj) as gguf:
        assert gguf.metadata["clip.projector_type"] == "pixtral"
        assert "v.token_embd.img_break" in gguf.tensors  # what llama.cpp's pixtral graph reads
    lm = load_model(out.output)
    ids = _prompt(lm, _m3_messages())
    np.testing.assert_allclose(lm.model.forward(ids, lm.model.new_cache(160), all_logits=True), M3_REF,
                               atol=M3_TOL)


@pytest.mark.parametrize(
    ("size", "expected"),
    [((60, 80), (84, 84)), ((70, 40), (84, 56)), ((3000, 1000), (84, 28)), ((28, 29), (28, 56))],
)
def test_mistral3_resizes_within_the_longest_edge_to_whole_cells(m3, size, expected):
    assert m3.vision.target_size(*size) == expected


# Gemma 4 (tests/fixtures/tiny/gemma4-vision): an E2B-style text model (per-layer inputs, shared-KV layers)
# with a 2-layer tower (2D RoPE, q/k/v norms, clipped linears, patches pooled 2x2, standardized), its image
# rows bidirectional on the windowed layers ("vision"); two images of different sizes (56 x 72 and 88 x 48
# after the processor: 63 and 66 rows), each between <|image> and <image|>
G4 = TINY / "gemma4-vision"
G4_GOLDEN = json.loads((G4 / "golden_vision.json").read_text())
G4_REF = np.array(G4_GOLDEN["logits"])
G4_TOL = 1e-4 * np.abs(G4_REF).max()
G4_IMAGES = [(G4 / name).read_bytes() for name in G4_GOLDEN["images"]]


@pytest.fixture(scope="module")
def g4():
    return load_model(G4)


@pytest.fixture(scope="module")
def g4_ids(g4):
    return _prompt(g4, _with_images(G4_GOLDEN, G4_IMAGES))


def test_gemma4_image_rows_match_transformers(g4):
    from engine.vision.gemma4 import Gemma4Vision

    assert isinstance(g4.vision, Gemma4Vision) and g4.vision.bidirectional
    for data, ref in zip(G4_IMAGES, G4_GOLDEN["image_rows"], strict=True):
        ref = np.array(ref)
        rows = g4.vision.encode(g4.vision.pixels(data))
        np.testing.assert_allclose(rows, ref, atol=1e-4 * np.abs(ref).max())


def test_gemma4_prompt_logits_and_greedy_match_transformers(g4, g4_ids):
    base = g4.model.images.base
    assert [IMAGE_TOKEN if t >= base else t for t in g4_ids] == G4_GOLDEN["tokens"]
    runs = g4.model.images.runs(np.array(g4_ids))
    assert [b - a for a, b in runs] == G4_GOLDEN["soft_tokens"]
    assert all(g4_ids[a - 1] == 318 and g4_ids[b] == 319 for a, b in runs)  # <|image> rows <image|>
    logits = g4.model.forward(g4_ids, g4.model.new_cache(256), all_logits=True)
    np.testing.assert_allclose(logits, G4_REF, atol=G4_TOL)
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out = [e.token for e in generate(g4.model, g4.tokenizer, g4_ids, g4.model.new_cache(256), params)
           if e.token is not None]
    assert out[: len(G4_GOLDEN["greedy"])] == G4_GOLDEN["greedy"][: len(out)] and len(out) >= 4


def test_gemma4_image_rows_attend_both_ways_on_windowed_layers_only(g4, g4_ids, monkeypatch):
    """Causal image rows, image rows bidirectional on the global layers too, or image positions whose
    per-layer inputs are not the pad token's all leave transformers' logits (the checks can fail)."""
    ids = np.array(g4_ids)
    full_ends = g4.model.images.key_ends(ids, 0)

    def forward():
        return g4.model.forward(g4_ids, g4.model.new_cache(256), all_logits=True)

    with monkeypatch.context() as m:
        m.setattr(ImageTable, "key_ends", lambda self, tokens, pos0: None)
        assert np.abs(forward() - G4_REF).max() > 50 * G4_TOL
    from engine.backends import cpu as ops

    real = ops.attention

    def everywhere(out, q, k, v, pos0, scale, window=None, *args, key_ends=None, **kw):
        if key_ends is None and len(q) == len(ids):  # a global layer of the prompt pass
            key_ends = full_ends
        return real(out, q, k, v, pos0, scale, window, *args, key_ends=key_ends, **kw)

    with monkeypatch.context() as m:
        m.setattr(ops, "attention", everywhere)
        assert np.abs(forward() - G4_REF).max() > 50 * G4_TOL
    with monkeypatch.context() as m:
        m.setattr(g4.model, "image_pad_id", 5)
        assert np.abs(forward() - G4_REF).max() > 50 * G4_TOL


@pytest.mark.parametrize("chunk", [3, 40, 64, 256])
def test_gemma4_chunked_prefill_never_splits_an_image(g4, g4_ids, chunk):
    cache = g4.model.new_cache(256)
    calls = []
    real = g4.model.forward

    def forward(tokens, c, all_logits=False):
        calls.append(len(tokens))
        return real(tokens, c, all_logits)

    g4.model.forward = forward
    try:
        last, _ = prefill(g4.model, cache, g4_ids, chunk)
    finally:
        del g4.model.forward
    np.testing.assert_allclose(last, G4_REF[-1], atol=G4_TOL)
    assert sum(calls) == len(g4_ids) and (len(calls) > 1) == (chunk < len(g4_ids))


@pytest.mark.parametrize(
    ("size", "expected"),  # transformers' get_aspect_ratio_preserving_size(h, w, 4, 280, 2)
    [((60, 80), (56, 72)), ((70, 40), (88, 48)), ((4, 1000), (8, 560)), ((1000, 4), (560, 8)),
     ((3000, 2000), (80, 48)), ((8, 8), (64, 64))],
)
def test_gemma4_resizes_within_the_patch_budget(g4, size, expected):
    assert g4.vision.target_size(*size) == expected


def test_gemma4_template_that_places_no_images_is_a_typed_error(g4):
    with pytest.raises(ImageInputError, match="placed 0 image"):
        g4.vision.encode_prompt(g4.tokenizer, "no image here", G4_IMAGES[:1])


# Qwen3.5 (tests/fixtures/tiny/qwen3_5-vision): a ViT of 2 blocks over 4 px patches (a 3D convolution over two
# copies of the image), a learned 4x4 position grid resampled to each image, 2D rotary, patches merged 2x2;
# two images of different shapes (32 x 48 and 56 x 32 px after smart_resize: 4 x 6 and 7 x 4 rows) whose
# rows take M-RoPE positions (t, h, w), the text after each continuing at its start + max(rows, columns)
Q35 = TINY / "qwen3_5-vision"
Q35_GOLDEN = json.loads((Q35 / "golden_vision.json").read_text())
Q35_REF = np.array(Q35_GOLDEN["logits"])
Q35_TOL = 1e-4 * np.abs(Q35_REF).max()
Q35_IMAGES = [(Q35 / name).read_bytes() for name in Q35_GOLDEN["images"]]
Q35MOE = TINY / "qwen3_5_moe-vision"  # Qwen3.5-MoE's text layers with the same tower
# Qwen3-VL: the same tower (3 blocks) with deepstack mergers after blocks 0 and 1, Qwen3 text layers; its MoE
# (after blocks 1 and 2, Qwen3-MoE text layers)
Q3VL = TINY / "qwen3_vl-vision"
Q3VLMOE = TINY / "qwen3_vl_moe-vision"
# Qwen2.5-VL: a windowed tower, Qwen2 text layers with M-RoPE sections in a row (test_vision_qwen25vl.py)
Q25VL = TINY / "qwen2_5_vl-vision"
Q2VL = TINY / "qwen2_vl-vision"  # Qwen2-VL: the same text layers, LayerNorm blocks, no windows


def _q35_messages(images=Q35_IMAGES) -> list[dict]:
    return _with_images(Q35_GOLDEN, images)


@pytest.fixture(scope="module")
def q35():
    return load_model(Q35)


@pytest.fixture(scope="module")
def q35_ids(q35):
    return _prompt(q35, _q35_messages())


def test_qwen35_image_rows_match_transformers(q35):
    from engine.vision.qwen35 import Qwen35Vision

    assert isinstance(q35.vision, Qwen35Vision)
    for data, ref, (_, gh, gw) in zip(Q35_IMAGES, Q35_GOLDEN["image_rows"], Q35_GOLDEN["grids"], strict=True):
        ref = np.array(ref)
        pixels = q35.vision.pixels(data)
        assert pixels.shape[1:] == (gh * 4, gw * 4)
        rows = q35.vision.encode(pixels)
        np.testing.assert_allclose(rows, ref, atol=1e-4 * np.abs(ref).max())
    # the processor's first patches: (C, T, p, p) of the first image's first merge square, T copies
    first = q35.vision.pixels(Q35_IMAGES[0])[:, :4, :4]
    ref = np.array(Q35_GOLDEN["pixels"][0]).reshape(3, 2, 4, 4)
    np.testing.assert_allclose(first, ref[:, 0], atol=1e-4)
    np.testing.assert_allclose(first, ref[:, 1], atol=1e-4)


def test_qwen35_prompt_logits_and_greedy_match_transformers(q35, q35_ids):
    base = q35.model.images.base
    assert [IMAGE_TOKEN if t >= base else t for t in q35_ids] == Q35_GOLDEN["tokens"]
    text = q35.tokenizer.decode([t if t < base else IMAGE_TOKEN for t in q35_ids])
    assert "<|vision_start|>" + "<|image_pad|>" * 24 + "<|vision_end|>" in text
    assert "<|vision_start|>" + "<|image_pad|>" * 28 + "<|vision_end|>" in text
    logits = q35.model.forward(q35_ids, q35.model.new_cache(256), all_logits=True)
    np.testing.assert_allclose(logits, Q35_REF, atol=Q35_TOL)
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out = [e.token for e in generate(q35.model, q35.tokenizer, q35_ids, q35.model.new_cache(256), params)
           if e.token is not None]
    assert out == Q35_GOLDEN["greedy"]


def test_qwen35_positions_continue_after_each_image(q35, q35_ids):
    table = q35.model.images
    ids = np.array(q35_ids)
    (a0, a1), (b0, b1) = table.runs(ids)
    axes = table.positions([], ids)
    assert (axes[:, :a0] == np.arange(a0)).all()
    # the first image: 4 x 6 rows at t = a0, h = a0 + row, w = a0 + column; text resumes at a0 + 6
    np.testing.assert_array_equal(axes[0, a0:a1], np.full(24, a0))
    np.testing.assert_array_equal(axes[1, a0:a1], a0 + np.arange(24) // 6)
    np.testing.assert_array_equal(axes[2, a0:a1], a0 + np.arange(24) % 6)
    assert (axes[:, a1] == a0 + 6).all()
    shift = 6 - 24 + 7 - 28  # 7 x 4 second image
    assert (axes[:, b1:] == np.arange(b1, len(ids)) + shift).all()
    # any split of the held ids and the pass gives the same positions
    for cut in (a0 + 5, a1, b0 + 13, len(ids) - 1):
        np.testing.assert_array_equal(table.positions(ids[:cut], ids[cut:]), axes[:, cut:])


def test_qwen35_index_positions_would_not_match(q35, q35_ids, monkeypatch):
    """The golden depends on M-RoPE: the cache's index as every position misses it."""
    monkeypatch.setattr(q35.model, "mrope", None)
    logits = q35.model.forward(q35_ids, q35.model.new_cache(256), all_logits=True)
    assert np.abs(logits - Q35_REF).max() > 10 * Q35_TOL


def test_qwen35_moe_rows_prompt_logits_and_greedy_match_transformers():
    """Qwen3.5-MoE (tests/fixtures/tiny/qwen3_5_moe-vision): the same tower and M-RoPE, MoE text layers."""
    from engine.vision.qwen35 import Qwen35Vision

    golden = json.loads((Q35MOE / "golden_vision.json").read_text())
    images = [(Q35MOE / name).read_bytes() for name in golden["images"]]
    lm = load_model(Q35MOE)
    assert isinstance(lm.vision, Qwen35Vision)
    for data, ref in zip(images, golden["image_rows"], strict=True):
        ref = np.array(ref)
        rows = lm.vision.encode(lm.vision.pixels(data))
        np.testing.assert_allclose(rows, ref, atol=1e-4 * np.abs(ref).max())
    ids = _prompt(lm, _with_images(golden, images))
    assert [IMAGE_TOKEN if t >= lm.model.images.base else t for t in ids] == golden["tokens"]
    ref = np.array(golden["logits"])
    tol = 1e-4 * np.abs(ref).max()
    np.testing.assert_allclose(lm.model.forward(ids, lm.model.new_cache(256), all_logits=True), ref, atol=tol)
    last, _ = prefill(lm.model, lm.model.new_cache(256), ids, 7)  # passes that cut images
    np.testing.assert_allclose(last, ref[-1], atol=tol)
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out = [e.token for e in generate(lm.model, lm.tokenizer, ids, lm.model.new_cache(256), params)
           if e.token is not None]
    assert out == golden["greedy"]


@pytest.mark.parametrize("folder", [Q35, Q35MOE], ids=["dense", "moe"])
def test_qwen35_gguf_with_its_mmproj_matches_transformers(tmp_path, folder):
    """The mmproj as llama.cpp's converter writes Qwen3.5's (projector qwen3vl_merger, the 3D patch kernel as
    two 2D ones, the merger as v.post_ln, mm.0, mm.2), read back beside the F16 GGUF."""
    from models.formats.gguf import open_gguf

    golden = json.loads((folder / "golden_vision.json").read_text())
    out = convert(folder, "F16", tmp_path / "q35.gguf")
    assert out.mmproj == tmp_path / "mmproj-q35-f16.gguf"
    with open_gguf(out.mmproj) as gguf:
        meta, tensors = gguf.metadata, gguf.tensors
        assert meta["general.architecture"] == "clip" and meta["clip.projector_type"] == "qwen3vl_merger"
        assert meta["clip.use_gelu"] and meta["clip.has_vision_encoder"]
        assert meta["clip.vision.spatial_merge_size"] == 2 and meta["clip.vision.image_size"] == 16
        assert list(meta["clip.vision.is_deepstack_layers"]) == [False, False]
        assert (meta["clip.vision.image_min_pixels"], meta["clip.vision.image_max_pixels"]) == (256, 1920)
        for key in ("patch_size", "embedding_length", "feed_forward_length", "block_count", "projection_dim",
                    "attention.head_count", "attention.layer_norm_epsilon", "image_mean", "image_std"):
            assert f"clip.vision.{key}" in meta
        assert tuple(tensors["v.patch_embd.weight"].shape) == tuple(tensors["v.patch_embd.weight.1"].shape)
        for name in ("v.patch_embd.bias", "v.position_embd.weight", "v.blk.1.attn_qkv.weight",
                     "v.blk.1.attn_qkv.bias", "v.blk.1.attn_out.weight", "v.blk.1.ln1.weight",
                     "v.blk.1.ln2.bias", "v.blk.1.ffn_up.weight", "v.blk.1.ffn_down.bias", "v.post_ln.weight",
                     "mm.0.weight", "mm.2.bias"):
            assert name in tensors, name
        assert not any(n.startswith("v.deepstack") for n in tensors)
    lm = load_model(out.output)
    assert lm.vision is not None and not lm.vision_notice
    ids = _prompt(lm, _with_images(golden, [(folder / name).read_bytes() for name in golden["images"]]))
    ref = np.array(golden["logits"])
    logits = lm.model.forward(ids, lm.model.new_cache(256), all_logits=True)
    print(f"{folder.name}: max |logit - golden| {np.abs(logits - ref).max():.3g}, max |golden| "
          f"{np.abs(ref).max():.3g}")
    np.testing.assert_allclose(logits, ref, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("chunk", [3, 7, 40, 256])
def test_qwen35_chunked_prefill_matches_one_pass(q35, q35_ids, chunk):
    cache = q35.model.new_cache(256)
    last, _ = prefill(q35.model, cache, q35_ids, chunk)  # passes that cut images
    np.testing.assert_allclose(last, Q35_REF[-1], atol=Q35_TOL)


@pytest.mark.parametrize("folder", [Q35, Q35MOE, Q3VL, Q3VLMOE, Q25VL, Q2VL],
                         ids=["dense", "moe", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl", "qwen2_vl"])
def test_qwen35_second_chat_turn_equals_a_fresh_run(folder):
    golden = json.loads((folder / "golden_vision.json").read_text())
    messages = _with_images(golden, [(folder / name).read_bytes() for name in golden["images"]])
    params = GenerationParams(max_tokens=6, temperature=0.0)
    runner = ChatRunner.load(folder, LoadOptions(n_ctx=256, batch_size=16, prefix_cache_mb=0))
    assert runner.info.vision
    first = list(runner.chat(messages, params))
    assert [e.token for e in first if e.token is not None] == golden["greedy"][:6]
    reply = "".join(e.text for e in first)
    follow = messages + [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "and the first one?"}]
    second = list(runner.chat(follow, params))
    start = runner.lm.model.images.runs(np.array(runner.cache.tokens))[-1][1]
    assert second[-1].cached_tokens >= start  # both images came from the cache
    fresh = ChatRunner.load(folder, LoadOptions(n_ctx=256, batch_size=16, prefix_cache_mb=0))
    alone = list(fresh.chat(follow, params))
    tokens = [e.token for e in second if e.token is not None]
    assert tokens == [e.token for e in alone if e.token is not None] and len(tokens) == 6
    # the logits of the second turn's prompt: after reuse, as a fresh cache gives them
    ids = _prompt(runner.lm, follow)
    model = runner.lm.model
    cache = model.new_cache(256)
    whole = model.forward(ids, cache, all_logits=True)[-1]
    reused = model.new_cache(256)
    prefill(model, reused, ids[: start + 3], 16)
    reused.trim(2)  # to a state the cache holds (DeltaNet layers return to a pass's start or end)
    assert reused.offset < start + 3
    again = model.forward(ids[reused.offset :], reused)[-1]
    np.testing.assert_allclose(again, whole, atol=1e-4 * np.abs(whole).max())


def test_qwen35_batched_decode_takes_each_caches_positions(q35, q35_ids):
    model = q35.model
    with_images, text = model.new_cache(256), model.new_cache(256)
    prefill(model, with_images, q35_ids, 256)
    prefill(model, text, Q35_GOLDEN["tokens"][:20], 256)
    a, b = model.new_cache(256), model.new_cache(256)
    prefill(model, a, q35_ids, 256)
    prefill(model, b, Q35_GOLDEN["tokens"][:20], 256)
    batch = model.forward_batch([5, 9], [with_images, text])
    np.testing.assert_allclose(batch[0], model.forward([5], a)[-1], atol=Q35_TOL)
    np.testing.assert_allclose(batch[1], model.forward([9], b)[-1], atol=Q35_TOL)


def test_image_rows_are_kept_within_a_byte_budget():
    table = ImageTable(base=10, hidden=4, max_bytes=3 * 8 * 4 * 4)  # three images of 8 rows
    slots = [table.add(str(i), np.full((8, 4), i, np.float32)) for i in range(4)]
    assert table.slot_of("0") is None and table.nbytes == 3 * 8 * 4 * 4  # the oldest went
    assert table.missing(table.ids(slots[3]) + [10, 11]) == 1  # slot 0's ids are no longer held
    table.add("big", np.zeros((100, 4), np.float32))  # alone over the budget: the newest always stays
    assert table.slot_of("big") is not None and len(table._rows) == 1


def test_a_conversation_over_the_image_budget_is_a_typed_error(lm, monkeypatch):
    one_image = 4 * lm.model.cfg.hidden_size * 4  # 4 rows of float32
    monkeypatch.setattr(lm.model.images, "max_bytes", one_image + 1)  # room for one image only
    fresh = [_rgb_png(seed) for seed in (3, 4)]
    with pytest.raises(ImageInputError, match="need more than"):
        _prompt(lm, _messages(fresh))


def _rgb_png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def test_gemma4_causal_images_as_e2b_and_e4b_ship_match_transformers():
    """Gemma 4 without use_bidirectional_attention (E2B, E4B): image rows attend causally everywhere
    (tests/fixtures/tiny/gemma4-vision-causal, the same tower and text model as gemma4-vision)."""
    folder = TINY / "gemma4-vision-causal"
    golden = json.loads((folder / "golden_vision.json").read_text())
    ref = np.array(golden["logits"])
    lm = load_model(folder)
    assert lm.vision is not None and not lm.model.images.bidirectional
    ids = _prompt(lm, _with_images(golden, [(folder / name).read_bytes() for name in golden["images"]]))
    assert [IMAGE_TOKEN if t >= lm.model.images.base else t for t in ids] == golden["tokens"]
    np.testing.assert_allclose(lm.model.forward(ids, lm.model.new_cache(512), all_logits=True), ref,
                               atol=1e-4 * np.abs(ref).max())
    last, _ = prefill(lm.model, lm.model.new_cache(512), ids, 5)  # passes may cut images here
    np.testing.assert_allclose(last, ref[-1], atol=1e-4 * np.abs(ref).max())


# Qwen3-VL (tests/fixtures/tiny/qwen3_vl-vision): Qwen3.5's tower with deepstack mergers after vision blocks 0
# and 1, whose rows are added to the image rows after text layers 0 and 1; the same two images and M-RoPE
Q3VL_GOLDEN = json.loads((Q3VL / "golden_vision.json").read_text())
Q3VL_REF = np.array(Q3VL_GOLDEN["logits"])
Q3VL_TOL = 1e-4 * np.abs(Q3VL_REF).max()
Q3VL_IMAGES = [(Q3VL / name).read_bytes() for name in Q3VL_GOLDEN["images"]]


@pytest.fixture(scope="module")
def q3vl():
    return load_model(Q3VL)


@pytest.fixture(scope="module")
def q3vl_ids(q3vl):
    return _prompt(q3vl, _with_images(Q3VL_GOLDEN, Q3VL_IMAGES))


def test_qwen3_vl_image_and_deepstack_rows_match_transformers(q3vl):
    from engine.vision.qwen35 import Qwen35Vision

    assert isinstance(q3vl.vision, Qwen35Vision) and q3vl.vision.shape.deepstack == (0, 1)
    width = q3vl.model.cfg.hidden_size
    for k, (data, ref) in enumerate(zip(Q3VL_IMAGES, Q3VL_GOLDEN["image_rows"], strict=True)):
        rows = q3vl.vision.encode(q3vl.vision.pixels(data))
        assert rows.shape == (len(ref), 3 * width)  # [merged | deepstack 0 | deepstack 1]
        sets = [ref] + [level[k] for level in Q3VL_GOLDEN["deepstack_rows"]]
        for level, want in enumerate(sets):
            want = np.array(want)
            got = rows[:, level * width : (level + 1) * width]
            np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_qwen3_vl_prompt_logits_and_greedy_match_transformers(q3vl, q3vl_ids):
    base = q3vl.model.images.base
    assert [IMAGE_TOKEN if t >= base else t for t in q3vl_ids] == Q3VL_GOLDEN["tokens"]
    logits = q3vl.model.forward(q3vl_ids, q3vl.model.new_cache(256), all_logits=True)
    print(f"qwen3_vl: max |logit - golden| {np.abs(logits - Q3VL_REF).max():.3g}, max |golden| "
          f"{np.abs(Q3VL_REF).max():.3g}")
    np.testing.assert_allclose(logits, Q3VL_REF, atol=Q3VL_TOL)
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out = [e.token for e in generate(q3vl.model, q3vl.tokenizer, q3vl_ids, q3vl.model.new_cache(256), params)
           if e.token is not None]
    assert out == Q3VL_GOLDEN["greedy"]


def test_qwen3_vl_golden_depends_on_deepstack(q3vl, q3vl_ids, monkeypatch):
    """Without the deepstack sets (or with them one layer late) the logits miss transformers'."""
    table = q3vl.model.images
    monkeypatch.setattr(table, "deepstack", 0)
    logits = q3vl.model.forward(q3vl_ids, q3vl.model.new_cache(256), all_logits=True)
    assert np.abs(logits - Q3VL_REF).max() > 10 * Q3VL_TOL
    monkeypatch.undo()
    add = table.add_deepstack
    # each set one layer late: set 0 after layer 1, set 1 never
    monkeypatch.setattr(table, "add_deepstack", lambda out, ids, level: level and add(out, ids, level - 1))
    logits = q3vl.model.forward(q3vl_ids, q3vl.model.new_cache(256), all_logits=True)
    assert np.abs(logits - Q3VL_REF).max() > 10 * Q3VL_TOL


@pytest.mark.parametrize("chunk", [3, 7, 13, 40, 256])
def test_qwen3_vl_chunked_prefill_matches_one_pass(q3vl, q3vl_ids, chunk):
    """Passes that cut an image add each deepstack row to its own image row."""
    cache = q3vl.model.new_cache(256)
    last, _ = prefill(q3vl.model, cache, q3vl_ids, chunk)
    np.testing.assert_allclose(last, Q3VL_REF[-1], atol=Q3VL_TOL)
    again = q3vl.model.new_cache(256)
    whole = q3vl.model.forward(q3vl_ids, again, all_logits=True)
    step = q3vl.model.new_cache(256)
    rows = [q3vl.model.forward(q3vl_ids[i : i + chunk], step, all_logits=True)
            for i in range(0, len(q3vl_ids), chunk)]
    np.testing.assert_allclose(np.concatenate(rows), whole, atol=Q3VL_TOL)
    np.testing.assert_allclose(np.concatenate(rows), Q3VL_REF, atol=Q3VL_TOL)


def test_qwen3_vl_text_config_is_qwen3_with_mrope(q3vl):
    """llama.cpp's qwen3vl: Qwen3's layers, M-RoPE, and the deepstack sets' count (its GGUFs and mmproj:
    tests/engine/test_qwen3vl_gguf.py)."""
    from engine.vision.qwen35 import mrope_masks

    assert q3vl.model.cfg.architecture == "qwen3vl" and q3vl.model.cfg.deepstack_layers == 2
    np.testing.assert_array_equal(q3vl.model.mrope, mrope_masks((3, 3, 2), 8))


def test_held_images_are_kept_past_the_budget_and_refuse_what_does_not_fit():
    from engine.errors import ImagesBusyError
    from engine.vision.tokens import ImageTable

    table = ImageTable(100, hidden=2, capacity=2)
    a = table.ids(table.add("a", np.ones((3, 2))))
    b = table.ids(table.add("b", np.ones((3, 2))))
    held = table.hold(a + [5] + b)  # a prompt holding both (and a text token)
    assert held == (0, 1)
    with pytest.raises(ImagesBusyError, match="retry when they finish"):
        table.add("c", np.ones((3, 2)))
    assert table.slot_of("c") is None and not table.missing(a + b)  # nothing dropped, nothing stored
    table.release(held)
    c = table.ids(table.add("c", np.ones((3, 2))))
    assert table.missing(a) == 1 and not table.missing(b + c)  # unheld: the oldest goes, as before
    # two prompts hold b: it stays until both let it go
    first, second = table.hold(b), table.hold(b + c)
    table.release(first)
    with pytest.raises(ImagesBusyError):
        table.add("d", np.ones((3, 2)))
    table.release(second)
    table.add("d", np.ones((3, 2)))
    assert table.missing(b) == 1
