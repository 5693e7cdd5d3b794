"""`hearth-app`: start the desktop app.

Options for scripts and tests (the app is normally started without any):
    --model SPEC        load this model instead of the settings' default ("" loads none)
    --send TEXT         send TEXT as soon as the model is loaded
    --quit-after-reply  quit when that reply ends
    --print-stream      print one JSON line per streamed chunk to stdout ({"t": seconds since launch,
                        "text": the reply so far}), for latency and durability checks
    --smoke SECONDS     print {"shown_at_s": seconds since the process started} once the window is on
                        screen, then close it after SECONDS (the installer test's GUI check)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

T0 = time.perf_counter()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hearth-app", description="Hearth desktop app")
    p.add_argument("--model", default=None, help="model to load (path or starter name)")
    p.add_argument("--send", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quit-after-reply", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--print-stream", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--smoke", type=float, default=None, metavar="SECONDS", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from app.qt import QApplication, QIcon

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Hearth")
    app.setOrganizationName("Hearth")
    app.setDesktopFileName("hearth")
    from app.chat_store import ChatStore
    from app.main_window import MainWindow
    from app.settings import Settings
    from app.theme import apply_theme
    from models.errors import HearthError

    settings = Settings()
    dark = apply_theme(app, settings.get("theme"), settings.get("font_size"))
    icon = _icon()
    if icon:
        app.setWindowIcon(QIcon(icon))
    try:
        store = ChatStore()
    except HearthError as e:
        print(f"hearth-app: {e}", file=sys.stderr)
        return 1
    window = MainWindow(settings, store, model=args.model, dark=dark)
    if args.send is not None:
        _script(window, args)
    window.show()
    if args.smoke is not None:
        _smoke(window, args.smoke)
    settings.subscribe(lambda key, value: _on_setting(app, window, settings, key))
    code = app.exec()
    store.close()
    return code


def _on_setting(app, window, settings, key: str) -> None:
    from app.theme import apply_theme

    if key in ("theme", "font_size"):
        window.view.dark = apply_theme(app, settings.get("theme"), settings.get("font_size"))


def _icon() -> str | None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "resources" / "icons" / "hearth.svg"
    return str(path) if path.is_file() else None


def _smoke(window, seconds: float) -> None:
    """--smoke: report when the event loop first runs with the window shown, close it `seconds` later."""
    from app.qt import QTimer

    def shown() -> None:
        try:
            import psutil

            started = psutil.Process().create_time()
        except Exception:  # noqa: BLE001 - fall back to the time this module was imported
            started = time.time() - (time.perf_counter() - T0)
        print(json.dumps({"shown_at_s": round(time.time() - started, 3)}), flush=True)
        QTimer.singleShot(int(seconds * 1000), window.close)

    QTimer.singleShot(0, shown)


def _script(window, args) -> None:
    """--send / --quit-after-reply / --print-stream."""
    c = window.controller
    sent = []

    def on_loaded(_info) -> None:
        if not sent:
            sent.append(True)
            c.send(args.send)

    def on_text(_id: int, text: str) -> None:
        if args.print_stream:
            print(json.dumps({"t": time.perf_counter() - T0, "text": text}), flush=True)

    def on_done(message) -> None:
        if args.print_stream:
            print(json.dumps({"t": time.perf_counter() - T0, "done": message.state}), flush=True)
        if args.quit_after_reply:
            window.close()

    window.bridge.loaded.connect(on_loaded)
    c.messageText.connect(on_text)
    c.messageDone.connect(on_done)


if __name__ == "__main__":
    sys.exit(main())
