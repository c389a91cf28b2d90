"""The pixel size an image file declares, read from its header by hand: nothing is decoded.

The front door caps width x height before any worker decodes a data URL (``media.py``): a
few dozen bytes can declare a billion pixels. Pure Python over ``struct``, every read
bounded by the data and every walk by a step budget; no imaging library runs on a hostile
body. Each reader walks the file to where its pixel data starts, as a decoder does, and
takes the size the decoder allocates: PNG's one IHDR; GIF's screen grown to fit every
frame (Pillow grows its canvas so); WebP's VP8 or VP8L frame or VP8X canvas; JPEG's one
frame header before SOS, past known markers only. Anything else raises ``BadHeader``."""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class BadHeader(ValueError):
    """Not a PNG, GIF, WebP or JPEG file, or its header is cut short or malformed."""


@dataclass(frozen=True, slots=True)
class ImageSize:
    """What an image file declares: its format and its width and height in pixels."""

    kind: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


_U8 = struct.Struct("B")
_BE16 = struct.Struct(">H")
_LE32 = struct.Struct("<I")
_PNG_CHUNK = struct.Struct(">I4s")
_PNG_IHDR = struct.Struct(">II")
_GIF_SCREEN = struct.Struct("<HHB")
_GIF_FRAME = struct.Struct("<HHHHB")
_WEBP_CHUNK = struct.Struct("<4sI")
_VP8_DIMS = struct.Struct("<HH")
_SOF_DIMS = struct.Struct(">BHH")
_FILL = re.compile(rb"\xff+")
_JPEG_FRAME = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC} | {0xDE}
"""SOF0-SOF15 (less DHT C4, JPG C8 and DAC CC, which share the range) and DHP, which Pillow
reads as a frame header too."""
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})
"""Markers without a length: TEM, RST0-RST7, SOI."""
_JPEG_SEGMENT = frozenset({0xC4, 0xCC, 0xDB, 0xDC, 0xDD, 0xDF, *range(0xE0, 0xF0), 0xFE})
"""Other markers a header holds, each with a length: DHT, DAC, DQT, DNL, DRI, EXP, APPn,
COM. The rest (JPG C8 and JPGn F0-FD, which Pillow reads as having no length, and the
reserved ones) are refused: a decoder could read past them differently."""


def _read(fmt: struct.Struct, raw: bytes, at: int, what: str) -> tuple[Any, ...]:
    if at + fmt.size > len(raw):
        raise BadHeader(f"cut short in {what}")
    return fmt.unpack_from(raw, at)


class _Steps:
    """A walk's budget: 1024 steps and one per 64 bytes (a GIF of 255-byte blocks, the
    common encoding, needs one per 256), so a crafted file of tiny blocks or endless
    markers costs the router a bounded few tens of ms."""

    def __init__(self, raw: bytes) -> None:
        self.left = 1024 + len(raw) // 64

    def take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise BadHeader("too many blocks or markers before the image data")


def _png(raw: bytes) -> tuple[int, int]:
    """IHDR, the first chunk; every chunk before the first IDAT walked (and its CRC
    checked, as decoders do): a second IHDR, which Pillow would take, is refused."""
    at, size, steps = 8, None, _Steps(raw)
    while True:
        steps.take()
        length, kind = _read(_PNG_CHUNK, raw, at, "a PNG chunk header")
        end = at + 8 + length + 4
        if length > 0x7FFFFFFF or end > len(raw):
            raise BadHeader(f"PNG chunk {kind!r} runs past the end of the data")
        data = memoryview(raw)[at + 8 : end - 4]
        if zlib.crc32(data, zlib.crc32(kind)) != int.from_bytes(raw[end - 4 : end], "big"):
            raise BadHeader(f"PNG chunk {kind!r} fails its CRC")
        if (kind == b"IHDR") != (size is None):
            raise BadHeader("a PNG's IHDR must be its first chunk, and its only one")
        if kind == b"IHDR":
            if length != 13:
                raise BadHeader("PNG IHDR is not 13 bytes")
            w, h = _read(_PNG_IHDR, raw, at + 8, "PNG IHDR")
            if w > 0x7FFFFFFF or h > 0x7FFFFFFF:
                raise BadHeader("PNG width or height over 2^31 - 1")
            size = (w, h)
        elif kind == b"IDAT":
            return size  # type: ignore[return-value]  # IHDR came first
        elif kind == b"IEND":
            raise BadHeader("a PNG without image data")
        at = end


def _gif_blocks(raw: bytes, at: int, steps: _Steps) -> int:
    """Where a GIF's data sub-blocks starting at ``at`` end (after their 0 terminator)."""
    while True:
        steps.take()
        (n,) = _read(_U8, raw, at, "a GIF data sub-block")
        at += 1 + n
        if n == 0:
            return at
        if at > len(raw):
            raise BadHeader("a GIF data sub-block runs past the end of the data")


def _gif_table(flags: int) -> int:
    """Bytes of the colour table a GIF screen or frame descriptor's flags announce."""
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0


def _gif(raw: bytes) -> tuple[int, int]:
    """The logical screen, grown to cover every frame: a frame may reach past the screen,
    and Pillow then enlarges the image to fit it (so the screen alone is no cap)."""
    w, h, flags = _read(_GIF_SCREEN, raw, 6, "the GIF screen descriptor")
    at, frames, steps = 13 + _gif_table(flags), 0, _Steps(raw)
    while at < len(raw) and raw[at] != 0x3B:  # 0x3B: the trailer (some files stop without)
        steps.take()
        if raw[at] == 0x21:  # an extension: its label, then sub-blocks
            at = _gif_blocks(raw, at + 2, steps)
        elif raw[at] == 0x2C:  # an image: descriptor, colour table, LZW code size, data
            x, y, fw, fh, fflags = _read(_GIF_FRAME, raw, at + 1, "a GIF image descriptor")
            w, h = max(w, x + fw), max(h, y + fh)
            at = _gif_blocks(raw, at + 11 + _gif_table(fflags), steps)
            frames += 1
        else:
            raise BadHeader(f"unknown GIF block 0x{raw[at]:02x}")
    if not frames:
        raise BadHeader("a GIF without an image")
    return w, h


def _webp(raw: bytes) -> tuple[int, int]:
    """The first chunk: a simple file's VP8 (lossy) or VP8L (lossless) frame, or an
    extended file's VP8X canvas (libwebp refuses frames that do not fit the canvas)."""
    if raw[8:12] != b"WEBP":
        raise BadHeader("a RIFF file that is not WebP")
    kind, length = _read(_WEBP_CHUNK, raw, 12, "the first WebP chunk header")
    if 20 + length > len(raw):
        raise BadHeader(f"WebP chunk {kind!r} runs past the end of the data")
    if kind == b"VP8 " and length >= 10:
        if raw[20] & 1 or raw[23:26] != b"\x9d\x01\x2a":
            raise BadHeader("VP8 data that does not start with a key frame")
        w, h = _read(_VP8_DIMS, raw, 26, "the VP8 frame header")
        return w & 0x3FFF, h & 0x3FFF  # the top two bits are a scale hint
    if kind == b"VP8L" and length >= 5:
        (bits,) = _read(_LE32, raw, 21, "the VP8L header")
        if raw[20] != 0x2F or bits >> 29:
            raise BadHeader("VP8L data without its signature or of an unknown version")
        return (bits & 0x3FFF) + 1, (bits >> 14 & 0x3FFF) + 1
    if kind == b"VP8X" and length >= 10:
        return (int.from_bytes(raw[24:27], "little") + 1, int.from_bytes(raw[27:30], "little") + 1)
    raise BadHeader(f"WebP chunk {kind!r} (length {length}) is not a VP8, VP8L or VP8X header")


def _jpeg(raw: bytes) -> tuple[int, int]:
    """The frame header (SOFn) among the markers before the first scan (SOS); fill bytes and
    standalone markers skipped, other segments by their length. A second frame header is
    refused (Pillow would take the last, libjpeg refuses it)."""
    at, size, steps = 2, None, _Steps(raw)
    while True:
        steps.take()
        if at >= len(raw) or raw[at] != 0xFF:
            raise BadHeader("JPEG data cut short, or no marker where one must start")
        fill = _FILL.match(raw, at)
        assert fill is not None  # raw[at] is 0xFF
        at = fill.end()
        (m,) = _read(_U8, raw, at, "a JPEG marker")
        at += 1
        if m in _JPEG_STANDALONE:
            continue
        if m in (0x00, 0xD9):
            raise BadHeader("JPEG data ends, or holds a stuffed byte, before its first scan")
        if m not in _JPEG_FRAME and m not in _JPEG_SEGMENT and m != 0xDA:
            raise BadHeader(f"JPEG marker 0x{m:02x} has no place in a header")
        (length,) = _read(_BE16, raw, at, f"JPEG marker 0x{m:02x}'s length")
        if length < 2 or at + length > len(raw):
            raise BadHeader(f"JPEG segment 0x{m:02x} runs past the end of the data")
        if m in _JPEG_FRAME:
            if size is not None or length < 8:
                raise BadHeader("a second or short JPEG frame header")
            _, h, w = _read(_SOF_DIMS, raw, at + 2, "the JPEG frame header")
            size = (w, h)
        elif m == 0xDA:
            if size is None:
                raise BadHeader("a JPEG scan before any frame header")
            return size
        at += length


_READERS: tuple[tuple[str, tuple[bytes, ...], Callable[[bytes], tuple[int, int]]], ...] = (
    ("png", (b"\x89PNG\r\n\x1a\n",), _png),
    ("gif", (b"GIF87a", b"GIF89a"), _gif),
    ("webp", (b"RIFF",), _webp),
    ("jpeg", (b"\xff\xd8",), _jpeg),
)


def image_size(raw: bytes) -> ImageSize:
    """The format and size ``raw`` declares, or ``BadHeader``; reads nothing past the data
    and decodes no pixel."""
    for kind, magics, read in _READERS:
        if raw.startswith(magics):
            w, h = read(raw)
            if not w or not h:
                raise BadHeader(f"a {kind.upper()} of {w}x{h} pixels")
            return ImageSize(kind, w, h)
    raise BadHeader("not a PNG, GIF, WebP or JPEG file")
