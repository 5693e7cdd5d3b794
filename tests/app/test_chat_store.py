"""The chat database: messages, search, undoable delete, migrations, export/import."""

from __future__ import annotations

import json
import sqlite3

import pytest

from app.chat_store import MIGRATIONS, SCHEMA_VERSION, ChatStore, ChatStoreError, MessageImage

# the store keeps whatever bytes it is given (the composer checks they are an image)
PNG = MessageImage(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3, "image/png")
JPEG = MessageImage(b"\xff\xd8\xff\xe0" + b"\x00\xff" * 500, "image/jpeg")


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


def _image_rows(store) -> int:
    return store.db.execute("SELECT COUNT(*) FROM message_images").fetchone()[0]


def test_migrates_a_version_2_database_to_images(tmp_path):
    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    MIGRATIONS[0](db)
    MIGRATIONS[1](db)
    db.execute("INSERT INTO meta VALUES ('schema_version', '2')")
    db.execute("INSERT INTO chats (id, title, created_at, updated_at) VALUES ('c', 'Before images', 1, 1)")
    db.execute(
        "INSERT INTO messages (chat_id, position, role, content, created_at, updated_at, stats) "
        "VALUES ('c', 0, 'user', 'hello', 1, 1, '{}'), "
        "('c', 1, 'assistant', 'hi!', 2, 2, '{\"ttft_s\": 0.5}')"
    )
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "message_images" not in tables
    db.close()
    s = ChatStore(path)
    assert s.schema_version == SCHEMA_VERSION == 5
    tables = {r[0] for r in s.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "message_images" in tables
    msgs = s.messages("c")
    assert [(m.role, m.content, m.stats, m.images) for m in msgs] == [
        ("user", "hello", {}, []),
        ("assistant", "hi!", {"ttft_s": 0.5}, []),
    ]
    assert s.get_chat("c").title == "Before images"
    added = s.add_message("c", "user", "and this?", images=[PNG])
    assert s.messages("c")[-1].images == [PNG] and added.images == [PNG]
    s.close()


def test_images_are_stored_in_order_and_deleted_with_their_messages(store, tmp_path):
    chat = store.create_chat("Pictures")
    first = store.add_message(chat.id, "user", "Compare these.", images=[PNG, JPEG])
    store.add_message(chat.id, "assistant", "The first is a PNG.")
    only_images = store.add_message(chat.id, "user", "", images=[JPEG])
    msgs = store.messages(chat.id)
    assert [m.images for m in msgs] == [[PNG, JPEG], [], [JPEG]]
    assert msgs[0].id == first.id and msgs[2].content == "" and msgs[2].id == only_images.id
    assert isinstance(msgs[0].images[0].data, bytes) and msgs[0].images[1].mime == "image/jpeg"
    assert [c.id for c in store.list_chats("compare")] == [chat.id], "search still reads the text"

    store.delete_from(chat.id, 1)  # regenerate / edit: the later messages' images go with them
    assert [m.images for m in store.messages(chat.id)] == [[PNG, JPEG]]
    assert _image_rows(store) == 2

    other = store.create_chat("Kept")
    store.add_message(other.id, "user", "mine", images=[PNG])
    store.delete_chat(chat.id)
    store.undo_delete(chat.id)  # undo brings the images back with the chat
    assert [m.images for m in store.messages(chat.id)] == [[PNG, JPEG]]
    store.delete_chat(chat.id)
    store.close()
    reopened = ChatStore(tmp_path / "chats.sqlite3")  # the next start purges it, images included
    assert _image_rows(reopened) == 1
    assert [m.images for m in reopened.messages(other.id)] == [[PNG]]
    reopened.close()


def test_export_and_import_keep_images(store):
    chat = store.create_chat("Look")
    store.add_message(chat.id, "user", "What is on these?", images=[PNG, JPEG])
    store.add_message(chat.id, "assistant", "Noise.")
    data = json.loads(json.dumps(store.export_json(chat.id)))
    assert data["version"] == 2
    sent = data["messages"][0]["images"]
    assert [i["mime"] for i in sent] == ["image/png", "image/jpeg"] and isinstance(sent[0]["data"], str)
    assert "images" not in data["messages"][1]
    copy = store.import_json(data)
    assert [(m.content, m.images) for m in store.messages(copy.id)] == [
        ("What is on these?", [PNG, JPEG]),
        ("Noise.", []),
    ]
    md = store.export_markdown(chat.id)
    lines = f"[image: {len(PNG.data):,} bytes, image/png]\n[image: {len(JPEG.data):,} bytes, image/jpeg]"
    assert f"## User\n\n{lines}\n\nWhat is on these?" in md and "base64" not in md

    plain = store.create_chat("Text only")
    store.add_message(plain.id, "user", "hi")
    assert store.export_json(plain.id)["version"] == 1, "older Hearths still import chats without images"


@pytest.mark.parametrize(
    "images, match",
    [
        ("nope", "must be a list"),
        ([{"data": "AAAA"}], "image 1: needs"),
        ([{"mime": "text/plain", "data": "AAAA"}], "image 1: needs"),
        ([{"mime": "image/png", "data": "not base64!"}], "not base64"),
    ],
)
def test_import_rejects_broken_images(store, images, match):
    before = len(store.list_chats())
    with pytest.raises(ChatStoreError, match=match):
        store.import_json({"messages": [{"role": "user", "content": "x", "images": images}]})
    assert len(store.list_chats()) == before


CALLS = [
    {"id": "abc123XYZ", "name": "add", "arguments": {"a": 2, "b": 3}, "decision": "once", "result": "5.0",
     "is_error": False, "done": True},
    {"id": "def456UVW", "name": "rm", "arguments": {"path": "/"}, "decision": "deny",
     "result": "The user declined to run this tool call.", "is_error": True, "done": True},
]


def test_migrates_a_version_3_database_to_tool_calls(tmp_path):
    """A database as Hearth with images (schema 3) wrote it, with an image, opens with tool calls."""
    path = tmp_path / "v3.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    for step in MIGRATIONS[:3]:
        step(db)
    db.execute("INSERT INTO meta VALUES ('schema_version', '3')")
    db.execute("INSERT INTO chats (id, title, created_at, updated_at) VALUES ('c', 'Before tools', 1, 1)")
    db.execute(
        "INSERT INTO messages (chat_id, position, role, content, created_at, updated_at, stats) "
        "VALUES ('c', 0, 'user', 'look', 1, 1, '{}'), ('c', 1, 'assistant', 'a cat', 2, 2, '{}')"
    )
    db.execute("INSERT INTO message_images VALUES (1, 0, 'image/png', ?)", (PNG.data,))
    columns = {r[1] for r in db.execute("PRAGMA table_info(messages)")}
    assert "tool_calls" not in columns
    db.close()
    s = ChatStore(path)
    assert s.schema_version == SCHEMA_VERSION == 5
    msgs = s.messages("c")
    assert [(m.content, m.images, m.tool_calls) for m in msgs] == [("look", [PNG], []), ("a cat", [], [])]
    reply = s.add_message("c", "assistant", "Let me add.")
    s.update_message(reply.id, tool_calls=CALLS)
    s.close()
    assert ChatStore(path).messages("c")[-1].tool_calls == CALLS


def test_tool_calls_survive_export_and_import(store):
    chat = store.create_chat("Tools")
    store.add_message(chat.id, "user", "2+3?")
    m = store.add_message(chat.id, "assistant", "Let me add.")
    store.update_message(m.id, tool_calls=CALLS)
    store.add_message(chat.id, "assistant", "It is 5.")
    data = store.export_json(chat.id)
    assert data["version"] == 3 and data["messages"][1]["tool_calls"] == CALLS
    assert "tool_calls" not in data["messages"][2]
    again = store.import_json(json.loads(json.dumps(data)))
    assert [m.tool_calls for m in store.messages(again.id)] == [[], CALLS, []]
    md = store.export_markdown(chat.id)
    assert "**Tool call: `add`**" in md and '"a": 2' in md and "<details><summary>Result</summary>" in md
    assert "*Declined by the user.*" in md
    with pytest.raises(ChatStoreError, match='"tool_calls" must be a list'):
        store.import_json({"messages": [{"role": "assistant", "content": "x", "tool_calls": [1]}]})
