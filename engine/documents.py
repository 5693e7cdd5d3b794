"""Documents attached to a chat message: their text, read out of the file.

Reads PDF (pypdf: the text layer, page by page), Word .docx (the zip's word/document.xml: paragraphs and
tables in order), HTML (scripts and styles dropped, block elements on their own lines) and text-like files
(plain text, Markdown, CSV, JSON, XML, YAML, logs, source code). Text is decoded by its BOM (UTF-8,
UTF-16, UTF-32), else as UTF-8, else as Windows-1252 with a notice; a file with NUL bytes and no UTF-16
BOM is binary and refused.

What a user can get wrong becomes a DocumentError subclass whose message names the file and says what to
do: an encrypted PDF, a scan without a text layer (no OCR here), an unsupported or binary file, a file
over MAX_FILE_BYTES or with more than MAX_TEXT_CHARS of text, a corrupt one.

Choosing what of the documents goes into the prompt (chunks, BM25, the prompt block) is
engine.document_context. No Qt here: the composer calls read_document in its worker thread, the terminal
chat (`hearth chat --doc`) directly.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

from models.errors import HearthError

MAX_FILE_BYTES = 50 * 1024 * 1024
MAX_TEXT_CHARS = 2_000_000  # about half a million tokens: more than any context holds
SNIFF_BYTES = 8192

PDF_SUFFIXES = {".pdf"}
DOCX_SUFFIXES = {".docx"}
HTML_SUFFIXES = {".html", ".htm", ".xhtml"}
TEXT_SUFFIXES = {
    ".txt", ".text", ".md", ".markdown", ".rst", ".csv", ".tsv", ".json", ".jsonl", ".xml", ".yaml",
    ".yml", ".toml", ".ini", ".cfg", ".conf", ".log", ".tex", ".srt", ".vtt",
    # source code
    ".py", ".pyi", ".js", ".mjs", ".ts", ".tsx", ".jsx", ".c", ".h", ".cc", ".cpp", ".hpp", ".cxx",
    ".cs", ".java", ".kt", ".go", ".rs", ".rb", ".php", ".swift", ".m", ".scala", ".lua", ".pl", ".r",
    ".jl", ".sh", ".bash", ".zsh", ".ps1", ".bat", ".sql", ".css", ".scss", ".vue", ".svelte", ".dart",
    ".hs", ".ml", ".ex", ".exs", ".erl", ".clj", ".zig", ".nim", ".f90", ".cmake", ".gradle", ".proto",
}
DOCUMENT_SUFFIXES = PDF_SUFFIXES | DOCX_SUFFIXES | HTML_SUFFIXES | TEXT_SUFFIXES
READABLE = "PDF, Word (.docx), HTML or a text file (.txt, .md, .csv, .json, source code…)"
# formats people try that we do not read, with what to do instead
_CONVERT_HINTS = {
    ".doc": "save it as .docx or PDF in your word processor",
    ".odt": "save it as .docx or PDF",
    ".rtf": "save it as .docx, PDF or plain text",
    ".pptx": "export it as PDF",
    ".ppt": "export it as PDF",
    ".xlsx": "export the sheet as CSV",
    ".xls": "export the sheet as CSV",
    ".ods": "export the sheet as CSV",
    ".epub": "convert it to PDF or text",
}


class DocumentError(HearthError):
    """A file cannot be attached as a document (the message names it and says what to do)."""


class DocumentReadStopped(DocumentError):
    """The reading was stopped by its caller (the window closed, the attachment was removed)."""


class UnsupportedDocumentError(DocumentError):
    """Not a kind of file Hearth reads text from (or a binary file)."""


class DocumentTooLargeError(DocumentError):
    """The file, or the text in it, is over the limits."""


class EncryptedDocumentError(DocumentError):
    """A password-protected PDF."""


class NoTextLayerError(DocumentError):
    """A PDF without text (a scan): reading its pictures would need OCR, which Hearth does not do."""


class UnreadableDocumentError(DocumentError):
    """The file cannot be read, or is corrupt."""


@dataclass
class Document:
    """A document's text and what the composer shows of it.

    Attributes:
        name: the file's name (no folder).
        text: the extracted text.
        size: the file's size in bytes.
        pages: a PDF's page count (a .docx's, when the file records it); None for other kinds.
        kind: "pdf", "docx", "html" or "text".
        notice: something the user should know although it was read (a guessed encoding); "" if none.
        page_starts: a PDF's character offset in `text` where each page begins (for chunk labels).
    """

    name: str
    text: str
    size: int
    pages: int | None = None
    kind: str = "text"
    notice: str = ""
    page_starts: list[int] = field(default_factory=list)

    def __repr__(self) -> str:  # not megabytes of text in a failed assert
        return f"Document({self.name!r}, {len(self.text)} chars, {self.size} bytes, pages={self.pages})"


def read_document(path: str | Path, stopped: Callable[[], bool] | None = None) -> Document:
    """Read a file's text. `stopped`: asked between a PDF's pages; true ends the reading (the caller no
    longer wants it), raising DocumentReadStopped.

    Raises:
        DocumentError: a subclass that says what is wrong (see the module docstring).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        _check_size(path.name, size)
        data = path.read_bytes()
    except OSError as e:
        raise UnreadableDocumentError(f"{path.name} cannot be read ({e.strerror or e})") from None
    return document_from_bytes(data, path.name, stopped)


def document_from_bytes(data: bytes, name: str, stopped: Callable[[], bool] | None = None) -> Document:
    """A document from a file's bytes; `name` (the file name) picks the reader by its suffix; `stopped`: as
    read_document.

    Raises:
        DocumentError: as read_document.
    """
    _check_size(name, len(data))
    suffix = Path(name).suffix.lower()
    if suffix in PDF_SUFFIXES or data.startswith(b"%PDF-"):
        doc = _read_pdf(data, name, stopped)
    elif suffix in DOCX_SUFFIXES:
        doc = _read_docx(data, name)
    elif suffix in HTML_SUFFIXES:
        text, notice = decode_text(data, name)
        doc = Document(name, html_to_text(text), len(data), kind="html", notice=notice)
    elif suffix in _CONVERT_HINTS:
        hint = _CONVERT_HINTS[suffix]
        raise UnsupportedDocumentError(f"{name}: Hearth does not read {suffix} files; {hint}")
    else:
        # known text suffixes, and files without a known suffix that turn out to be text (README, Makefile)
        text, notice = decode_text(data, name, known=suffix in TEXT_SUFFIXES)
        doc = Document(name, text, len(data), kind="text", notice=notice)
    if len(doc.text) > MAX_TEXT_CHARS:
        raise DocumentTooLargeError(
            f"{name} holds {len(doc.text):,} characters of text; documents up to {MAX_TEXT_CHARS:,} can be "
            "attached: split it, or attach the part you need"
        )
    if not doc.text.strip() and doc.kind != "pdf":
        raise UnreadableDocumentError(f"{name} holds no text")
    return doc


def _check_size(name: str, nbytes: int) -> None:
    if nbytes > MAX_FILE_BYTES:
        raise DocumentTooLargeError(
            f"{name} is {nbytes / (1 << 20):.1f} MB; documents up to {MAX_FILE_BYTES >> 20} MB can be "
            "attached: split it, or attach the part you need"
        )


# ---- text
_BOMS = (  # longest first: UTF-32 LE starts with UTF-16 LE's BOM
    (b"\xff\xfe\x00\x00", "utf-32-le"),
    (b"\x00\x00\xfe\xff", "utf-32-be"),
    (b"\xef\xbb\xbf", "utf-8"),
    (b"\xff\xfe", "utf-16-le"),
    (b"\xfe\xff", "utf-16-be"),
)


def decode_text(data: bytes, name: str, known: bool = True) -> tuple[str, str]:
    """A text file's text and a notice ("" unless the encoding was guessed).

    Args:
        known: the suffix says text; False (an unknown suffix) refuses the file as unsupported rather
            than binary when it is not text.

    Raises:
        UnsupportedDocumentError: binary content (NUL bytes without a UTF-16/32 BOM, or control bytes).
        UnreadableDocumentError: a BOM whose encoding the bytes do not follow.
    """
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return _newlines(data[len(bom):].decode(encoding)), ""
            except UnicodeDecodeError:
                raise UnreadableDocumentError(
                    f"{name} starts with a {encoding.upper()} byte order mark but is not {encoding.upper()} "
                    "text; save it again as UTF-8"
                ) from None
    if b"\x00" in data[:SNIFF_BYTES] or _controls(data[:SNIFF_BYTES]) > 0.05:
        if known:
            raise UnsupportedDocumentError(
                f"{name} looks binary, not text; attach a {READABLE}"
            )
        raise UnsupportedDocumentError(f"{name} is not a document Hearth can read; attach a {READABLE}")
    try:
        return _newlines(data.decode("utf-8")), ""
    except UnicodeDecodeError:
        text = data.decode("cp1252", errors="replace")
        return _newlines(text), (
            f"{name} is not UTF-8: it was read as Windows-1252 (cp1252); if letters look wrong, save it as "
            "UTF-8 and attach it again"
        )


def _controls(sample: bytes) -> float:
    """The share of control bytes other than tab, newlines and form feed (binary files have many)."""
    if not sample:
        return 0.0
    bad = sum(1 for b in sample if b < 32 and b not in (9, 10, 12, 13, 27))
    return bad / len(sample)


def _newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


# ---- PDF
def _read_pdf(data: bytes, name: str, stopped: Callable[[], bool] | None = None) -> Document:
    try:
        from pypdf import PdfReader
        from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError
    except ImportError:  # a broken install: the dependency is declared
        raise UnsupportedDocumentError(f"{name}: reading PDFs needs pypdf; reinstall Hearth") from None
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")  # "encrypted" PDFs with an empty user password open as is
            except (DependencyError, NotImplementedError):
                opened = 0
            if not opened:
                raise EncryptedDocumentError(
                    f"{name} is protected by a password; open it in a PDF viewer and save (or print) an "
                    "unprotected copy, then attach that"
                )
        pages = []
        for page in reader.pages:  # a page can take a second or more: the caller may stop between them
            if stopped is not None and stopped():
                raise DocumentReadStopped(f"the reading of {name} was stopped")
            pages.append(_newlines(page.extract_text() or "").strip())
    except DocumentError:
        raise
    except FileNotDecryptedError:
        raise EncryptedDocumentError(
            f"{name} is protected by a password; save an unprotected copy and attach that"
        ) from None
    except (PdfReadError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError) as e:
        raise UnreadableDocumentError(f"{name} is not a PDF Hearth can read, or is damaged ({e})") from None
    if not any(pages):
        raise NoTextLayerError(
            f"{name} has no text layer (a scan or pictures of pages); Hearth does not do OCR: run it "
            "through an OCR tool (e.g. ocrmypdf) or paste its text"
        )
    text, starts = "", []
    for page in pages:
        if text:
            text += "\n\n"
        starts.append(len(text))
        text += page
    return Document(name, text, len(data), pages=len(pages), kind="pdf", page_starts=starts)


# ---- Word .docx
_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"


def _read_docx(data: bytes, name: str) -> Document:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            try:
                body_xml = z.read("word/document.xml")
            except KeyError:
                raise UnreadableDocumentError(f"{name} is not a Word document (no document.xml)") from None
            pages = _docx_pages(z)
        root = ElementTree.fromstring(body_xml)
    except zipfile.BadZipFile:
        raise UnreadableDocumentError(
            f"{name} is not a Word .docx file or it is damaged (an old .doc? save it as .docx or PDF)"
        ) from None
    except ElementTree.ParseError as e:
        raise UnreadableDocumentError(f"{name} is damaged: its text cannot be parsed ({e})") from None
    body = root.find(f"{_W}body")
    if body is None:
        raise UnreadableDocumentError(f"{name} is not a Word document (no body)")
    blocks: list[str] = []
    _docx_blocks(body, blocks)
    text = "\n\n".join(b for b in blocks if b.strip())
    return Document(name, text, len(data), pages=pages, kind="docx")


def _docx_blocks(element, out: list[str]) -> None:
    """Paragraphs and tables of `element`, in order (content controls and the like are looked into)."""
    for child in element:
        if child.tag == f"{_W}p":
            out.append(_docx_paragraph(child))
        elif child.tag == f"{_W}tbl":
            rows = []
            for row in child.iter(f"{_W}tr"):
                cells = [" ".join(_docx_paragraph(p) for p in cell.iter(f"{_W}p")).strip()
                         for cell in row.findall(f"{_W}tc")]
                rows.append(" | ".join(cells))
            out.append("\n".join(rows))
        elif child.tag != f"{_W}sectPr":
            _docx_blocks(child, out)


def _docx_paragraph(p) -> str:
    parts = []
    for node in p.iter():
        if node.tag == f"{_W}t" and node.text:
            parts.append(node.text)
        elif node.tag == f"{_W}tab":
            parts.append("\t")
        elif node.tag in (f"{_W}br", f"{_W}cr"):
            parts.append("\n")
    return "".join(parts)


def _docx_pages(z: zipfile.ZipFile) -> int | None:
    """The page count Word recorded in docProps/app.xml (None if it did not)."""
    try:
        m = re.search(rb"<(?:\w+:)?Pages>(\d+)</", z.read("docProps/app.xml"))
    except KeyError:
        return None
    return int(m.group(1)) if m else None


# ---- HTML
_SKIP = {"script", "style", "noscript", "template", "svg", "head"}
_BLOCK = {
    "p", "div", "br", "li", "ul", "ol", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "table", "section",
    "article", "header", "footer", "nav", "aside", "main", "blockquote", "pre", "hr", "dt", "dd", "dl",
    "figure", "figcaption", "title", "form", "details", "summary",
}
_LINES = {"li", "tr", "dt", "dd", "br"}  # one line each, no blank line between them


class _HtmlText(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.title = ""
        self._in_title = False
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP:
            self.skip += 1
        elif tag == "title":
            self._in_title = True
        elif tag in ("td", "th"):
            self.parts.append("\t")
        elif tag in _BLOCK:
            self.parts.append("\n")
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag):
        if tag in _SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag == "title":
            self._in_title = False
        elif tag in _BLOCK and tag not in _LINES:
            self.parts.append("\n")  # with the next block's own newline: a blank line between paragraphs
        if tag == "pre":
            self.pre = max(0, self.pre - 1)

    def handle_startendtag(self, tag, attrs):
        if tag in ("br", "hr"):
            self.parts.append("\n")

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        elif not self.skip:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_to_text(html: str) -> str:
    """The readable text of an HTML page: scripts and styles dropped, one line per block element."""
    parser = _HtmlText()
    parser.feed(html)
    parser.close()
    lines = [line.strip() for line in "".join(parser.parts).split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    title = " ".join(parser.title.split())
    if title and not text.startswith(title):
        text = f"{title}\n\n{text}"
    return text
