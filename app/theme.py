"""Light / dark / system theme and font size, applied to the whole application."""

from __future__ import annotations

from app.qt import QApplication, QColor, QPalette, QStyleFactory, Qt

_DARK = {
    QPalette.ColorRole.Window: "#202124",
    QPalette.ColorRole.WindowText: "#e8eaed",
    QPalette.ColorRole.Base: "#17181a",
    QPalette.ColorRole.AlternateBase: "#26272b",
    QPalette.ColorRole.Text: "#e8eaed",
    QPalette.ColorRole.Button: "#2b2c30",
    QPalette.ColorRole.ButtonText: "#e8eaed",
    QPalette.ColorRole.Highlight: "#8ab4f8",
    QPalette.ColorRole.HighlightedText: "#202124",
    QPalette.ColorRole.ToolTipBase: "#2b2c30",
    QPalette.ColorRole.ToolTipText: "#e8eaed",
    QPalette.ColorRole.Link: "#8ab4f8",
    QPalette.ColorRole.PlaceholderText: "#9aa0a6",
}


def system_is_dark(app: QApplication) -> bool:
    """Whether the platform asks for a dark colour scheme."""
    hints = app.styleHints()
    scheme = getattr(hints, "colorScheme", None)
    if scheme is not None:
        return scheme() == Qt.ColorScheme.Dark
    return app.palette().color(QPalette.ColorRole.Window).lightness() < 128


def apply_theme(app: QApplication, theme: str, font_size: int, base_font=None) -> bool:
    """Apply "system", "light" or "dark" and a font size in points (0: the system's). Returns dark or not."""
    if not hasattr(app, "_hearth_system_palette"):
        app._hearth_system_palette = QPalette(app.palette())
        app._hearth_system_font = app.font()
    dark = system_is_dark(app) if theme == "system" else theme == "dark"
    if theme == "system":
        app.setPalette(app._hearth_system_palette)
    else:
        if "Fusion" in QStyleFactory.keys():  # noqa: SIM118 - a Qt list, not a dict
            app.setStyle("Fusion")
        palette = QPalette(app._hearth_system_palette) if theme == "light" else QPalette()
        if theme == "light":
            palette = app.style().standardPalette()
        else:
            for role, color in _DARK.items():
                palette.setColor(role, QColor(color))
        app.setPalette(palette)
    font = base_font or app._hearth_system_font
    font = type(font)(font)
    if font_size > 0:
        font.setPointSize(font_size)
    app.setFont(font)
    return dark
