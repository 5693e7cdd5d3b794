"""Fallback chat templates for models whose file carries none (base checkpoints such as Gemma 3 270M).

A base model was never trained on a turn format, so any template is a guess; the family's own
instruction format (Gemma's `<start_of_turn>`, Gemma 4's `<|turn>`) is the best one, and ChatML the
default for the rest.
The templates are Jinja files in resources/templates/, rendered by engine.chat_template.
"""

from __future__ import annotations

from pathlib import Path

from engine.chat_template import ChatTemplate, TemplateError

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "resources" / "templates"

# GGUF general.architecture -> template file stem; anything else gets DEFAULT_TEMPLATE
_FAMILY_TEMPLATES = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma", "gemma4": "gemma4",
}
DEFAULT_TEMPLATE = "chatml"


def fallback_template_name(architecture: str) -> str:
    """Stem of the fallback template file (in TEMPLATE_DIR) used for `architecture`."""
    return _FAMILY_TEMPLATES.get(architecture, DEFAULT_TEMPLATE)


def ensure_chat_template(lm) -> str | None:
    """Give a model without a chat template (a base checkpoint) its family's fallback template.

    Args:
        lm: an engine.loader.LoadedModel; its `template` is set when it had none.

    Returns:
        A notice for the user when the fallback was chosen, else None.
    """
    if lm.template is not None:
        return None
    arch = str(lm.metadata.get("general.architecture", ""))
    tok = lm.tokenizer
    # prompts are encoded without added specials, so the template writes BOS when the model wants it
    bos = tok.bos_token if tok.add_bos else None
    lm.template = fallback_template(arch, bos_token=bos, eos_token=tok.eos_token)
    return (
        f"{lm.name} has no chat template (a base model, trained to continue text); chatting in the fallback "
        f"{fallback_template_name(arch)} turn format, so replies may be poor. "
        "`hearth run` without --chat continues a text instead."
    )


def fallback_template(
    architecture: str, bos_token: str | None = None, eos_token: str | None = None
) -> ChatTemplate:
    """The fallback chat template for a model family.

    Args:
        architecture: GGUF `general.architecture` (e.g. "gemma3", "llama").
        bos_token: text the template writes first; pass the BOS token text only when the model
            wants BOS prepended (the chat prompt is encoded without adding special tokens).
        eos_token: the model's EOS token text, for templates that print it.

    Raises:
        TemplateError: the template file is missing (a broken installation) or invalid.
    """
    path = TEMPLATE_DIR / f"{fallback_template_name(architecture)}.jinja"
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TemplateError(
            f"the fallback chat template {path} cannot be read ({e}); reinstall Hearth"
        ) from e
    return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)
