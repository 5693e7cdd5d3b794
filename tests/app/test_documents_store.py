"""Documents in the chat store: schema 5 migrated from a real schema-4 database (written by the schema-4
store, scripts/chats_v4_fixture.py), kept with their message in order, removed with it, exported, imported."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from app.chat_store import SCHEMA_VERSION, ChatStore, ChatStoreError, MessageImage
from engine.documents import Document

V4 = Path(__file__).resolve().parents[1] / "fixtures" / "chats-v4.sqlite3"
REPORT = Document("report.pdf", "Page one.\n\nPage two.", 2048, pages=2, kind="pdf", page_starts=[0, 11])
NOTES = Document("notes.md", "# Notes\n\nBuy milk.", 18)


@pytest.fixture
def store(tmp_path):
    s = ChatStore(tmp_path / "chats.sqlite3")
    yield s
    s.close()


def test_a_real_schema_4_database_migrates_to_documents(tmp_path):
    path = tmp_path / "chats.sqlite3"
    shutil.copy(V4, path)
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "4"
    tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "message_documents" not in tables and "message_images" in tables
    raw.close()

    s = ChatStore(path)
    assert s.schema_version == SCHEMA_VERSION == 5
    chat = s.get_chat("v4chat")
    assert chat.title == "A chat from Hearth 0.1 (schema 4)" and chat.system_prompt == "Be brief."
    msgs = s.messages("v4chat")
    assert [(m.role, m.content, m.documents) for m in msgs] == [
        ("user", "What is in this picture?", []),
        ("assistant", "A red box.", []),
        ("assistant", "Let me add.", []),
    ]
    assert msgs[0].images == [MessageImage(bytes.fromhex("89504e470d0a1a0a"), "image/png")]
    assert msgs[1].stats == {"ttft_s": 0.25} and msgs[2].tool_calls[0]["result"] == "5"
    added = s.add_message("v4chat", "user", "Summarise these", documents=[REPORT, NOTES])
    assert added.documents == [REPORT, NOTES]
    s.close()

    again = ChatStore(path)  # opened again: no second migration, the documents are there
    assert again.schema_version == 5
    assert again.messages("v4chat")[-1].documents == [REPORT, NOTES]
    again.db.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")
    again.close()
    with pytest.raises(ChatStoreError, match="newer Hearth"):
        ChatStore(path)


def test_documents_keep_their_order_and_go_with_their_message(store):
    chat = store.create_chat("Docs")
    store.add_message(chat.id, "user", "first", documents=[NOTES])
    store.add_message(chat.id, "assistant", "ok")
    store.add_message(chat.id, "user", "", documents=[REPORT, NOTES])
    msgs = store.messages(chat.id)
    assert [m.documents for m in msgs] == [[NOTES], [], [REPORT, NOTES]]
    assert msgs[2].documents[0].page_starts == [0, 11] and msgs[2].documents[0].kind == "pdf"

    def rows() -> int:
        return store.db.execute("SELECT COUNT(*) FROM message_documents").fetchone()[0]

    assert rows() == 3
    store.delete_from(chat.id, 2)
    assert rows() == 1 and [m.documents for m in store.messages(chat.id)] == [[NOTES], []]
    store.delete_chat(chat.id)
    store.purge_deleted()
    assert rows() == 0


def test_exports_carry_the_documents_and_import_brings_them_back(store):
    chat = store.create_chat("With documents")
    store.add_message(chat.id, "user", "What do they say?", documents=[REPORT, NOTES])
    sources = [{"name": "notes.md", "whole": True}, {"name": "report.pdf", "chunks": [2], "of": 3}]
    store.add_message(chat.id, "assistant", "Milk.", stats={"sources": sources})
    data = store.export_json(chat.id)
    assert data["version"] == 4
    assert [d["name"] for d in data["messages"][0]["documents"]] == ["report.pdf", "notes.md"]
    assert "documents" not in data["messages"][1]
    md = store.export_markdown(chat.id)
    assert "[document: report.pdf, 2 KB, 2 pages]" in md and "[document: notes.md, 18 bytes]" in md
    assert "Milk.\n\n*Sources: notes.md (whole document); report.pdf (chunk 2 of 3)*" in md
    assert data["messages"][1]["stats"]["sources"] == sources
    copy = store.import_json(json.loads(json.dumps(data)))
    assert store.messages(copy.id)[0].documents == [REPORT, NOTES]
    with pytest.raises(ChatStoreError, match='document 1: needs "name" and "text"'):
        store.import_json({"messages": [{"role": "user", "content": "x", "documents": [{"name": "a"}]}]})
