"""Chats in SQLite: conversations and their messages, written as they happen.

WAL journal, one connection per store (the GUI thread's), a `meta` table holding the schema version and
a list of migrations applied in order, so a database written by an older Hearth opens in a newer one.
The app stores a user message when it is sent and the assistant's reply while it streams (at least
once a second) and when it ends, so a killed app loses at most the last second of a reply.

An assistant message that called tools keeps the calls with it (`tool_calls`: a JSON list of
engine.tool_loop.CallOutcome dicts: id, name, arguments, the user's decision, the result), so a reply of
several rounds is stored as one assistant message per round, each with its calls and their results.

A message's images (the encoded files as attached, with their MIME type, in order) live in their own
table, written in the same transaction as the message and removed with it. So do its documents (schema
5): each one's file name, size, page count and extracted text (engine.documents), not the file, which is
all a later reply, a regeneration or an edit needs (engine.document_context chooses what of them goes in).

Deleting a chat only marks it (so it can be undone); marked chats are purged on the next start.
Qt-free: the window layer calls it; tests use it directly.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.document_context import sources_text
from engine.documents import Document
from engine.reasoning import split_reasoning
from models.errors import HearthError
from models.library import use_wal
from models.paths import data_dir

EXPORT_FORMAT = "hearth-chat"
# 2: messages may carry "images"; 3: "tool_calls"; 4: "documents". Written as the oldest that holds it
EXPORT_VERSION = 4
ROLES = ("system", "user", "assistant")
STATES = ("done", "streaming", "stopped", "error")
_INSERT_MESSAGE = (
    "INSERT INTO messages (chat_id, position, role, content, state, created_at, updated_at, stats) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


class ChatStoreError(HearthError):
    """The chat database or an imported chat file is unusable."""


def _v1(db: sqlite3.Connection) -> None:
    # statement by statement: executescript would commit the migration's transaction half-way
    _run_script(
        db,
        """
        CREATE TABLE chats (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '',
            overrides TEXT NOT NULL DEFAULT '{}',
            model TEXT
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            state TEXT NOT NULL DEFAULT 'done',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE INDEX messages_chat ON messages (chat_id, position);
        """
    )


def _run_script(db: sqlite3.Connection, script: str) -> None:
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _v2(db: sqlite3.Connection) -> None:
    # undoable delete, and the reply's figures (TTFT, tokens/s) kept with it
    db.execute("ALTER TABLE chats ADD COLUMN deleted_at REAL")
    db.execute("ALTER TABLE messages ADD COLUMN stats TEXT NOT NULL DEFAULT '{}'")
    db.execute("CREATE INDEX chats_updated ON chats (updated_at)")


def _v3(db: sqlite3.Connection) -> None:
    # images in messages (vision models): the attached files' bytes, kept as they came
    _run_script(
        db,
        """
        CREATE TABLE message_images (
            message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            idx INTEGER NOT NULL,
            mime TEXT NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (message_id, idx)
        )
        """,
    )


def _v4(db: sqlite3.Connection) -> None:
    # tool use (MCP): an assistant message's tool calls with the user's decisions and the results
    db.execute("ALTER TABLE messages ADD COLUMN tool_calls TEXT NOT NULL DEFAULT '[]'")


def _v5(db: sqlite3.Connection) -> None:
    # documents attached to messages: their names and extracted text (the file itself is not kept)
    _run_script(
        db,
        """
        CREATE TABLE message_documents (
            message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            idx INTEGER NOT NULL,
            name TEXT NOT NULL,
            size INTEGER NOT NULL,
            pages INTEGER,
            kind TEXT NOT NULL DEFAULT 'text',
            page_starts TEXT NOT NULL DEFAULT '[]',
            text TEXT NOT NULL,
            PRIMARY KEY (message_id, idx)
        )
        """,
    )


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_v1, _v2, _v3, _v4, _v5]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass
class MessageImage:
    """An image in a message: the encoded file (PNG, JPEG, WebP, GIF, BMP) and its MIME type."""

    data: bytes
    mime: str

    def __repr__(self) -> str:  # not 20 MB of bytes in a log or a failed assert
        return f"MessageImage({len(self.data)} bytes, {self.mime!r})"


@dataclass
class Message:
    """One message of a chat; `images` come before its text, as they were sent; `documents` (a user
    message's attached files, engine.documents.Document) go before its text in the prompt."""

    id: int
    chat_id: str
    position: int
    role: str
    content: str
    state: str = "done"
    created_at: float = 0.0
    updated_at: float = 0.0
    stats: dict = field(default_factory=dict)
    images: list[MessageImage] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)  # engine.tool_loop.CallOutcome.to_dict() each
    documents: list[Document] = field(default_factory=list)


@dataclass
class Chat:
    """One conversation (without its messages)."""

    id: str
    title: str
    created_at: float
    updated_at: float
    system_prompt: str = ""
    overrides: dict = field(default_factory=dict)
    model: str | None = None


def store_path() -> Path:
    """The chat database (user data dir)."""
    return data_dir() / "chats.sqlite3"


class ChatStore:
    """The chat database. Use from one thread (the GUI's).

    Args:
        path: the SQLite file (default store_path()).

    Raises:
        ChatStoreError: the file is not a database, or was written by a newer Hearth.
    """

    def __init__(self, path: Path | None = None):
        self.path = path or store_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            use_wal(self.db)
            self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a killed process loses nothing
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            self.purge_deleted()
        except sqlite3.DatabaseError as e:
            raise ChatStoreError(
                f"{self.path}: cannot open the chat database ({e}); move the file away to start afresh"
            ) from None

    def _migrate(self) -> None:
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise ChatStoreError(
                f"{self.path} was written by a newer Hearth (schema {version}, this one reads up to "
                f"{SCHEMA_VERSION}); update Hearth"
            )
        for step in range(version, SCHEMA_VERSION):
            with self._tx():
                MIGRATIONS[step](self.db)
                self.db.execute(
                    "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (str(step + 1),),
                )

    def _tx(self):
        store = self

        class _Tx:
            def __enter__(self):
                store.db.execute("BEGIN IMMEDIATE")

            def __exit__(self, exc_type, *_):
                store.db.execute("ROLLBACK" if exc_type else "COMMIT")

        return _Tx()

    @property
    def schema_version(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        """Close the database (a checkpoint folds the WAL into the file)."""
        with contextlib.suppress(sqlite3.Error):
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.db.close()

    # ---- chats
    @staticmethod
    def _chat(row: sqlite3.Row) -> Chat:
        return Chat(
            id=row["id"],
            title=row["title"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            system_prompt=row["system_prompt"],
            overrides=json.loads(row["overrides"] or "{}"),
            model=row["model"],
        )

    def create_chat(
        self,
        title: str = "New chat",
        system_prompt: str = "",
        overrides: dict | None = None,
        model: str | None = None,
        chat_id: str | None = None,
        created_at: float | None = None,
    ) -> Chat:
        """A new, empty chat."""
        now = time.time()
        created = created_at or now
        chat = Chat(
            chat_id or uuid.uuid4().hex, title, created, now, system_prompt, dict(overrides or {}), model
        )
        self.db.execute(
            "INSERT INTO chats (id, title, created_at, updated_at, system_prompt, overrides, model) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (chat.id, title, created, now, system_prompt, json.dumps(chat.overrides), model),
        )
        return chat

    def get_chat(self, chat_id: str) -> Chat:
        """One chat (deleted ones included until purged). Raises ChatStoreError when unknown."""
        row = self.db.execute("SELECT * FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise ChatStoreError(f"no chat {chat_id!r}")
        return self._chat(row)

    def list_chats(self, query: str = "") -> list[Chat]:
        """Chats not deleted, most recently updated first; with a query, those whose title or any
        message contains it (case-insensitive)."""
        if not query:
            rows = self.db.execute(
                "SELECT * FROM chats WHERE deleted_at IS NULL ORDER BY updated_at DESC"
            ).fetchall()
        else:
            like = "%" + query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self.db.execute(
                "SELECT * FROM chats c WHERE deleted_at IS NULL AND (title LIKE ? ESCAPE '\\' OR EXISTS "
                "(SELECT 1 FROM messages m WHERE m.chat_id = c.id AND m.content LIKE ? ESCAPE '\\')) "
                "ORDER BY updated_at DESC",
                (like, like),
            ).fetchall()
        return [self._chat(r) for r in rows]

    def update_chat(self, chat_id: str, **values: Any) -> None:
        """Change title, system_prompt, overrides (dict) or model."""
        allowed = {"title", "system_prompt", "overrides", "model"}
        if not values or set(values) - allowed:
            raise ValueError(f"can update only {sorted(allowed)}")
        if "overrides" in values:
            values["overrides"] = json.dumps(values["overrides"] or {})
        sets = ", ".join(f"{k} = ?" for k in values)
        self.db.execute(
            f"UPDATE chats SET {sets}, updated_at = ? WHERE id = ?", (*values.values(), time.time(), chat_id)
        )

    def delete_chat(self, chat_id: str) -> None:
        """Mark a chat deleted (undo_delete brings it back until the next start purges it)."""
        self.db.execute("UPDATE chats SET deleted_at = ? WHERE id = ?", (time.time(), chat_id))

    def undo_delete(self, chat_id: str) -> None:
        self.db.execute("UPDATE chats SET deleted_at = NULL WHERE id = ?", (chat_id,))

    def purge_deleted(self) -> int:
        """Remove chats marked deleted, with their messages and images. Returns how many."""
        with self._tx():
            ids = [r[0] for r in self.db.execute("SELECT id FROM chats WHERE deleted_at IS NOT NULL")]
            for chat_id in ids:
                self._delete_images(chat_id, 0)
                self._delete_documents(chat_id, 0)
                self.db.execute("DELETE FROM messages WHERE chat_id = ?", (chat_id,))
                self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))
        return len(ids)

    # ---- messages
    @staticmethod
    def _message(row: sqlite3.Row) -> Message:
        return Message(
            id=row["id"],
            chat_id=row["chat_id"],
            position=row["position"],
            role=row["role"],
            content=row["content"],
            state=row["state"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            stats=json.loads(row["stats"] or "{}"),
            tool_calls=json.loads(row["tool_calls"] or "[]"),
        )

    def messages(self, chat_id: str) -> list[Message]:
        """A chat's messages in order, with their images."""
        rows = self.db.execute(
            "SELECT * FROM messages WHERE chat_id = ? ORDER BY position", (chat_id,)
        ).fetchall()
        out = [self._message(r) for r in rows]
        by_id = {m.id: m for m in out}
        for r in self.db.execute(
            "SELECT i.message_id, i.mime, i.data FROM message_images i "
            "JOIN messages m ON m.id = i.message_id WHERE m.chat_id = ? ORDER BY i.message_id, i.idx",
            (chat_id,),
        ):
            by_id[r[0]].images.append(MessageImage(bytes(r[2]), r[1]))
        for r in self.db.execute(
            "SELECT d.* FROM message_documents d JOIN messages m ON m.id = d.message_id "
            "WHERE m.chat_id = ? ORDER BY d.message_id, d.idx",
            (chat_id,),
        ):
            by_id[r["message_id"]].documents.append(
                Document(r["name"], r["text"], r["size"], r["pages"], r["kind"],
                         page_starts=json.loads(r["page_starts"] or "[]"))
            )
        return out

    def add_message(
        self,
        chat_id: str,
        role: str,
        content: str,
        state: str = "done",
        stats: dict | None = None,
        created_at: float | None = None,
        images: list[MessageImage] | None = None,
        documents: list[Document] | None = None,
    ) -> Message:
        """Append a message, its images and documents, in order (committed before this returns)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}")
        now = time.time()
        created = created_at or now
        images = list(images or [])
        documents = list(documents or [])
        with self._tx():
            row = self.db.execute(
                "SELECT COALESCE(MAX(position), -1) + 1 FROM messages WHERE chat_id = ?", (chat_id,)
            ).fetchone()
            cur = self.db.execute(
                _INSERT_MESSAGE,
                (chat_id, row[0], role, content, state, created, now, json.dumps(stats or {})),
            )
            self._insert_images(cur.lastrowid, images)
            self._insert_documents(cur.lastrowid, documents)
            self.db.execute("UPDATE chats SET updated_at = ? WHERE id = ?", (now, chat_id))
        return Message(
            cur.lastrowid, chat_id, row[0], role, content, state, created, now, dict(stats or {}), images,
            documents=documents,
        )

    def _insert_documents(self, message_id: int, documents: list[Document]) -> None:
        self.db.executemany(
            "INSERT INTO message_documents (message_id, idx, name, size, pages, kind, page_starts, text) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (message_id, i, d.name, d.size, d.pages, d.kind, json.dumps(d.page_starts), d.text)
                for i, d in enumerate(documents)
            ],
        )

    def _delete_documents(self, chat_id: str, position: int) -> None:
        self.db.execute(
            "DELETE FROM message_documents WHERE message_id IN "
            "(SELECT id FROM messages WHERE chat_id = ? AND position >= ?)",
            (chat_id, position),
        )

    def _insert_images(self, message_id: int, images: list[MessageImage]) -> None:
        self.db.executemany(
            "INSERT INTO message_images (message_id, idx, mime, data) VALUES (?, ?, ?, ?)",
            [(message_id, i, im.mime, sqlite3.Binary(im.data)) for i, im in enumerate(images)],
        )

    def _delete_images(self, chat_id: str, position: int) -> None:
        # explicit rather than left to ON DELETE CASCADE: that needs foreign_keys on in every connection
        self.db.execute(
            "DELETE FROM message_images WHERE message_id IN "
            "(SELECT id FROM messages WHERE chat_id = ? AND position >= ?)",
            (chat_id, position),
        )

    def update_message(
        self,
        message_id: int,
        content: str | None = None,
        state: str | None = None,
        stats: dict | None = None,
        tool_calls: list[dict] | None = None,
    ) -> None:
        """Replace a message's text, state, figures and/or tool calls (committed before this returns)."""
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}")
        sets, args = ["updated_at = ?"], [time.time()]
        for col, value in (("content", content), ("state", state)):
            if value is not None:
                sets.append(f"{col} = ?")
                args.append(value)
        if stats is not None:
            sets.append("stats = ?")
            args.append(json.dumps(stats))
        if tool_calls is not None:
            sets.append("tool_calls = ?")
            args.append(json.dumps(tool_calls))
        self.db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, message_id))

    def delete_from(self, chat_id: str, position: int) -> None:
        """Remove the messages at `position` and after, with their images (edit-and-resend, regenerate)."""
        with self._tx():
            self._delete_images(chat_id, position)
            self._delete_documents(chat_id, position)
            self.db.execute("DELETE FROM messages WHERE chat_id = ? AND position >= ?", (chat_id, position))

    # ---- export / import
    def export_json(self, chat_id: str) -> dict:
        """A chat as a JSON-able dict (EXPORT_FORMAT). A message's images are {"mime", "data": base64}
        under "images"; a chat without images is written as version 1, which older Hearths import."""
        chat = self.get_chat(chat_id)
        messages = []
        for m in self.messages(chat_id):
            out = {
                "role": m.role,
                "content": m.content,
                "created_at": m.created_at,
                "state": m.state,
                "stats": m.stats,
            }
            if m.images:
                out["images"] = [
                    {"mime": im.mime, "data": base64.b64encode(im.data).decode("ascii")} for im in m.images
                ]
            if m.tool_calls:
                out["tool_calls"] = m.tool_calls
            if m.documents:
                out["documents"] = [
                    {"name": d.name, "size": d.size, "pages": d.pages, "kind": d.kind,
                     "page_starts": d.page_starts, "text": d.text}
                    for d in m.documents
                ]
            messages.append(out)
        version = 1
        if any("images" in m for m in messages):
            version = 2
        if any("tool_calls" in m for m in messages):
            version = 3
        if any("documents" in m for m in messages):
            version = 4
        return {
            "format": EXPORT_FORMAT,
            "version": version,
            "title": chat.title,
            "created_at": chat.created_at,
            "system_prompt": chat.system_prompt,
            "overrides": chat.overrides,
            "model": chat.model,
            "messages": messages,
        }

    def export_markdown(self, chat_id: str) -> str:
        """A chat as Markdown: a title, the system prompt, then one section per message."""
        chat = self.get_chat(chat_id)
        out = [f"# {chat.title}", ""]
        if chat.model:
            out += [f"*Model: {chat.model}*", ""]
        if chat.system_prompt:
            out += ["## System", "", chat.system_prompt, ""]
        for m in self.messages(chat_id):
            out += [f"## {m.role.capitalize()}", ""]
            # the bytes stay out of the Markdown (the JSON export keeps them)
            out += [f"[image: {len(im.data):,} bytes, {im.mime}]" for im in m.images]
            out += [f"[document: {describe_document(d)}]" for d in m.documents]
            if m.images or m.documents:
                out.append("")
            split = split_reasoning(m.content) if m.role == "assistant" else None
            if split is not None and split.thinking is not None:
                # a reasoning model's thinking folds away, as in the app (GitHub and most viewers)
                out += ["<details><summary>Thoughts</summary>", "", split.thinking, "", "</details>", ""]
                out += [split.answer, ""]
            else:
                out += [m.content, ""]
            if m.stats.get("sources"):
                out += [f"*Sources: {sources_text(m.stats['sources'])}*", ""]
            out += _markdown_tool_calls(m.tool_calls)
        return "\n".join(out).rstrip() + "\n"

    def import_json(self, data: Any) -> Chat:
        """A new chat from export_json's output (or a bare {"messages": [{"role", "content"}]}).

        Raises:
            ChatStoreError: not a chat export, or a malformed message.
        """
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
            raise ChatStoreError('not a Hearth chat export: expected an object with a "messages" list')
        if data.get("format", EXPORT_FORMAT) != EXPORT_FORMAT:
            raise ChatStoreError(f"not a Hearth chat export (format {data.get('format')!r})")
        if int(data.get("version", EXPORT_VERSION)) > EXPORT_VERSION:
            raise ChatStoreError("this chat was exported by a newer Hearth; update Hearth to import it")
        messages, images, documents = [], [], []
        system = data.get("system_prompt") or ""
        for i, m in enumerate(data["messages"]):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ChatStoreError(f"message {i + 1}: needs a role ({', '.join(ROLES)}) and a text content")
            if m["role"] == "system" and not system:
                system = m["content"]
                continue
            calls = m.get("tool_calls", [])
            if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
            ):
                raise ChatStoreError(f'message {i + 1}: "tool_calls" must be a list of {{"name": ...}}')
            messages.append(m)
            images.append(_imported_images(i, m.get("images")))
            documents.append(_imported_documents(i, m.get("documents")))
        overrides = data.get("overrides") if isinstance(data.get("overrides"), dict) else {}
        title = str(data.get("title") or "Imported chat")
        with self._tx():
            chat = self.create_chat(title, str(system), overrides, data.get("model"))
            now = time.time()
            for pos, (m, ims, docs) in enumerate(zip(messages, images, documents, strict=True)):
                state = m.get("state") if m.get("state") in STATES else "done"
                state = "stopped" if state == "streaming" else state
                cur = self.db.execute(
                    _INSERT_MESSAGE,
                    (
                        chat.id,
                        pos,
                        m["role"],
                        m["content"],
                        state,
                        float(m.get("created_at") or now),
                        now,
                        json.dumps(m.get("stats") if isinstance(m.get("stats"), dict) else {}),
                    ),
                )
                if m.get("tool_calls"):
                    calls = json.dumps(m["tool_calls"])
                    self.db.execute("UPDATE messages SET tool_calls = ? WHERE id = ?", (calls, cur.lastrowid))
                self._insert_images(cur.lastrowid, ims)
                self._insert_documents(cur.lastrowid, docs)
        return chat


def _markdown_tool_calls(calls: list[dict]) -> list[str]:
    """Markdown lines for a message's tool calls: name and arguments, the decision, the result folded."""
    out = []
    for c in calls:
        args = json.dumps(c.get("arguments") or {}, indent=2, ensure_ascii=False)
        out += [f"**Tool call: `{c.get('name')}`**", "", "```json", args, "```", ""]
        decision = c.get("decision") or "not decided"
        if decision == "deny":
            out += ["*Declined by the user.*", ""]
            continue
        if not c.get("done"):
            out += [f"*Stopped before it ran ({decision}).*", ""]
            continue
        label = "Error" if c.get("is_error") else "Result"
        result = str(c.get("result", ""))
        out += [f"<details><summary>{label}</summary>", "", "```", result, "```", "", "</details>", ""]
    return out


def _imported_images(i: int, items: Any) -> list[MessageImage]:
    """The images of message `i` of an import ({"mime": "image/...", "data": base64} each)."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise ChatStoreError(f'message {i + 1}: "images" must be a list')
    out = []
    for j, item in enumerate(items):
        ok = isinstance(item, dict) and isinstance(item.get("data"), str)
        mime = item.get("mime") if ok else None
        if not isinstance(mime, str) or not mime.startswith("image/"):
            raise ChatStoreError(
                f'message {i + 1}, image {j + 1}: needs "mime" (image/...) and base64 "data"'
            )
        try:
            out.append(MessageImage(base64.b64decode(item["data"], validate=True), mime))
        except (binascii.Error, ValueError):
            raise ChatStoreError(f"message {i + 1}, image {j + 1}: its data is not base64") from None
    return out


def describe_document(doc: Document) -> str:
    """A document's name with its size and pages: "report.pdf, 120 KB, 3 pages"."""
    size = f"{doc.size / 1024:,.0f} KB" if doc.size >= 1024 else f"{doc.size} bytes"
    pages = f", {doc.pages} page{'s' if doc.pages != 1 else ''}" if doc.pages else ""
    return f"{doc.name}, {size}{pages}"


def _imported_documents(i: int, items: Any) -> list[Document]:
    """The documents of message `i` of an import ({"name", "text", "size", "pages"} each)."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise ChatStoreError(f'message {i + 1}: "documents" must be a list')
    out = []
    for j, item in enumerate(items):
        ok = isinstance(item, dict) and isinstance(item.get("name"), str)
        if not (ok and isinstance(item.get("text"), str)):
            raise ChatStoreError(f'message {i + 1}, document {j + 1}: needs "name" and "text"')
        pages = item.get("pages")
        starts = item.get("page_starts")
        out.append(Document(
            item["name"], item["text"], int(item.get("size") or len(item["text"].encode())),
            pages if isinstance(pages, int) else None, str(item.get("kind") or "text"),
            page_starts=[int(x) for x in starts] if isinstance(starts, list) else [],
        ))
    return out
