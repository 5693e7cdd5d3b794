"""Images in messages, on the Qt side: reading what the user attaches, and thumbnails of stored images.

An attachment keeps its file's own bytes when it is one of the formats the engine reads (ENGINE_MIMES:
PNG, JPEG, WebP, GIF, BMP); another format Qt decodes (TIFF, an icon, a pasted bitmap) is stored as PNG.
A file Qt cannot decode, one over MAX_IMAGE_BYTES, and an image too large to decode in Qt's allocation
limit are refused with an AttachmentError that says which and why; the caller shows it.

Everything here but `thumbnail` (which makes a QPixmap) may run off the GUI thread: the composer checks
attachments in a worker (app.composer), since decoding a 20 MB image takes a while.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from app.chat_store import MessageImage
from app.qt import (
    QBuffer,
    QByteArray,
    QImage,
    QImageReader,
    QIODevice,
    QMimeData,
    QPixmap,
    QPixmapCache,
    QSize,
    Qt,
)
from models.errors import HearthError

MAX_IMAGE_BYTES = 20 * 1024 * 1024
ENGINE_MIMES = {
    "png": "image/png",
    "jpeg": "image/jpeg",
    "jpg": "image/jpeg",
    "gif": "image/gif",
    "webp": "image/webp",
    "bmp": "image/bmp",
}
FILE_FILTER = "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp *.tif *.tiff);;All files (*)"
READABLE = "PNG, JPEG, WebP, GIF or BMP"


class AttachmentError(HearthError):
    """A file or pasted item cannot be attached as an image (the message says which and why)."""


def _check_size(name: str, nbytes: int, what: str = "") -> None:
    if nbytes > MAX_IMAGE_BYTES:
        raise AttachmentError(
            f"{name} is {nbytes / (1 << 20):.1f} MB{what}; "
            f"images up to {MAX_IMAGE_BYTES >> 20} MB can be attached"
        )


@contextlib.contextmanager
def _reading(data: bytes) -> Iterator[QImageReader]:
    buf = QBuffer()
    buf.setData(QByteArray(data))
    buf.open(QIODevice.OpenModeFlag.ReadOnly)
    reader = QImageReader(buf)
    reader.setAutoTransform(True)  # a phone's JPEG stands as it was taken (EXIF orientation)
    try:
        yield reader
    finally:
        reader.setDevice(None)  # the format handler goes first: TIFF's touches the buffer as it closes


def _too_large(size: QSize) -> bool:
    """Whether decoding `size` passes Qt's allocation limit (Qt would refuse it, with a warning)."""
    limit_mb = QImageReader.allocationLimit()  # 0: no limit
    return limit_mb > 0 and size.width() * size.height() * 4 > limit_mb << 20


def image_from_file(path: str | Path) -> MessageImage:
    """An attachment from an image file.

    Raises:
        AttachmentError: unreadable, over MAX_IMAGE_BYTES, or no image Qt can decode.
    """
    path = Path(path)
    try:
        _check_size(path.name, path.stat().st_size)
        data = path.read_bytes()
    except OSError as e:
        raise AttachmentError(f"{path.name} cannot be read ({e.strerror or e})") from None
    return image_from_bytes(data, path.name)


def image_from_bytes(data: bytes, name: str = "the image") -> MessageImage:
    """An attachment from an encoded image file's bytes (kept as they are in a format the engine reads).

    Raises:
        AttachmentError: over MAX_IMAGE_BYTES, or no image Qt can decode.
    """
    _check_size(name, len(data))
    with _reading(data) as reader:
        fmt = bytes(reader.format()).decode("ascii", "replace").lower()
        size = reader.size()
        if not reader.canRead() or not size.isValid():
            raise AttachmentError(f"{name} is not an image Hearth can read ({READABLE})")
        if _too_large(size):
            raise AttachmentError(
                f"{name} is {size.width()}×{size.height()} pixels, too large to read; scale it down first"
            )
        image = reader.read()  # decoded whole, so a truncated or corrupt file is caught here
        if image.isNull():
            raise AttachmentError(f"{name} is not an image Hearth can read ({reader.errorString()})")
    mime = ENGINE_MIMES.get(fmt)
    return MessageImage(data, mime) if mime else image_from_qimage(image, name)


def image_from_qimage(image: QImage, name: str = "the pasted image") -> MessageImage:
    """An attachment from a decoded image (a paste), stored as PNG.

    Raises:
        AttachmentError: an empty image, or one whose PNG is over MAX_IMAGE_BYTES.
    """
    if image.isNull():
        raise AttachmentError(f"{name} is empty")
    buf = QBuffer()
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buf, "PNG"):
        raise AttachmentError(f"{name} could not be encoded as PNG")
    data = bytes(buf.data())
    _check_size(name, len(data), " as PNG")
    return MessageImage(data, "image/png")


def offered_items(source: QMimeData) -> list[QImage | str]:
    """What a paste or a drop offers as attachments: its local files (paths), else its image; [] when it
    holds neither (plain text, web links)."""
    if source.hasUrls():
        paths = [u.toLocalFile() for u in source.urls() if u.isLocalFile()]
        if paths:
            return paths
    if source.hasImage():
        image = source.imageData()
        if isinstance(image, QPixmap):
            image = image.toImage()
        if isinstance(image, QImage) and not image.isNull():
            return [image]
    return []


def image_size(data: bytes) -> QSize:
    """An encoded image's size in pixels, upright (read from its header; invalid if unreadable)."""
    with _reading(data) as reader:
        size = reader.size()
        if size.isValid() and reader.transformation().value & 4:  # Rotate90: EXIF has it on its side
            size.transpose()
    return size


def thumbnail_image(data: bytes, side: int, dpr: float = 1.0) -> QImage:
    """The image scaled to fit side × side logical pixels (aspect kept, never enlarged), as a QImage; null if
    the bytes are no readable image. Decoded at the reduced size where the format allows (JPEG). Safe to call
    off the GUI thread (no QPixmap)."""
    with _reading(data) as reader:
        size = reader.size()  # as stored: the reader scales before it turns, and the box is square
        if not size.isValid() or _too_large(size):
            return QImage()
        box = round(side * dpr)
        if size.width() > box or size.height() > box:
            reader.setScaledSize(size.scaled(box, box, Qt.AspectRatioMode.KeepAspectRatio))
        return reader.read()


def thumbnail(data: bytes, side: int, dpr: float = 1.0) -> QPixmap:
    """The image scaled to fit side × side logical pixels (aspect kept, never enlarged); null if the bytes
    are no readable image. Decoded at the reduced size where the format allows (JPEG), and cached."""
    key = f"hearth-thumb:{side}:{dpr}:{hashlib.sha1(data).hexdigest()}"
    cached = QPixmapCache.find(key)
    if cached is not None:
        return cached
    pixmap = pixmap_of(thumbnail_image(data, side, dpr), dpr)
    if not pixmap.isNull():
        QPixmapCache.insert(key, pixmap)
    return pixmap


def pixmap_of(image: QImage, dpr: float = 1.0) -> QPixmap:
    """A thumbnail_image (made in any thread) as a pixmap for a label (GUI thread only); null stays null."""
    if image.isNull():
        return QPixmap()
    pixmap = QPixmap.fromImage(image)
    pixmap.setDevicePixelRatio(dpr)
    return pixmap
