"""Images in messages, on the app's side: reading what the user attaches, and thumbnails of stored images.

An attachment keeps its file's own bytes when it is one of the formats the engine reads (ENGINE_MIMES:
PNG, JPEG, WebP, GIF, BMP); another format Pillow decodes (TIFF, an icon, AVIF, a pasted bitmap) is stored
as PNG. A file Pillow cannot decode, one over MAX_IMAGE_BYTES, and one of more pixels than the engine reads
(engine.vision.tower.MAX_PIXELS) are refused with an AttachmentError that says which and why; the caller
shows it. Pillow is what the engine decodes with, so an image attached here is one the engine can read.

Threads: the composer checks attachments in a worker thread (app.composer), since decoding a 20 MB image
takes a while. That work (image_from_file, image_from_pixels, thumbnail_pixels) touches no Qt object: a
Qt call made from a Python thread holds the GIL, and one that takes Qt's internal locks (an image reader
does) deadlocks against the GUI thread destroying a widget, which waits for the GIL under those locks.
Qt images come in and go out on the GUI thread only: `pixels_of` copies a pasted QImage's pixels, and
`pixmap_of` / `thumbnail` make a QPixmap of a thumbnail's pixels.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from app.chat_store import MessageImage
from app.qt import QImage, QMimeData, QPixmap, QPixmapCache, QSize
from engine.vision.tower import MAX_PIXELS
from models.errors import HearthError

MAX_IMAGE_BYTES = 20 * 1024 * 1024
ENGINE_MIMES = {  # Pillow's format name -> the mime type kept (an MPO is a phone's JPEG with a depth map)
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "MPO": "image/jpeg",
    "GIF": "image/gif",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
}
FILE_FILTER = "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp *.tif *.tiff *.avif);;All files (*)"
READABLE = "PNG, JPEG, WebP, GIF or BMP"
# orientations (EXIF tag 274) that turn the picture on its side
_SIDEWAYS = {5, 6, 7, 8}
# the app refuses images over MAX_PIXELS itself, with a message: Pillow's warning from 89 M pixels is noise
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


class AttachmentError(HearthError):
    """A file or pasted item cannot be attached as an image (the message says which and why)."""


@dataclass(frozen=True)
class Pixels:
    """Decoded RGBA pixels (8 bits a channel, not premultiplied), rows `stride` bytes apart: an image in a
    form that crosses threads without a Qt object."""

    width: int
    height: int
    stride: int
    data: bytes

    def image(self) -> Image.Image:
        return Image.frombuffer("RGBA", (self.width, self.height), self.data, "raw", "RGBA", self.stride, 1)


def _check_size(name: str, nbytes: int, what: str = "") -> None:
    if nbytes > MAX_IMAGE_BYTES:
        raise AttachmentError(
            f"{name} is {nbytes / (1 << 20):.1f} MB{what}; "
            f"images up to {MAX_IMAGE_BYTES >> 20} MB can be attached"
        )


def _open(data: bytes, name: str) -> Image.Image:
    """The image in `data`, opened (its header read, not yet decoded) and checked for size.

    Raises:
        AttachmentError: no image Pillow reads, or one of more than MAX_PIXELS pixels.
    """
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise AttachmentError(f"{name} has too many pixels to read; scale it down first") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise AttachmentError(f"{name} is not an image Hearth can read ({READABLE})") from None
    if image.width * image.height > MAX_PIXELS:
        raise AttachmentError(
            f"{name} is {image.width}×{image.height} pixels, too large to read; scale it down first"
        )
    return image


def _rgba(image: Image.Image) -> Image.Image:
    """`image` as RGBA (16-bit and float greyscale through 8-bit RGB, as the engine's RGB reading does)."""
    try:
        return image.convert("RGBA")
    except ValueError:
        return image.convert("RGB").convert("RGBA")


def _png(image: Image.Image, name: str, what: str = "") -> MessageImage:
    """A decoded image stored as PNG (RGB when every pixel is opaque, which makes a smaller file)."""
    image = _rgba(image)
    if image.getextrema()[3][0] == 255:
        image = image.convert("RGB")
    buf = io.BytesIO()
    image.save(buf, "PNG")
    data = buf.getvalue()
    _check_size(name, len(data), what)
    return MessageImage(data, "image/png")


def image_from_file(path: str | Path) -> MessageImage:
    """An attachment from an image file. Any thread.

    Raises:
        AttachmentError: unreadable, over MAX_IMAGE_BYTES, or no image Pillow can decode.
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
    Any thread.

    Raises:
        AttachmentError: over MAX_IMAGE_BYTES, or no image Pillow can decode.
    """
    _check_size(name, len(data))
    with _open(data, name) as image:
        fmt = image.format
        try:
            image.load()  # decoded whole, so a truncated or corrupt file is caught here
        except (OSError, ValueError, SyntaxError) as e:
            raise AttachmentError(f"{name} is not an image Hearth can read ({e})") from None
        mime = ENGINE_MIMES.get(fmt or "")
        if mime:
            return MessageImage(data, mime)
        return _png(ImageOps.exif_transpose(image), name, " as PNG")


def pixels_of(image: QImage) -> Pixels:
    """A decoded Qt image's pixels (a paste), copied out. GUI thread."""
    rgba = image.convertToFormat(QImage.Format.Format_RGBA8888)
    return Pixels(rgba.width(), rgba.height(), rgba.bytesPerLine(), bytes(rgba.constBits()))


def image_from_pixels(pixels: Pixels, name: str = "the pasted image") -> MessageImage:
    """An attachment from decoded pixels (a paste), stored as PNG. Any thread.

    Raises:
        AttachmentError: an empty image, or one whose PNG is over MAX_IMAGE_BYTES.
    """
    if pixels.width <= 0 or pixels.height <= 0:
        raise AttachmentError(f"{name} is empty")
    if pixels.width * pixels.height > MAX_PIXELS:
        raise AttachmentError(
            f"{name} is {pixels.width}×{pixels.height} pixels, too large to read; scale it down first"
        )
    return _png(pixels.image(), name, " as PNG")


def offered_items(source: QMimeData) -> list[Pixels | str]:
    """What a paste or a drop offers as attachments: its local files (paths), else its image's pixels; []
    when it holds neither (plain text, web links). GUI thread."""
    if source.hasUrls():
        paths = [u.toLocalFile() for u in source.urls() if u.isLocalFile()]
        if paths:
            return paths
    if source.hasImage():
        image = source.imageData()
        if isinstance(image, QPixmap):
            image = image.toImage()
        if isinstance(image, QImage) and not image.isNull():
            return [pixels_of(image)]
    return []


def image_size(data: bytes) -> QSize:
    """An encoded image's size in pixels, upright (read from its header; invalid if unreadable)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if image.getexif().get(274) in _SIDEWAYS:
                width, height = height, width
    except (Image.DecompressionBombError, UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return QSize()
    return QSize(width, height)


def thumbnail_pixels(data: bytes, side: int, dpr: float = 1.0) -> Pixels | None:
    """The image scaled to fit side × side logical pixels (aspect kept, never enlarged, EXIF orientation
    applied); None if the bytes are no readable image. A JPEG is decoded at a reduced scale where that
    still covers the box. Any thread."""
    box = max(1, round(side * dpr))
    try:
        with _open(data, "the image") as image:
            image.draft("RGB", (box, box))  # JPEG only: decode at 1/2, 1/4 or 1/8 when big enough
            image = ImageOps.exif_transpose(image)
            image.thumbnail((box, box), Image.Resampling.BICUBIC)
            image = _rgba(image)
    except (AttachmentError, OSError, ValueError, SyntaxError):
        return None
    return Pixels(image.width, image.height, image.width * 4, image.tobytes())


def pixmap_of(pixels: Pixels | None, dpr: float = 1.0) -> QPixmap:
    """Thumbnail pixels (made in any thread) as a pixmap for a label; null for None. GUI thread."""
    if pixels is None:
        return QPixmap()
    image = QImage(pixels.data, pixels.width, pixels.height, pixels.stride, QImage.Format.Format_RGBA8888)
    pixmap = QPixmap.fromImage(image.copy())  # the copy owns its pixels, not `pixels.data`
    pixmap.setDevicePixelRatio(dpr)
    return pixmap


def thumbnail(data: bytes, side: int, dpr: float = 1.0) -> QPixmap:
    """The image scaled to fit side × side logical pixels (aspect kept, never enlarged); null if the bytes
    are no readable image. Cached. GUI thread."""
    key = f"hearth-thumb:{side}:{dpr}:{hashlib.sha1(data).hexdigest()}"
    cached = QPixmapCache.find(key)
    if cached is not None:
        return cached
    pixmap = pixmap_of(thumbnail_pixels(data, side, dpr), dpr)
    if not pixmap.isNull():
        QPixmapCache.insert(key, pixmap)
    return pixmap
