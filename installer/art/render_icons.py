"""Render hearth.svg to the PNG sizes the Linux package installs, and hearth.ico for Windows.

Build-time tool (run with the build venv, which has PySide6): `build/venv/bin/python
installer/art/render_icons.py`. The PNGs are committed, so a build does not need to run this.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
HERE = Path(__file__).resolve().parent


def main() -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    app = QGuiApplication(sys.argv)  # noqa: F841 - QPainter on images needs a GUI application
    renderer = QSvgRenderer(str(HERE / "hearth.svg"))
    if not renderer.isValid():
        print("hearth.svg is not a valid SVG", file=sys.stderr)
        return 1
    out = HERE / "png"
    out.mkdir(exist_ok=True)
    for size in SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter)
        painter.end()
        if not image.save(str(out / f"hearth-{size}.png")):
            print(f"could not write hearth-{size}.png", file=sys.stderr)
            return 1
        if size == 256 and not image.save(str(HERE / "hearth.ico"), "ICO"):
            print("could not write hearth.ico (Qt's ico image plugin missing?)", file=sys.stderr)
            return 1
    print(f"wrote {len(SIZES)} PNGs to {out} and hearth.ico")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
