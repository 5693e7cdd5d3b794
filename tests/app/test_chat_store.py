"""The chat database: messages, search, undoable delete, migrations, export/import."""

from __future__ import annotations

import json
import sqlite3

import pytest

from app.chat_store import MIGRATIONS, SCHEMA_VERSION, ChatStore, ChatStoreError


@pytest.fixture
def store(tmp_path):
    s = ChatStore(tmp_path / "chats.sqlite3")
    yield s
    s.close()


def test_messages_in_order_and_updates(store):
    chat = store.create_chat("Cooking")
    a = store.add_message(chat.id, "user", "How long do eggs boil?")
    b = store.add_message(chat.id, "assistant", "", state="streaming")
    store.update_message(b.id, content="About seven", state=None)
    store.update_message(b.id, content="About seven minutes.", state="done", stats={"ttft_s": 0.1})
    msgs = store.messages(chat.id)
    assert [(m.position, m.role, m.content, m.state) for m in msgs] == [
        (0, "user", "How long do eggs boil?", "done"),
        (1, "assistant", "About seven minutes.", "done"),
    ]
    assert msgs[1].stats == {"ttft_s": 0.1} and msgs[0].id == a.id
    store.delete_from(chat.id, 1)
    assert [m.role for m in store.messages(chat.id)] == ["user"]
    with pytest.raises(ValueError):
        store.add_message(chat.id, "robot", "x")


def test_search_titles_and_messages_and_undo_delete(store, tmp_path):
    c1 = store.create_chat("Holiday plans")
    c2 = store.create_chat("Work")
    store.add_message(c2.id, "user", "the 100% quarterly report")
    assert [c.id for c in store.list_chats("holiday")] == [c1.id]
    assert [c.id for c in store.list_chats("100%")] == [c2.id]
    assert store.list_chats("50%") == []
    store.delete_chat(c1.id)
    assert [c.id for c in store.list_chats()] == [c2.id]
    store.undo_delete(c1.id)
    assert {c.id for c in store.list_chats()} == {c1.id, c2.id}
    store.delete_chat(c2.id)
    store.close()
    reopened = ChatStore(tmp_path / "chats.sqlite3")  # a new start purges deleted chats
    assert [c.id for c in reopened.list_chats()] == [c1.id]
    with pytest.raises(ChatStoreError):
        reopened.get_chat(c2.id)
    reopened.close()


def test_migrates_an_old_database_and_refuses_a_newer_one(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    MIGRATIONS[0](db)
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.execute("INSERT INTO chats (id, title, created_at, updated_at) VALUES ('c', 'Old', 1, 1)")
    db.execute(
        "INSERT INTO messages (chat_id, position, role, content, created_at, updated_at) "
        "VALUES ('c', 0, 'user', 'hello', 1, 1)"
    )
    db.close()
    s = ChatStore(path)
    assert s.schema_version == SCHEMA_VERSION
    assert [m.content for m in s.messages("c")] == ["hello"] and s.messages("c")[0].stats == {}
    s.db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    s.close()
    with pytest.raises(ChatStoreError, match="newer Hearth"):
        ChatStore(path)
    (tmp_path / "junk.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(ChatStoreError, match="move the file away"):
        ChatStore(tmp_path / "junk.sqlite3")


def test_export_markdown_json_and_import(store):
    chat = store.create_chat("Math", system_prompt="Be exact.", overrides={"temperature": 0.0})
    store.add_message(chat.id, "user", "2+2?")
    store.add_message(chat.id, "assistant", "```\n4\n```", stats={"ttft_s": 0.2})
    md = store.export_markdown(chat.id)
    assert (
        md.startswith("# Math\n") and "## System\n\nBe exact." in md and "## Assistant\n\n```\n4\n```" in md
    )
    data = json.loads(json.dumps(store.export_json(chat.id)))
    copy = store.import_json(data)
    assert copy.id != chat.id and copy.title == "Math" and copy.system_prompt == "Be exact."
    assert copy.overrides == {"temperature": 0.0}
    assert [(m.role, m.content) for m in store.messages(copy.id)] == [
        ("user", "2+2?"),
        ("assistant", "```\n4\n```"),
    ]
    thought = store.add_message(chat.id, "assistant", "<think>\nAdd them.\n</think>\n\n4")
    md = store.export_markdown(chat.id)
    assert "## Assistant\n\n<details><summary>Thoughts</summary>\n\nAdd them.\n\n</details>\n\n4\n" in md
    assert store.export_json(chat.id)["messages"][-1]["content"] == thought.content  # raw, for import
    bare = store.import_json(
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}
    )
    assert bare.system_prompt == "S" and [m.role for m in store.messages(bare.id)] == ["user"]


@pytest.mark.parametrize(
    "data, match",
    [
        ([], "expected an object"),
        ({"format": "other", "messages": []}, "format"),
        ({"version": 99, "messages": []}, "newer Hearth"),
        ({"messages": [{"role": "user"}]}, "message 1"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "message 1"),
    ],
)
def test_import_rejects_what_is_not_a_chat(store, data, match):
    before = len(store.list_chats())
    with pytest.raises(ChatStoreError, match=match):
        store.import_json(data)
    assert len(store.list_chats()) == before
