"""What of a chat's documents goes into the prompt, and how it is written there.

Per reply: if every document of the chat fits the budget whole, each goes whole; otherwise the documents
are cut into chunks (paragraphs, then sentences, packed to a token budget with some overlap), the chunks
are ranked by BM25 against the user's question, and the best ones that fit go in, put back in document
order. Token counts come from the model's tokenizer when the caller has one (`count`), else from
estimate_tokens (characters / 3, on the safe side for English prose).

The prompt format (the user's turn; see documents_block):

    <documents>
    <document name="report.pdf" part="whole document">
    ...the text...
    </document>
    <document name="notes.md" part="chunk 3 of 12">
    ...
    </document>
    </documents>

    <the user's question>

Parts are "whole document", or "chunk N of M" with ", page P" (or ", pages P-Q") for a PDF. A text that
itself holds "</document" is written with "</ document" so it cannot close the block early.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.documents import Document

CountFn = Callable[[str], int]
CHUNK_TOKENS = 384  # most a chunk holds (less when the budget is small, see chunk_size)
MIN_CHUNK_TOKENS = 48
OVERLAP = 0.125  # share of a chunk repeated at the start of the next
BLOCK_OVERHEAD = 16  # tokens of the <documents> wrapper
PART_OVERHEAD = 20  # tokens of one <document ...> ... </document> label

_STOPWORD_TEXT = (
    "a an and are as at be by for from has have he her his i if in into is it its of on or that the "
    "their them they this to was were what when where which who why will with you your do does did how "
    "can about there these those than then so not no but all any been being our we my me"
)
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())


def estimate_tokens(text: str) -> int:
    """Tokens of `text` without a tokenizer: ASCII characters / 3 (English BPE runs about 4) plus one a
    character for the rest (CJK, accents: a BPE often spends a token or more on each)."""
    ascii_chars = len(text.encode("ascii", "ignore"))
    return (ascii_chars + 2) // 3 + len(text) - ascii_chars


@functools.lru_cache(maxsize=2)
def model_token_counter(path: str) -> CountFn | None:
    """text -> tokens in the model's own tokenizer, read from its GGUF file or its folder's tokenizer.json
    (for a process that has not loaded the model, such as the app's); None when it cannot be read (callers
    then estimate). Kept for the last two models asked about."""
    try:
        p = Path(path)
        if p.is_dir():
            from tokenizers import Tokenizer as HFTokenizer

            hf = HFTokenizer.from_file(str(p / "tokenizer.json"))
            return lambda text: len(hf.encode(text, add_special_tokens=False).ids)
        from engine.tokenizer import Tokenizer
        from models.formats.gguf import open_gguf

        tokenizer = Tokenizer.from_gguf_metadata(open_gguf(p).metadata)
        return lambda text: len(tokenizer.encode(text))
    except Exception:  # noqa: BLE001 - any failure only means estimates
        return None


# ---- chunks
@dataclass(frozen=True)
class Chunk:
    """A piece of one document: doc (index in the list given), index (0-based) of count, its text,
    where it starts in the document's text, its pages (PDF, 1-based, first and last; None otherwise) and
    its tokens."""

    doc: int
    index: int
    count: int
    text: str
    start: int
    page: int | None
    tokens: int
    last_page: int | None = None

    def label(self) -> str:
        where = f"chunk {self.index + 1} of {self.count}"
        if self.page is None:
            return where
        if self.last_page is None or self.last_page == self.page:
            return f"{where}, page {self.page}"
        return f"{where}, pages {self.page}-{self.last_page}"


def _spans(text: str, pattern: str, start: int, end: int) -> list[tuple[int, int]]:
    """text[start:end] cut after each match of `pattern` (the separator stays with the left piece)."""
    out, at = [], start
    for m in re.compile(pattern).finditer(text, start, end):
        if m.end() > at:
            out.append((at, m.end()))
            at = m.end()
    if at < end:
        out.append((at, end))
    return out


def _units(text: str, max_tokens: int, count: CountFn) -> list[tuple[int, int, int]]:
    """(start, end, tokens) pieces of `text` no longer than max_tokens: paragraphs, else sentences, else
    runs of words."""
    out = []
    for p0, p1 in _spans(text, r"\n[ \t]*\n\s*", 0, len(text)):
        n = count(text[p0:p1])
        if n <= max_tokens:
            out.append((p0, p1, n))
            continue
        for s0, s1 in _spans(text, r"(?<=[.!?;:])[\"')\]]*\s+|\n", p0, p1):
            n = count(text[s0:s1])
            if n <= max_tokens:
                out.append((s0, s1, n))
                continue
            # a sentence longer than a chunk: cut at spaces, at about max_tokens each
            step = max(1, (s1 - s0) * max_tokens // max(n, 1))
            at = s0
            while at < s1:
                cut = min(s1, at + step)
                if cut < s1:
                    space = text.rfind(" ", at + step // 2, cut)
                    cut = space + 1 if space > at else cut
                out.append((at, cut, count(text[at:cut])))
                at = cut
    return out


def chunk_text(text: str, max_tokens: int = CHUNK_TOKENS, overlap: float = OVERLAP,
               count: CountFn | None = None) -> list[tuple[int, int, int]]:
    """Cut `text` into chunks on paragraph (else sentence) boundaries.

    Args:
        max_tokens: most tokens a chunk holds (a single word longer than that is the only exception).
        overlap: the share of max_tokens that the next chunk repeats from the end of this one (whole
            paragraphs or sentences only, so it may repeat less).
        count: text -> tokens (the model's tokenizer); default estimate_tokens.

    Returns:
        (start, end, tokens) of each chunk in `text`, in order; the chunks cover the whole text.
    """
    count = count or estimate_tokens
    units = _units(text, max_tokens, count)
    chunks: list[tuple[int, int, int]] = []
    i = 0
    while i < len(units):
        j, total = i, 0
        while j < len(units) and (j == i or total + units[j][2] <= max_tokens):
            total += units[j][2]
            j += 1
        chunks.append((units[i][0], units[j - 1][1], total))
        if j >= len(units):
            break
        # the next chunk starts with the last units of this one, up to the overlap
        back, repeat = j, 0
        while back - 1 > i and repeat + units[back - 1][2] <= max_tokens * overlap:
            back -= 1
            repeat += units[back][2]
        i = back
    return [c for c in chunks if text[c[0]:c[1]].strip()]


def chunk_size(budget: int) -> int:
    """Chunk length for a prompt budget: CHUNK_TOKENS, less when the budget is small, so that at least
    three chunks (from different places) fit."""
    return max(MIN_CHUNK_TOKENS, min(CHUNK_TOKENS, budget // 3 - PART_OVERHEAD))


def document_chunks(docs: Sequence[Document], max_tokens: int, count: CountFn | None = None) -> list[Chunk]:
    """Every document's chunks, documents in order."""
    out = []
    for d, doc in enumerate(docs):
        spans = chunk_text(doc.text, max_tokens, count=count)
        for k, (start, end, tokens) in enumerate(spans):
            page = last = None
            if doc.page_starts:
                text = doc.text[start:end]
                first_char = start + len(text) - len(text.lstrip())
                last_char = start + len(text.rstrip()) - 1
                page = sum(1 for s in doc.page_starts if s <= first_char) or 1
                last = sum(1 for s in doc.page_starts if s <= last_char) or 1
            out.append(Chunk(d, k, len(spans), doc.text[start:end].strip(), start, page, tokens, last))
    return out


# ---- BM25
def terms(text: str) -> list[str]:
    """The words BM25 matches: lower case, stop words out, a plural's s dropped."""
    out = []
    for w in re.findall(r"\w+", text.lower()):
        if w in _STOPWORDS or (len(w) < 2 and not w.isdigit()):
            continue
        if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return out


class BM25:
    """Okapi BM25 over a fixed list of texts.

    Args:
        texts: the passages to rank.
        k1: term frequency saturation.
        b: length normalisation (0: none, 1: full).
    """

    def __init__(self, texts: Sequence[str], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.docs = [Counter(terms(t)) for t in texts]
        self.lengths = [sum(c.values()) for c in self.docs]
        self.avg = (sum(self.lengths) / len(self.lengths)) if self.lengths else 0.0
        df: Counter = Counter()
        for c in self.docs:
            df.update(c.keys())
        n = len(self.docs)
        # the +1 inside the log keeps a term found in most passages from scoring below zero
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def scores(self, query: str) -> list[float]:
        """One score per text (higher: more relevant to `query`)."""
        q = set(terms(query))
        out = []
        for c, length in zip(self.docs, self.lengths, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / self.avg) if self.avg else self.k1
            s = 0.0
            for t in q:
                f = c.get(t)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1) / (f + norm)
            out.append(s)
        return out


# ---- what goes in
@dataclass
class Part:
    """One labelled piece of the documents block: a whole document, or a chunk."""

    name: str
    label: str  # "whole document" or Chunk.label()
    text: str
    doc: int
    chunk: int | None = None  # the chunk's index; None for a whole document
    of: int = 0  # the document's chunk count (0 for a whole document)


@dataclass
class Selection:
    """What of the documents a reply gets: mode "whole" (every document whole) or "retrieval" (the
    best chunks for the question, in document order); tokens: their estimated (or counted) size."""

    mode: str
    parts: list[Part]
    tokens: int

    def sources(self) -> list[dict]:
        """What the reply shows under it: per document its name and what went in, in order
        ([{"name", "whole": bool, "chunks": [1-based numbers], "of": chunk count}])."""
        out: dict[int, dict] = {}
        for p in self.parts:
            entry = out.setdefault(p.doc, {"name": p.name, "whole": p.chunk is None, "chunks": []})
            if p.chunk is not None:
                entry["chunks"].append(p.chunk + 1)
                entry["of"] = p.of
        return list(out.values())


def whole_tokens(docs: Sequence[Document], count: CountFn | None = None) -> int:
    """The tokens the documents take whole, with their labels."""
    count = count or estimate_tokens
    return BLOCK_OVERHEAD + sum(count(d.text) + PART_OVERHEAD for d in docs)


def select(docs: Sequence[Document], question: str, budget: int, count: CountFn | None = None) -> Selection:
    """Whole documents if they all fit `budget` tokens, else the chunks BM25 ranks best for `question`
    that fit, in document order.

    Args:
        docs: the chat's documents, in the order they were attached.
        question: the message being answered. Only chunks sharing a word with it go in; when none does
            (an empty message, a question in other words), the documents' first chunks.
        budget: tokens the documents may take in the prompt.
        count: text -> tokens (the model's tokenizer); default estimate_tokens.
    """
    if not docs:
        return Selection("whole", [], 0)
    need = whole_tokens(docs, count)
    if need <= budget:
        parts = [Part(d.name, "whole document", d.text, i) for i, d in enumerate(docs)]
        return Selection("whole", parts, need)
    chunks = document_chunks(docs, chunk_size(budget), count)
    scores = BM25([c.text for c in chunks]).scores(question)
    # best first; ties (a question with no words in common) fall back to document order
    ranked = sorted(range(len(chunks)), key=lambda i: (-scores[i], i))
    if any(scores):  # chunks that share no word with the question are noise once some do
        ranked = [i for i in ranked if scores[i] > 0]
    room, chosen = budget - BLOCK_OVERHEAD, []
    for i in ranked:
        cost = chunks[i].tokens + PART_OVERHEAD
        if cost <= room:
            chosen.append(i)
            room -= cost
        if room < MIN_CHUNK_TOKENS + PART_OVERHEAD:
            break
    picked = [chunks[i] for i in sorted(chosen)]
    parts = [Part(docs[c.doc].name, c.label(), c.text, c.doc, c.index, c.count) for c in picked]
    return Selection("retrieval", parts, budget - room)


def documents_block(selection: Selection) -> str:
    """The <documents> block of a selection ("" when it holds nothing)."""
    if not selection.parts:
        return ""
    out = ["<documents>"]
    for p in selection.parts:
        name = p.name.replace('"', "'")
        out.append(f'<document name="{name}" part="{p.label}">')
        out.append(p.text.replace("</document", "</ document").strip())
        out.append("</document>")
    out.append("</documents>")
    return "\n".join(out)


def user_turn(question: str, selection: Selection) -> str:
    """The user's message as the model reads it: the documents block, a blank line, the question."""
    block = documents_block(selection)
    if not block:
        return question
    return f"{block}\n\n{question}" if question else block


def sources_text(sources: Sequence[dict]) -> str:
    """The Sources line under a reply: "report.pdf (whole document); notes.md (chunks 2, 5 of 12)"."""
    items = []
    for s in sources:
        if s.get("whole"):
            items.append(f"{s['name']} (whole document)")
        else:
            n = s.get("chunks", [])
            word = "chunk" if len(n) == 1 else "chunks"
            items.append(f"{s['name']} ({word} {', '.join(map(str, n))} of {s.get('of', '?')})")
    return "; ".join(items)


def document_budget(n_ctx: int, max_tokens: int, other_tokens: int) -> int:
    """The tokens documents may take in a prompt of context n_ctx: what is left after the reply's
    reserve (as the worker keeps it: max_tokens, at most a quarter of the context) and the rest of the
    conversation (`other_tokens`), but never under a third of the room, since the context policy drops
    old turns before it drops the documents."""
    room = n_ctx - min(max_tokens, n_ctx // 4) - 32  # 32: the template's own tokens around the turns
    return max(room - other_tokens, room // 3, 0)


def with_documents(
    conversation: Sequence[dict],
    documents: Sequence[Sequence[Document]],
    budget: int,
    count: CountFn | None = None,
) -> tuple[list[dict], Selection]:
    """The conversation with its documents written into the user turns.

    When all of the chat's documents fit `budget` whole, each goes whole into the message it came with
    (those turns stay the same from reply to reply, so the engine reuses their KV cache). Otherwise the
    chunks that best answer the last user message, taken from all of the chat's documents, go into that
    message, and the earlier ones carry their own text only.

    Args:
        conversation: engine messages ({"role", "content": str or a list of parts}), oldest first.
        documents: per message of `conversation`, the documents attached to it ([] for most).
        budget: tokens the documents may take (document_budget).
        count: text -> tokens (the model's tokenizer); default estimate_tokens.

    Returns:
        the new messages, and the selection over all documents in order (for the Sources line).
    """
    out = [dict(m) for m in conversation]
    flat = [d for docs in documents for d in docs]
    if not flat:
        return out, Selection("whole", [], 0)
    last_user = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=len(out) - 1)
    selection = select(flat, _text_of(out[last_user].get("content", "")), budget, count)
    if selection.mode == "whole":
        at = 0
        for i, docs in enumerate(documents):
            if docs:
                own = Selection("whole", [
                    Part(d.name, "whole document", d.text, at + k) for k, d in enumerate(docs)
                ], 0)
                out[i]["content"] = _insert(out[i].get("content", ""), own)
                at += len(docs)
    else:
        out[last_user]["content"] = _insert(out[last_user].get("content", ""), selection)
    return out, selection


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content if p.get("type") == "text")


def _insert(content, selection: Selection):
    """A message's content with the documents block before its text (images, when it has any, first)."""
    if isinstance(content, str):
        return user_turn(content, selection)
    parts = [dict(p) for p in content]
    texts = [i for i, p in enumerate(parts) if p.get("type") == "text"]
    if texts:
        parts[texts[0]]["text"] = user_turn(parts[texts[0]]["text"], selection)
    else:
        parts.append({"type": "text", "text": documents_block(selection)})
    return parts
