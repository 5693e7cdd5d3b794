"""Documents: text out of real files made here (a hand-written PDF, pypdf's own encrypted and blank PDFs, a
.docx zip, HTML, UTF-16/UTF-8/cp1252 text), every refusal with its typed error, chunk bounds, BM25
ranking, and the whole-vs-retrieval decision with the prompt block it writes."""

from __future__ import annotations

import io
import zipfile

import pytest

from engine import documents as D
from engine.document_context import (
    BM25,
    PART_OVERHEAD,
    chunk_text,
    document_budget,
    document_chunks,
    documents_block,
    estimate_tokens,
    select,
    sources_text,
    user_turn,
    with_documents,
)
from engine.documents import (
    Document,
    DocumentError,
    DocumentTooLargeError,
    EncryptedDocumentError,
    NoTextLayerError,
    UnreadableDocumentError,
    UnsupportedDocumentError,
    document_from_bytes,
    read_document,
)


def make_pdf(pages: list[str]) -> bytes:
    """A real PDF 1.4 with one Helvetica text line per page (objects and xref written by hand)."""
    objects: list[bytes] = []
    n = len(pages)
    font = 3 + 2 * n
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode())
    for i, text in enumerate(pages):
        content = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
            f"/Resources << /Font << /F1 {font} 0 R >> >> >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for k, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % k + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def make_docx(body: str, pages: int | None = 2) -> bytes:
    """A real .docx (the parts Word needs to open it) with `body` inside <w:body>."""
    ns = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(
            "[Content_Types].xml",
            '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
            '<Default Extension="xml" ContentType="application/xml"/><Override PartName="/word/document.xml" '
            'ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/>'
            "</Types>",
        )
        xml = f'<?xml version="1.0"?><w:document {ns}><w:body>{body}</w:body></w:document>'
        z.writestr("word/document.xml", xml)
        if pages is not None:
            z.writestr("docProps/app.xml", f"<Properties><Pages>{pages}</Pages></Properties>")
    return buf.getvalue()


def _p(text: str) -> str:
    return f"<w:p><w:r><w:t>{text}</w:t></w:r></w:p>"


# ---- extraction
def test_a_pdf_reading_stops_between_pages_when_asked(tmp_path):
    path = tmp_path / "long.pdf"
    path.write_bytes(make_pdf([f"Page {i} of the annual report." for i in range(1, 6)]))
    asked: list[int] = []

    def stopped() -> bool:  # the caller gives up once two pages are read
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(D.DocumentReadStopped, match="the reading of long.pdf was stopped"):
        read_document(path, stopped)
    assert len(asked) == 3, "asked before every page, and nothing read after the stop"
    assert read_document(path, lambda: False).pages == 5


def test_pdf_text_per_page(tmp_path):
    path = tmp_path / "report.pdf"
    path.write_bytes(make_pdf(["Revenue grew nine percent.", "The CEO is Ada Lovelace."]))
    doc = read_document(path)
    assert doc.kind == "pdf" and doc.pages == 2 and doc.size == path.stat().st_size
    assert "Revenue grew nine percent." in doc.text and "Ada Lovelace" in doc.text
    assert doc.text.index("Revenue") < doc.text.index("Ada")
    assert doc.page_starts[0] == 0 and doc.text[doc.page_starts[1]:].startswith("The CEO")


def test_encrypted_pdf_is_refused_and_an_owner_only_one_opens():
    from pypdf import PdfReader, PdfWriter

    def encrypted(user: str) -> bytes:
        writer = PdfWriter()
        writer.append(PdfReader(io.BytesIO(make_pdf(["Secret plans."]))))
        writer.encrypt(user_password=user, owner_password="owner", algorithm="RC4-128")
        out = io.BytesIO()
        writer.write(out)
        return out.getvalue()

    with pytest.raises(EncryptedDocumentError, match="locked.pdf is protected by a password; open it"):
        document_from_bytes(encrypted("secret"), "locked.pdf")
    assert "Secret plans." in document_from_bytes(encrypted(""), "open.pdf").text


def test_scanned_pdf_without_text_says_no_ocr():
    from pypdf import PdfWriter

    writer = PdfWriter()
    writer.add_blank_page(612, 792)
    writer.add_blank_page(612, 792)
    out = io.BytesIO()
    writer.write(out)
    with pytest.raises(NoTextLayerError, match="scan.pdf has no text layer.*does not do OCR"):
        document_from_bytes(out.getvalue(), "scan.pdf")


def test_corrupt_pdf_is_unreadable():
    with pytest.raises(UnreadableDocumentError, match="broken.pdf is not a PDF Hearth can read"):
        document_from_bytes(b"%PDF-1.4\nthis is not really a pdf at all", "broken.pdf")


def test_docx_paragraphs_and_tables_in_order():
    body = (
        _p("Intro paragraph.")
        + "<w:tbl><w:tr><w:tc>" + _p("Name") + "</w:tc><w:tc>" + _p("Age") + "</w:tc></w:tr>"
        + "<w:tr><w:tc>" + _p("Ada") + "</w:tc><w:tc>" + _p("36") + "</w:tc></w:tr></w:tbl>"
        + '<w:p><w:r><w:t xml:space="preserve">Two </w:t></w:r><w:r><w:tab/><w:t>runs</w:t></w:r></w:p>'
        + "<w:sdt><w:sdtContent>" + _p("Inside a content control.") + "</w:sdtContent></w:sdt>"
        + "<w:sectPr/>"
    )
    doc = document_from_bytes(make_docx(body), "cv.docx")
    assert doc.kind == "docx" and doc.pages == 2
    assert doc.text == "Intro paragraph.\n\nName | Age\nAda | 36\n\nTwo \truns\n\nInside a content control."


def test_bad_docx_files():
    with pytest.raises(UnreadableDocumentError, match="old.docx is not a Word .docx file.*save it as .docx"):
        document_from_bytes(b"\xd0\xcf\x11\xe0 an OLE2 .doc renamed", "old.docx")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(UnreadableDocumentError, match="not a Word document"):
        document_from_bytes(buf.getvalue(), "zip.docx")
    with pytest.raises(UnreadableDocumentError, match="damaged"):
        document_from_bytes(make_docx("<w:p><w:r><w:t>unclosed</w:r></w:p>"), "bad.docx")


def test_html_drops_scripts_and_styles():
    html = (
        "<!doctype html><html><head><title>Release notes</title><style>p { color: red }</style>"
        "<script>var secret = 'do not show';</script></head><body><h1>Version 2</h1>"
        "<p>Faster &amp; smaller.</p><ul><li>One</li><li>Two</li></ul>"
        "<table><tr><td>a</td><td>b</td></tr></table><noscript>enable js</noscript></body></html>"
    )
    doc = document_from_bytes(html.encode(), "notes.html")
    assert doc.kind == "html"
    assert doc.text.startswith("Release notes\n\nVersion 2")
    assert "Faster & smaller." in doc.text and "One\nTwo" in doc.text
    assert "secret" not in doc.text and "color" not in doc.text and "enable js" not in doc.text


@pytest.mark.parametrize(
    "data",
    [
        "\ufeffNaïve café, 東京".encode("utf-16-le"),
        "\ufeffNaïve café, 東京".encode("utf-16-be"),
        "\ufeffNaïve café, 東京".encode("utf-8"),  # utf-8-sig
        "Naïve café, 東京".encode(),
        "\ufeffNaïve café, 東京".encode("utf-32-le"),
    ],
)
def test_text_encodings_by_bom(data):
    doc = document_from_bytes(data, "notes.txt")
    assert doc.text == "Naïve café, 東京" and not doc.notice


def test_cp1252_fallback_says_so_and_crlf_is_normalised():
    doc = document_from_bytes("Caf\xe9 \u201cquoted\u201d\r\nline two".encode("cp1252"), "old.csv")
    assert doc.text == "Café “quoted”\nline two"
    assert "not UTF-8" in doc.notice and "Windows-1252" in doc.notice


def test_source_code_and_unknown_text_files(tmp_path):
    assert document_from_bytes(b"def f():\n    return 1\n", "x.py").text.startswith("def f()")
    assert document_from_bytes(b"all:\n\tmake it\n", "Makefile").text.startswith("all:")


def test_refusals_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(UnsupportedDocumentError, match="data.bin is not a document Hearth can read"):
        document_from_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50, "data.bin")
    with pytest.raises(UnsupportedDocumentError, match="notes.txt looks binary"):
        document_from_bytes(b"text\x00\x00\x00more", "notes.txt")
    with pytest.raises(UnsupportedDocumentError, match="sheet.xlsx.*export the sheet as CSV"):
        document_from_bytes(b"PK\x03\x04", "sheet.xlsx")
    with pytest.raises(UnreadableDocumentError, match="missing.txt cannot be read"):
        read_document(tmp_path / "missing.txt")
    with pytest.raises(UnreadableDocumentError, match="empty.txt holds no text"):
        document_from_bytes(b"  \n", "empty.txt")
    with pytest.raises(UnreadableDocumentError, match="UTF-16"):
        document_from_bytes(b"\xff\xfe\x00\xd8", "odd.txt")  # a lone surrogate after a UTF-16 BOM
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 2048)
    monkeypatch.setattr(D, "MAX_FILE_BYTES", 1024)
    with pytest.raises(DocumentTooLargeError, match="big.txt is 0.0 MB; documents up to 0 MB"):
        read_document(big)
    monkeypatch.setattr(D, "MAX_FILE_BYTES", 1 << 30)
    monkeypatch.setattr(D, "MAX_TEXT_CHARS", 1000)
    with pytest.raises(DocumentTooLargeError, match="holds 2,048 characters of text; documents up to 1,000"):
        read_document(big)
    assert all(issubclass(e, DocumentError) for e in (DocumentTooLargeError, NoTextLayerError))


# ---- chunks and retrieval
def _essay(n: int = 40, answer_at: int = 27) -> str:
    paras = []
    for i in range(n):
        if i == answer_at:
            paras.append("The vault's launch code is 7741. Only the night porter knows it.")
        else:
            paras.append(f"Section {i} talks about gardens, weather and the history of the town. " * 4)
    return "\n\n".join(paras)


def test_chunks_stay_in_budget_cover_the_text_and_overlap():
    text = _essay()
    spans = chunk_text(text, max_tokens=120, overlap=0.3)
    assert len(spans) > 5
    assert all(tokens <= 120 and estimate_tokens(text[a:b]) <= 120 + 2 for a, b, tokens in spans)
    assert spans[0][0] == 0 and spans[-1][1] == len(text), "first and last characters are covered"
    for (a0, b0, _), (a1, b1, _) in zip(spans, spans[1:], strict=False):
        assert a1 <= b0, "no gap between chunks"
        assert a0 < a1 and b0 < b1, "they move forward"
    assert any(a1 < b0 for (_, b0, _), (a1, _, _) in zip(spans, spans[1:], strict=False)), "some overlap"
    for a, _, _ in spans:  # starts on a paragraph or sentence boundary
        assert a == 0 or text[a - 1] in " \n"


def test_a_long_paragraph_splits_at_sentences_and_a_long_sentence_at_spaces():
    words = lambda t: len(t.split())  # noqa: E731 - a tokenizer stand-in: one token a word
    text = "One two three. " * 30 + "\n\n" + "word " * 100
    spans = chunk_text(text, max_tokens=20, overlap=0, count=words)
    assert all(words(text[a:b]) <= 20 for a, b, _ in spans)
    assert "".join(text[a:b] for a, b, _ in spans) == text, "without overlap the chunks tile the text"
    assert all(text[a:b].endswith((". ", "\n\n", " ")) or b == len(text) for a, b, _ in spans)


def test_bm25_ranks_the_chunk_with_the_answer_first():
    doc = Document("essay.txt", _essay(), 1)
    chunks = document_chunks([doc], 100)
    scores = BM25([c.text for c in chunks]).scores("What is the vault launch code?")
    best = max(range(len(chunks)), key=scores.__getitem__)
    assert "7741" in chunks[best].text
    assert sorted(scores)[-1] > 2 * sorted(scores)[-2], "clearly ahead of the rest"
    assert BM25(["cats and dogs", "dogs"]).scores("cats") == pytest.approx(
        [BM25(["cats and dogs", "dogs"]).scores("cats")[0], 0.0]
    )


def test_whole_when_it_fits_else_the_best_chunks_in_document_order():
    small = Document("a.txt", "Alpha facts. The sky is green here.", 40)
    essay = Document("essay.txt", _essay(), 9000)
    whole = select([small], "colour of the sky?", 1000)
    assert whole.mode == "whole" and [p.label for p in whole.parts] == ["whole document"]
    assert whole.sources() == [{"name": "a.txt", "whole": True, "chunks": []}]

    budget = 300
    picked = select([small, essay], "What is the vault launch code?", budget)
    assert picked.mode == "retrieval" and picked.tokens <= budget
    assert any("7741" in p.text for p in picked.parts)
    assert "Section 3 talks" not in documents_block(picked), "not the whole essay"
    order = [(p.doc, p.chunk) for p in picked.parts]
    assert order == sorted(order), "in document order"
    assert sum(estimate_tokens(p.text) + PART_OVERHEAD for p in picked.parts) <= budget
    (src,) = picked.sources()
    assert src["name"] == "essay.txt" and not src["whole"] and src["of"] > 1
    assert sources_text(picked.sources()).startswith("essay.txt (chunk")

    nothing_matches = select([essay], "zzz qqq", budget)
    assert nothing_matches.parts and nothing_matches.parts[0].chunk == 0, "the first chunks then"


def test_pdf_chunks_name_their_page():
    pdf = make_pdf(["First page words. " * 40, "Second page holds the answer 42."])
    doc = document_from_bytes(pdf, "r.pdf")
    sel = select([doc], "answer", 150)
    assert sel.mode == "retrieval"
    (part,) = [p for p in sel.parts if "42" in p.text]
    assert part.label.endswith(("page 2", "pages 1-2")), part.label
    first = select([doc], "First page", 150).parts[0]
    assert first.label == "chunk 1 of 6, page 1"


def test_prompt_block_format():
    sel = select([Document('say "hi".txt', "Body with </document> inside.", 10)], "q", 1000)
    block = documents_block(sel)
    assert block == (
        "<documents>\n<document name=\"say 'hi'.txt\" part=\"whole document\">\n"
        "Body with </ document> inside.\n</document>\n</documents>"
    )
    assert user_turn("What does it say?", sel) == block + "\n\nWhat does it say?"
    assert user_turn("", sel) == block


def test_with_documents_keeps_whole_ones_in_their_turn_and_puts_chunks_in_the_last():
    a = Document("a.txt", "The password is swordfish.", 30)
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Read this."},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "What is the password?"},
    ]
    out, sel = with_documents(conv, [[], [a], [], []], 1000)
    assert sel.mode == "whole"
    assert out[1]["content"].startswith("<documents>") and "swordfish" in out[1]["content"]
    assert out[3]["content"] == "What is the password?" and conv[1]["content"] == "Read this."

    essay = Document("essay.txt", _essay(), 9000)
    out, sel = with_documents(conv, [[], [a, essay], [], []], 300)
    assert sel.mode == "retrieval"
    assert out[1]["content"] == "Read this."
    assert out[3]["content"].endswith("\n\nWhat is the password?") and "swordfish" in out[3]["content"]

    parts = [{"type": "image", "image": b"png"}, {"type": "text", "text": "Hi"}]
    images = [{"role": "user", "content": parts}]
    out, _ = with_documents(images, [[a]], 1000)
    assert out[0]["content"][0] == {"type": "image", "image": b"png"}
    assert out[0]["content"][1]["text"].endswith("</documents>\n\nHi")


def test_document_budget_leaves_room_for_the_reply_and_the_conversation():
    assert document_budget(4096, 512, 1000) == 4096 - 512 - 32 - 1000
    assert document_budget(4096, 4096, 0) == 4096 - 1024 - 32, "the reply's reserve is at most a quarter"
    assert document_budget(1024, 100, 5000) == (1024 - 100 - 32) // 3, "old turns go before documents"


def test_model_token_counter_reads_the_models_tokenizer(smollm2_path, tmp_path):
    from engine.document_context import model_token_counter
    from engine.tokenizer import Tokenizer
    from models.formats.gguf import open_gguf

    count = model_token_counter(str(smollm2_path))
    text = "The vault's launch code is 7741. Only the night porter knows it."
    reference = Tokenizer.from_gguf_metadata(open_gguf(smollm2_path).metadata)
    assert count is not None and count(text) == len(reference.encode(text)) > 5
    assert model_token_counter(str(tmp_path / "missing.gguf")) is None, "then the caller estimates"
