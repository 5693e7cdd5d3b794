"""Write tests/fixtures/chats-v4.sqlite3: a chat database as Hearth's schema-4 chat store wrote it (before
documents), for the v4 -> v5 migration test (tests/app/test_documents_store.py).

The store's code is taken from the last commit with schema 4, so the file is what a real install holds:
    .venv/bin/python scripts/chats_v4_fixture.py
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

V4_COMMIT = "d2d29d1"  # app/chat_store.py at SCHEMA_VERSION 4
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "chats-v4.sqlite3"


def main() -> None:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{V4_COMMIT}:app/chat_store.py"], check=True, capture_output=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat_store_v4.py"
        path.write_bytes(source)
        sys.path.insert(0, str(ROOT))
        spec = importlib.util.spec_from_file_location("chat_store_v4", path)
        cs = importlib.util.module_from_spec(spec)
        sys.modules["chat_store_v4"] = cs  # dataclasses look their module up
        spec.loader.exec_module(cs)
    assert cs.SCHEMA_VERSION == 4
    OUT.unlink(missing_ok=True)
    s = cs.ChatStore(OUT)
    c = s.create_chat("A chat from Hearth 0.1 (schema 4)", system_prompt="Be brief.", chat_id="v4chat",
                      created_at=1700000000.0)
    png = cs.MessageImage(bytes.fromhex("89504e470d0a1a0a"), "image/png")
    s.add_message(c.id, "user", "What is in this picture?", created_at=1700000001.0, images=[png])
    s.add_message(c.id, "assistant", "A red box.", stats={"ttft_s": 0.25}, created_at=1700000002.0)
    m = s.add_message(c.id, "assistant", "Let me add.", created_at=1700000003.0)
    s.update_message(m.id, tool_calls=[{"id": "call_1", "name": "add", "arguments": {"a": 2, "b": 3},
                                        "decision": "allow_once", "result": "5", "is_error": False,
                                        "done": True}])
    s.db.execute("VACUUM")
    s.close()
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
