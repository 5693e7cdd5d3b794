"""What of a chat's documents goes into the prompt, and how it is written there.

Per reply: if every document of the chat fits the budget whole, each goes whole; otherwise the documents
are cut into chunks (paragraphs, then sentences, packed to a token budget with some overlap), the chunks
are ranked by BM25 against the user's question, and the best ones that fit go in, put back in document
order. Token counts come from the model's tokenizer when the caller has one (`count`), else from
estimate_tokens (characters / 3, on the safe side for English prose).

With an embedding model (`embed`: texts and a task, "query" or "document", -> unit vectors; the task picks
the model's own prompts) the chunks are ranked by BM25 and by cosine similarity to the question, the two
rankings fused by reciprocal rank (k = RRF_K): an exact keyword match still counts, and a chunk that
answers in other words gets in too. A chunk's vector is computed once per embedding model (cached_embed,
a bounded cache keyed by model and text), so a follow-up question embeds only itself. Should embedding
fail, the chunks are ranked by keywords and the selection says why (Selection.notice).

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
import hashlib
import math
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.documents import Document

CountFn = Callable[[str], int]
# (texts, task "query" or "document") -> (len(texts), dims) float32 unit vectors
EmbedFn = Callable[[Sequence[str], str], np.ndarray]
RRF_K = 60  # reciprocal rank fusion's constant (Cormack et al.): a rank r adds 1 / (RRF_K + r)
SEMANTIC_TOP = 6  # chunks that share no keyword with the question get in only among the closest this many
CHUNK_VECTORS_BYTES = 64 << 20  # the chunk vector cache's bound (about 20000 vectors of 768 floats)
CHUNK_TOKENS = 384  # most a chunk holds (less when the budget is small, see chunk_size)
MIN_CHUNK_TOKENS = 48
CHUNK_STEPS = (CHUNK_TOKENS, 256, 192, 128, 96, 64, MIN_CHUNK_TOKENS)  # chunk sizes to rank by embeddings
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


def stable_chunk_size(budget: int) -> int:
    """chunk_size(budget) rounded down to one of a few steps (CHUNK_STEPS): the budget shrinks a little as a
    chat grows, and chunks cut the same way keep their cached vectors from one question to the next."""
    size = chunk_size(budget)
    return next((s for s in CHUNK_STEPS if s <= size), MIN_CHUNK_TOKENS)


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


# ---- embeddings
class VectorCache:
    """Vectors by key, least recently used out past max_bytes. Thread-safe (the app prepares replies on
    the bridge's threads)."""

    def __init__(self, max_bytes: int = CHUNK_VECTORS_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple) -> np.ndarray | None:
        with self._lock:
            v = self._items.get(key)
            if v is not None:
                self._items.move_to_end(key)
            return v

    def put(self, key: tuple, vector: np.ndarray) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            self.nbytes -= old.nbytes if old is not None else 0
            self._items[key] = vector
            self.nbytes += vector.nbytes
            while self.nbytes > self.max_bytes and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self.nbytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0


CHUNK_VECTORS = VectorCache()  # the process's chunk vectors (the app's, the CLI's)


def cached_embed(
    embed: EmbedFn, model_key: str, cache: VectorCache | None = None, batch: int = 0,
    report: Callable[[int, int], None] | None = None,
) -> EmbedFn:
    """`embed` with its "document" vectors kept in `cache` (default CHUNK_VECTORS) under (model_key, the
    text's hash): only texts not seen before with this model are embedded, `batch` at a time when given
    (each batch's vectors kept as they come), with report(done, total) before each batch and at the end.
    A report that raises ends the embedding there, the batches done kept. Queries are not kept."""
    cache = CHUNK_VECTORS if cache is None else cache

    def run(texts: Sequence[str], task: str) -> np.ndarray:
        if task != "document":
            return embed(texts, task)
        keys = [(model_key, hashlib.sha256(t.encode("utf-8")).hexdigest()) for t in texts]
        rows = [cache.get(k) for k in keys]
        missing = [i for i, v in enumerate(rows) if v is None]
        step = batch or max(1, len(missing))
        for start in range(0, len(missing), step):
            if report is not None:
                report(start, len(missing))
            part = missing[start : start + step]
            new = np.asarray(embed([texts[i] for i in part], "document"), dtype=np.float32)
            for i, v in zip(part, new, strict=True):
                rows[i] = v
                cache.put(keys[i], v)
        if missing and report is not None:
            report(len(missing), len(missing))
        return np.stack(rows) if rows else np.empty((0, 0), np.float32)

    return run


def fuse_ranks(*rankings: Sequence[int], k: int = RRF_K) -> dict[int, float]:
    """Reciprocal rank fusion: each ranking (ids, best first) gives the id at rank r (1-based) 1 / (k + r);
    an id's score is its sum over the rankings that hold it."""
    out: dict[int, float] = {}
    for ranking in rankings:
        for r, i in enumerate(ranking, start=1):
            out[i] = out.get(i, 0.0) + 1.0 / (k + r)
    return out


def _rank(texts: Sequence[str], question: str, embed: EmbedFn | None) -> tuple[list[int], str]:
    """Chunk indices best first (only those worth sending), and the notice of a failed embedding ("")."""
    scores = BM25(texts).scores(question)
    # best first; ties (a question with no words in common) fall back to document order
    keyword = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    if any(scores):  # chunks that share no word with the question are noise once some do
        keyword = [i for i in keyword if scores[i] > 0]
    if embed is None or not question.strip():
        return keyword, ""
    try:
        vectors = np.asarray(embed(texts, "document"), dtype=np.float32)
        query = np.asarray(embed([question], "query"), dtype=np.float32)[0]
    except Exception as e:  # noqa: BLE001 - a failed search falls back to keywords; the reply goes on
        return keyword, f"document search by meaning failed ({e}); chunks were ranked by keywords"
    similarity = vectors @ query
    semantic = sorted(range(len(texts)), key=lambda i: (-float(similarity[i]), i))
    matched = [i for i in keyword if scores[i] > 0]
    fused = fuse_ranks(matched, semantic)
    candidates = set(matched) | set(semantic[:SEMANTIC_TOP])
    return sorted(candidates, key=lambda i: (-fused.get(i, 0.0), i)), ""


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
    ranked_by: str = ""  # retrieval: "keywords", or "keywords and <embedding model>"
    notice: str = ""  # why an embedding model that was asked for was not used ("" when it was)

    def sources(self) -> list[dict]:
        """What the reply shows under it: per document its name and what went in, in order
        ([{"name", "whole": bool, "chunks": [1-based numbers], "of": chunk count, "ranked_by"}]; the last
        two for chunks only)."""
        out: dict[int, dict] = {}
        for p in self.parts:
            entry = out.setdefault(p.doc, {"name": p.name, "whole": p.chunk is None, "chunks": []})
            if p.chunk is not None:
                entry["chunks"].append(p.chunk + 1)
                entry["of"] = p.of
                if self.ranked_by:
                    entry["ranked_by"] = self.ranked_by
        return list(out.values())


def whole_tokens(docs: Sequence[Document], count: CountFn | None = None) -> int:
    """The tokens the documents take whole, with their labels."""
    count = count or estimate_tokens
    return BLOCK_OVERHEAD + sum(count(d.text) + PART_OVERHEAD for d in docs)


def select(
    docs: Sequence[Document],
    question: str,
    budget: int,
    count: CountFn | None = None,
    embed: EmbedFn | None = None,
    embed_name: str = "embeddings",
) -> Selection:
    """Whole documents if they all fit `budget` tokens, else the chunks ranked best for `question` that
    fit, in document order.

    Args:
        docs: the chat's documents, in the order they were attached.
        question: the message being answered. Without `embed`, only chunks sharing a word with it go in;
            when none does (an empty message, a question in other words), the documents' first chunks.
        budget: tokens the documents may take in the prompt.
        count: text -> tokens (the model's tokenizer); default estimate_tokens.
        embed: an embedding model (EmbedFn; wrap it in cached_embed): chunks (of stable_chunk_size, so
            that they keep their cached vectors as the chat grows) are ranked by BM25 and by similarity,
            fused (RRF); the chunks that share a word with the question and the SEMANTIC_TOP closest are
            the candidates. None: BM25 alone. A failure falls back to BM25 (Selection.notice).
        embed_name: the embedding model's name, for Selection.ranked_by.
    """
    if not docs:
        return Selection("whole", [], 0)
    need = whole_tokens(docs, count)
    if need <= budget:
        parts = [Part(d.name, "whole document", d.text, i) for i, d in enumerate(docs)]
        return Selection("whole", parts, need)
    size = chunk_size(budget) if embed is None else stable_chunk_size(budget)
    chunks = document_chunks(docs, size, count)
    ranked, notice = _rank([c.text for c in chunks], question, embed)
    used = embed is not None and not notice and bool(question.strip())
    ranked_by = f"keywords and {embed_name}" if used else "keywords"
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
    return Selection("retrieval", parts, budget - room, ranked_by, notice)


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
    """The Sources line under a reply: "report.pdf (whole document); notes.md (chunks 2, 5 of 12)", and how
    chunks were ranked when the sources say (" · ranked by keywords and nomic-embed-text")."""
    items, ranked_by = [], ""
    for s in sources:
        if s.get("whole"):
            items.append(f"{s['name']} (whole document)")
        else:
            n = s.get("chunks", [])
            word = "chunk" if len(n) == 1 else "chunks"
            items.append(f"{s['name']} ({word} {', '.join(map(str, n))} of {s.get('of', '?')})")
            ranked_by = ranked_by or s.get("ranked_by", "")
    return "; ".join(items) + (f" · ranked by {ranked_by}" if ranked_by else "")


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
    embed: EmbedFn | None = None,
    embed_name: str = "embeddings",
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
        embed, embed_name: an embedding model to rank chunks with (see select).

    Returns:
        the new messages, and the selection over all documents in order (for the Sources line).
    """
    out = [dict(m) for m in conversation]
    flat = [d for docs in documents for d in docs]
    if not flat:
        return out, Selection("whole", [], 0)
    last_user = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=len(out) - 1)
    selection = select(flat, _text_of(out[last_user].get("content", "")), budget, count, embed, embed_name)
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
