"""Ranking document chunks with an embedding model (engine.document_context): BM25 and cosine similarity
fused by reciprocal rank, a chunk in other words getting in, embed=None keeping the keyword ranking, the
chunk vector cache, and a failed embedding falling back to keywords. The embedding model here is a fake
with deterministic vectors: each text counts the words of a few topics."""

from __future__ import annotations

import re

import numpy as np
import pytest

from engine.document_context import (
    RRF_K,
    VectorCache,
    cached_embed,
    fuse_ranks,
    select,
    sources_text,
    with_documents,
)
from engine.documents import Document
from engine.errors import EmbeddingModelError

TOPICS = [
    {"money", "earn", "paid", "crowns", "salary", "wage"},
    {"clerk", "office", "opens"},
    {"gardens", "weather", "history", "town"},
]
PAY = "Alice is paid nine hundred crowns every month."  # the answer, in none of the question's words
CLERK = "The clerk opens the office at nine."
QUESTION = "How much money does the clerk earn?"


def fake_vectors(texts, task="document") -> np.ndarray:
    rows = []
    for t in texts:
        words = re.findall(r"\w+", t.lower())
        v = np.array([sum(w in topic for w in words) for topic in TOPICS] + [0.1], np.float32)
        rows.append(v / np.linalg.norm(v))
    return np.stack(rows)


class Counting:
    """The fake model, recording what it was asked to embed."""

    def __init__(self):
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, texts, task):
        self.calls.append((task, list(texts)))
        return fake_vectors(texts, task)


def _docs() -> list[Document]:
    paras = [f"Section {i} talks about gardens, weather and the history of the town." for i in range(40)]
    paras[20], paras[30] = PAY, CLERK
    return [Document("town.txt", "\n\n".join(paras), 9000)]


def _count(text: str) -> int:
    """60 tokens a paragraph: one paragraph a chunk, three chunks in a budget of 300."""
    return 60 * len([p for p in re.split(r"\n\s*\n", text) if p.strip()])


BUDGET = 300


def _texts(selection) -> list[str]:
    return [p.text for p in selection.parts]


def test_fuse_ranks_is_reciprocal_rank_fusion():
    fused = fuse_ranks([1, 2], [2, 3])
    first, second = 1 / (RRF_K + 1), 1 / (RRF_K + 2)
    assert fused == pytest.approx({1: first, 2: second + first, 3: second})


def test_a_chunk_in_other_words_gets_in_by_meaning_and_keywords_still_count():
    docs = _docs()
    keywords = select(docs, QUESTION, BUDGET, _count)
    assert _texts(keywords) == [CLERK], "BM25 alone: only the chunk sharing a word"
    assert keywords.ranked_by == "keywords" and not keywords.notice

    both = select(docs, QUESTION, BUDGET, _count, embed=Counting(), embed_name="fake-embed")
    texts = _texts(both)
    assert PAY in texts, "no word in common, but the closest by meaning"
    assert CLERK in texts, "the exact keyword match still counts"
    assert texts.index(PAY) < texts.index(CLERK), "put back in document order"
    assert both.ranked_by == "keywords and fake-embed" and not both.notice
    assert sum(_count(t) + 20 for t in texts) + 16 <= BUDGET
    (source,) = both.sources()
    assert source["ranked_by"] == "keywords and fake-embed"
    assert sources_text(both.sources()).endswith(" · ranked by keywords and fake-embed")
    assert sources_text(keywords.sources()).endswith(" · ranked by keywords")

    # a question sharing no word with any chunk: the closest chunks, not the documents' first ones
    question = "What wage does she get?"
    assert "Section 0" in _texts(select(docs, question, BUDGET, _count))[0], "by keywords: the first chunks"
    assert PAY in _texts(select(docs, question, BUDGET, _count, embed=fake_vectors))


def test_without_embed_the_selection_is_the_keyword_one():
    docs = _docs()
    for question in (QUESTION, "zzz qqq", ""):
        plain = select(docs, question, BUDGET, _count)
        assert select(docs, question, BUDGET, _count, embed=None) == plain
        out, sel = with_documents([{"role": "user", "content": question}], [docs], BUDGET, _count)
        assert sel == plain
    asked = Counting()  # an empty message has nothing to search by meaning: keywords, nothing embedded
    assert _texts(select(docs, "", BUDGET, _count, embed=asked)) == _texts(select(docs, "", BUDGET, _count))
    assert asked.calls == []
    # documents that fit whole go whole: nothing is embedded
    small = [Document("a.txt", "The sky is green.", 10)]
    assert select(small, QUESTION, BUDGET, embed=asked).mode == "whole" and asked.calls == []


def test_chunk_vectors_are_cached_per_model_so_a_follow_up_embeds_only_its_question():
    docs = _docs()
    model = Counting()
    cache = VectorCache()
    embed = cached_embed(model, "models/fake-embed.gguf", cache)
    select(docs, QUESTION, BUDGET, _count, embed=embed)
    assert [task for task, _ in model.calls] == ["document", "query"]
    assert len(model.calls[0][1]) == 40 and len(cache) == 40
    model.calls.clear()
    again = select(docs, "And what wage does Alice get?", BUDGET, _count, embed=embed)
    assert model.calls == [("query", ["And what wage does Alice get?"])], "only the question is embedded"
    assert PAY in _texts(again)

    # a longer chat leaves the documents a little less room: chunks are cut the same, their vectors kept
    long = [Document("facts.txt", " ".join(f"Sentence {i} is about topic {i}." for i in range(300)), 9000)]
    assert select(long, "topic 7?", 600).parts != select(long, "topic 7?", 540).parts, "by keywords: recut"
    model.calls.clear()
    select(long, "topic 7?", 600, embed=embed)
    assert [task for task, _ in model.calls] == ["document", "query"]
    model.calls.clear()
    select(long, "And topic 9?", 540, embed=embed)
    assert model.calls == [("query", ["And topic 9?"])]

    other = Counting()  # another model: its own vectors
    select(docs, QUESTION, BUDGET, _count, embed=cached_embed(other, "models/other.gguf", cache))
    assert len(other.calls[0][1]) == 40

    small = VectorCache(max_bytes=10 * fake_vectors(["x"])[0].nbytes)  # bounded: the oldest go
    select(docs, QUESTION, BUDGET, _count, embed=cached_embed(Counting(), "m", small))
    assert len(small) == 10 and small.nbytes <= small.max_bytes


def test_chunks_are_embedded_in_batches_with_progress_and_a_stop_keeps_the_batches_done():
    docs, model, cache = _docs(), Counting(), VectorCache()
    seen: list[tuple[int, int]] = []

    def report(done: int, total: int) -> None:
        seen.append((done, total))
        if len(seen) == 3:  # the user stops after two batches
            raise RuntimeError("stopped")

    embed = cached_embed(model, "m", cache, batch=16, report=report)
    stopped = select(docs, QUESTION, BUDGET, _count, embed=embed)
    assert seen == [(0, 40), (16, 40), (32, 40)] and len(cache) == 32
    assert "failed (stopped)" in stopped.notice  # what was asked for came by keywords
    model.calls.clear()
    seen.clear()
    whole = select(docs, QUESTION, BUDGET, _count, embed=embed)
    assert [len(texts) for task, texts in model.calls if task == "document"] == [8], "only the rest"
    assert seen == [(0, 8), (8, 8)] and PAY in _texts(whole)
    # the same vectors as one call gives: the batches change nothing
    one = select(docs, QUESTION, BUDGET, _count, embed=cached_embed(Counting(), "m", VectorCache()))
    assert _texts(one) == _texts(whole)


def test_a_failed_embedding_falls_back_to_keywords_with_a_notice():
    def broken(texts, task):
        raise EmbeddingModelError("the embedding model gone.gguf cannot be used: no such file", "gone.gguf")

    docs = _docs()
    sel = select(docs, QUESTION, BUDGET, _count, embed=broken, embed_name="gone")
    plain = select(docs, QUESTION, BUDGET, _count)
    assert sel.parts == plain.parts and sel.ranked_by == "keywords"
    assert "gone.gguf cannot be used" in sel.notice and "ranked by keywords" in sel.notice
