"""Syntax colouring for code blocks in rendered Markdown (blocks Qt's importer marks as code fences).

A small rule-based highlighter: keywords of common languages, strings, numbers and line comments.
It is deliberately generic (a chat shows snippets of any language); the fence's language picks the
comment marker and keyword set when it is known.
"""

from __future__ import annotations

import re

from app.qt import QColor, QFont, QSyntaxHighlighter, QTextCharFormat, QTextFormat

_KEYWORDS = {
    "python": "and as assert async await break class continue def del elif else except False finally for "
    "from global if import in is lambda None nonlocal not or pass raise return True try while with "
    "yield self",
    "c": "auto break case char const continue default do double else enum extern float for goto if inline "
    "int long register return short signed sizeof static struct switch typedef union unsigned void volatile "
    "while class namespace template typename public private protected virtual bool true false nullptr "
    "new delete",
    "js": "async await break case catch class const continue debugger default delete do else export extends "
    "false finally for function if import in instanceof let new null return super switch this throw true try "
    "typeof var void while with yield interface type",
    "rust": "as async await break const continue crate else enum extern false fn for if impl in let loop "
    "match mod move mut pub ref return self Self static struct super trait true type unsafe use where while",
    "go": "break case chan const continue default defer else fallthrough for func go goto if import "
    "interface map package range return select struct switch type var nil true false",
    "shell": "if then else elif fi case esac for while until do done in function return export local echo",
    "sql": "select from where insert into values update set delete create table index join left right inner "
    "outer on group by order having limit and or not null as distinct",
}
_ALIASES = {
    "py": "python",
    "python3": "python",
    "cpp": "c",
    "c++": "c",
    "h": "c",
    "java": "c",
    "cs": "c",
    "csharp": "c",
    "javascript": "js",
    "ts": "js",
    "typescript": "js",
    "jsx": "js",
    "tsx": "js",
    "rs": "rust",
    "golang": "go",
    "bash": "shell",
    "sh": "shell",
    "zsh": "shell",
    "console": "shell",
}
_HASH_COMMENT = {"python", "shell"}
_STRING = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|`[^`]*`")
_NUMBER = re.compile(r"\b(?:0x[0-9a-fA-F]+|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\b")
_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def language_of(name: str | None) -> str | None:
    """The rule set for a fence's language tag, or None for plain text."""
    if not name:
        return None
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in _KEYWORDS else None


def _fmt(color: str, bold: bool = False, italic: bool = False) -> QTextCharFormat:
    f = QTextCharFormat()
    f.setForeground(QColor(color))
    if bold:
        f.setFontWeight(QFont.Weight.Bold)
    f.setFontItalic(italic)
    return f


class CodeHighlighter(QSyntaxHighlighter):
    """Colours the code-fence blocks of a QTextDocument (other blocks are left alone)."""

    def __init__(self, document, dark: bool = False):
        super().__init__(document)
        self.set_dark(dark)

    def set_dark(self, dark: bool) -> None:
        """Colours for a dark or a light background."""
        if dark:
            self.f_kw, self.f_str = _fmt("#c792ea", bold=True), _fmt("#c3e88d")
            self.f_num, self.f_com = _fmt("#f78c6c"), _fmt("#7f8c98", italic=True)
        else:
            self.f_kw, self.f_str = _fmt("#7c1fa3", bold=True), _fmt("#22863a")
            self.f_num, self.f_com = _fmt("#b35900"), _fmt("#6a737d", italic=True)
        self.rehighlight()

    def highlightBlock(self, text: str) -> None:  # noqa: N802 - Qt override
        fmt = self.currentBlock().blockFormat()
        if not fmt.hasProperty(QTextFormat.Property.BlockCodeFence) and not fmt.hasProperty(
            QTextFormat.Property.BlockCodeLanguage
        ):
            return
        lang = language_of(fmt.stringProperty(QTextFormat.Property.BlockCodeLanguage))
        keywords = set(_KEYWORDS.get(lang or "", "").split())
        taken = [False] * len(text)

        def paint(start: int, end: int, f: QTextCharFormat) -> None:
            if start < end and not any(taken[start:end]):
                self.setFormat(start, end - start, f)
                for i in range(start, end):
                    taken[i] = True

        for m in _STRING.finditer(text):
            paint(m.start(), m.end(), self.f_str)
        marker = "#" if lang in _HASH_COMMENT else "//" if lang else None
        if marker:
            pos = text.find(marker)
            while pos >= 0 and taken[pos]:
                pos = text.find(marker, pos + 1)
            if pos >= 0:
                paint(pos, len(text), self.f_com)
        for m in _NUMBER.finditer(text):
            paint(m.start(), m.end(), self.f_num)
        if keywords:
            for m in _WORD.finditer(text):
                if m.group(0) in keywords:
                    paint(m.start(), m.end(), self.f_kw)
