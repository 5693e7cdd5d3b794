"""Images in chat messages: a vision tower turns each image into rows of the language model's input.

A message's `content` is a string or a list of parts, `{"type": "text", "text": str}` and
`{"type": "image", "image": bytes}` (an encoded image file: PNG, JPEG, WebP, GIF, BMP, ...). The prompt
holds an image as a run of image ids (engine.vision.tokens): ids past the vocabulary, unique to the
image's content, whose embeddings the vision tower computed. Everything that works on token ids (KV reuse
across turns, the prefix store, trimming) therefore tells images apart, and a prompt pass never ends
inside an image (engine.vision.tokens.chunk_end), whose tokens attend to each other both ways.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def content_parts(content: Any) -> list[dict]:
    """A message's content as a list of parts (a string is one text part; None none)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [dict(part) for part in content]


def message_text(content: Any) -> str:
    """The text of a message's content: the string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def message_images(content: Any) -> list[bytes]:
    """The encoded images of a message's content, in order."""
    if content is None or isinstance(content, str):
        return []
    return [part["image"] for part in content if part.get("type") == "image"]


def has_images(messages: Iterable[Mapping]) -> bool:
    """Whether any message carries an image part."""
    return any(message_images(m.get("content")) for m in messages)


def count_images(messages: Sequence[Mapping]) -> int:
    return sum(len(message_images(m.get("content"))) for m in messages)


def prepare_messages(lm, messages: Sequence[Mapping]) -> tuple[list[dict], list[bytes]]:
    """Messages ready for the chat template, and the images they carry, in order.

    A message with images keeps a list of parts whose images are `{"type": "image"}` (the template
    places each image's marker; the bytes stay out of the template). Content that is a list of text
    parts only becomes its string, as every template reads it.

    Raises:
        ImageInputError: there are images and the model reads none.
    """
    from engine.errors import ImageInputError

    out, images = [], []
    for m in messages:
        content = m.get("content")
        found = message_images(content)
        if not found:
            out.append({**m, "content": message_text(content)} if isinstance(content, list) else dict(m))
            continue
        images += found
        parts = [
            {"type": "image"} if p.get("type") == "image" else {"type": "text", "text": p.get("text", "")}
            for p in content
        ]
        out.append({**m, "content": parts})
    if images and getattr(lm, "vision", None) is None and getattr(lm, "vision_notice", ""):
        raise ImageInputError(f"{lm.name} reads no images as loaded: {lm.vision_notice}")
    if images and getattr(lm, "vision", None) is None:
        raise ImageInputError(
            f"{lm.name} does not read images. Load a model with a vision tower: a Hugging Face folder with "
            "its vision weights, or a GGUF with its mmproj file in the same folder"
        )
    return out, images


def encode_with_images(lm, text: str, images: Sequence[bytes]) -> list[int]:
    """Token ids of a rendered prompt (no BOS added: templates write it) with each image's ids in place.

    Raises:
        ImageInputError: an image cannot be read, or the template placed fewer or more images than given.
    """
    if not images:
        return lm.tokenizer.encode(text, add_special=False)
    from engine.errors import ImageInputError

    ids = lm.vision.encode_prompt(lm.tokenizer, text, images)
    if lm.vision.images.missing(ids):  # encoding the later images dropped earlier ones: over the budget
        table = lm.vision.images
        raise ImageInputError(
            f"the conversation's images need more than the {table.max_bytes >> 20} MiB (or {table.capacity} "
            "images) kept for image rows: start a new chat, or send fewer or smaller images"
        )
    return ids
