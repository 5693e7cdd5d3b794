"""Draft pairing: which local models can draft for a target (same tokenizer), smallest first.

A draft must produce token ids the target reads the same way: identical vocabulary (every token's
text, in order), the same special tokens (BOS/EOS/end-of-turn/padding) and the same number of logit
rows (padded embeddings included). The same model at a lower-bit quantization qualifies (self-
speculation: high acceptance, a fraction of the bytes to read per token).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from engine.tokenizer import Tokenizer


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """sha256 over the vocabulary (token texts in id order, token types) and the special token ids."""
    h = hashlib.sha256()
    for piece in tok._tokens:  # noqa: SLF001 - the vocabulary itself is what must match
        h.update(piece.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    h.update(repr(list(tok._types)).encode())  # noqa: SLF001
    h.update(repr(_specials(tok)).encode())
    return h.hexdigest()


def _specials(tok: Tokenizer) -> tuple:
    return (tok.bos_id, tok.eos_id, tok.pad_id, tuple(sorted(tok.eot_ids)))


def compatibility_problem(
    target: Tokenizer, draft: Tokenizer, target_rows: int, draft_rows: int
) -> str | None:
    """Why `draft` cannot draft for `target`, or None when it can.

    Args:
        target, draft: the two tokenizers.
        target_rows, draft_rows: the models' logit rows (cfg.vocab_size).
    """
    if target.vocab_size != draft.vocab_size:
        return f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}"
    if target_rows != draft_rows:
        return f"it scores {draft_rows} token ids, the target {target_rows}"
    if _specials(target) != _specials(draft):
        return (f"special tokens differ (bos, eos, pad, end-of-turn ids: {_specials(draft)}, the target's "
                f"{_specials(target)})")
    if tokenizer_fingerprint(target) != tokenizer_fingerprint(draft):
        return "the token texts differ (a different tokenizer with the same size)"
    return None


@dataclass(frozen=True)
class DraftCandidate:
    """A local model that can draft for the target."""

    path: Path
    name: str
    size_bytes: int
    quantization: str
    same_model: bool  # the target's own weights at another quantization (self-speculation)


def _gguf_identity(path: Path, n_tokens: int | None = None) -> tuple[Tokenizer, int, str, str, str] | None:
    """(tokenizer, logit rows, name, quantization, base name) of a GGUF, without building the model.

    With n_tokens, a file whose vocabulary has another size is answered None before its tokenizer is
    built (building Gemma's 262k-token tokenizer takes seconds; the size check reads the metadata only).
    """
    from models.formats.ggml_types import type_name
    from models.formats.gguf import open_gguf

    try:
        g = open_gguf(path)
        md = g.metadata
        if n_tokens is not None and len(md.get("tokenizer.ggml.tokens", ())) != n_tokens:
            return None
        tok = Tokenizer.from_gguf_metadata(md)
        embd = g.tensors.get("token_embd.weight")
        rows = int(embd.shape[0]) if embd is not None else tok.vocab_size
        types = [t.ggml_type for name, t in g.tensors.items() if name.endswith("ffn_down.weight")]
        quant = type_name(max(set(types), key=types.count)) if types else "?"
        base = str(md.get("general.basename") or md.get("general.name") or path.stem)
        size = md.get("general.size_label") or ""
        identity = f"{base}|{size}|{md.get('general.finetune')}"
        return tok, rows, str(md.get("general.name") or path.stem), quant, identity
    except Exception:  # an unreadable file is simply not a candidate
        return None


def draft_candidates(target_path: Path, paths=None) -> list[DraftCandidate]:
    """Local models that can draft for the target at target_path, smallest file first.

    Args:
        target_path: the target's GGUF.
        paths: GGUF files to consider; by default every GGUF in the local library (models.library).
    """
    target_path = Path(target_path)
    ident = _gguf_identity(target_path)
    if ident is None:
        return []
    t_tok, t_rows, _, _, t_base = ident
    t_size = target_path.stat().st_size
    if paths is None:
        paths = _library_ggufs()
    out = []
    for p in paths:
        p = Path(p)
        if p.resolve() == target_path.resolve() or p.suffix != ".gguf" or not p.is_file():
            continue
        size = p.stat().st_size
        if size >= t_size:
            continue  # a draft must be cheaper to run than the target
        d = _gguf_identity(p, n_tokens=t_tok.vocab_size)
        if d is None or compatibility_problem(t_tok, d[0], t_rows, d[1]):
            continue
        out.append(DraftCandidate(p, d[2], size, d[3], same_model=d[4] == t_base))
    return sorted(out, key=lambda c: c.size_bytes)


def _library_ggufs() -> list[Path]:
    """GGUF files in the local model library index (models.library.Library), existing ones only."""
    from models.library import Library

    return [Path(e.path) for e in Library().entries() if e.format == "gguf" and e.exists]
