"""Image files built by hand (``struct`` and ``zlib``, no imaging library), of any declared
size, for the router's image checks: PNG (RGB noise), GIF (LZW of literal codes only),
WebP lossless (VP8L whose one-symbol prefix codes spend no bit per pixel: a few bytes
for any size, a true decompression bomb when large) and extended (VP8X), and baseline
grayscale JPEG (one-code Huffman tables: two bits per 8x8 block). Each decodes with
libpng/libgif/libwebp/libjpeg as built (checked once with Pillow, outside the suite).
``WEBP_LOSSY`` is a 3x2 lossy WebP that libwebp wrote (a VP8 encoder is out of scope here).
"""

from __future__ import annotations

import base64
import random
import struct
import zlib
from typing import Any

WEBP_LOSSY = bytes.fromhex(
    "52494646320000005745425056503820260000007001009d012a0300020007409625a0027401400000"
    "fee40175c5cd91147f337e147c9d400000"
)
"""3x2 pixels of one colour: ``Image.new("RGB", (3, 2)).save(f, "WEBP", quality=10)``."""


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def png(w: int = 4, h: int = 4, seed: int = 0, pixels: bool = True) -> bytes:
    """An RGB PNG of ``w`` x ``h`` noise (it does not compress); ``pixels=False``: one
    short IDAT instead, for a header declaring more than a test should build."""
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + rng.randbytes(3 * w) for _ in range(h)) if pixels else b"\x00" * 64
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(rows))
        + png_chunk(b"IEND", b"")
    )


def _lzw_literals(indices: bytes) -> bytes:
    """GIF LZW data (8-bit code size) of literal codes only: a clear code every 250 codes
    keeps the decoder's table, and so the code width (9 bits), from growing."""
    clear, end = 256, 257
    codes = [clear]
    for i in range(0, len(indices), 250):
        codes += [*indices[i : i + 250], clear]
    codes.append(end)
    acc = nbits = 0
    out = bytearray()
    for c in codes:
        acc |= c << nbits
        nbits += 9
        while nbits >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nbits -= 8
    if nbits:
        out.append(acc)
    return bytes(out)


def _sub_blocks(data: bytes) -> bytes:
    return (
        b"".join(
            bytes([len(data[i : i + 255])]) + data[i : i + 255] for i in range(0, len(data), 255)
        )
        + b"\x00"
    )


def gif(
    w: int = 4,
    h: int = 4,
    frames: tuple[tuple[int, int, int, int], ...] | None = None,
    seed: int = 0,
) -> bytes:
    """A GIF89a whose logical screen is ``w`` x ``h``, with a 256-grey palette and one frame
    per ``(x, y, width, height)`` (default: one frame filling the screen), each of noise."""
    rng = random.Random(seed)
    out = b"GIF89a" + struct.pack("<HHBBB", w, h, 0xF7, 0, 0)  # 0xF7: a 256-entry table
    out += bytes(v for i in range(256) for v in (i, i, i))
    for x, y, fw, fh in frames if frames is not None else ((0, 0, w, h),):
        out += b"\x2c" + struct.pack("<HHHHB", x, y, fw, fh, 0) + b"\x08"
        out += _sub_blocks(_lzw_literals(rng.randbytes(fw * fh)))
    return out + b"\x3b"


def _bits(fields: list[tuple[int, int]]) -> bytes:
    """``(value, width)`` fields packed least significant bit first, as VP8L reads them."""
    acc = nbits = 0
    for value, width in fields:
        acc |= value << nbits
        nbits += width
    return acc.to_bytes((nbits + 7) // 8, "little")


def riff_webp(*chunks: tuple[bytes, bytes]) -> bytes:
    body = b"".join(
        kind + struct.pack("<I", len(data)) + data + b"\x00" * (len(data) & 1)
        for kind, data in chunks
    )
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def vp8l(w: int, h: int) -> bytes:
    """A VP8L bitstream of ``w`` x ``h`` opaque black pixels: no transform, no colour cache,
    no meta codes, and five single-symbol ("simple") prefix codes, which spend no bit on a
    pixel."""
    zero = [(1, 1), (0, 1), (0, 1), (0, 1)]  # simple code, 1 symbol, 1-bit symbol: 0
    fields = [
        (0x2F, 8),
        (w - 1, 14),
        (h - 1, 14),
        (0, 1),
        (0, 3),
        (0, 1),
        (0, 1),
        (0, 1),
        *zero,
        *zero,
        *zero,
        (1, 1),
        (0, 1),
        (1, 1),
        (255, 8),
        *zero,
    ]  # alpha: 255
    return _bits(fields)


def webp_lossless(w: int = 4, h: int = 4) -> bytes:
    return riff_webp((b"VP8L", vp8l(w, h)))


def webp_extended(w: int = 4, h: int = 4) -> bytes:
    """VP8X (no flags) announcing a ``w`` x ``h`` canvas, then the VP8L image."""
    vp8x = b"\x00" * 4 + (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")
    return riff_webp((b"VP8X", vp8x), (b"VP8L", vp8l(w, h)))


def jpeg_segment(marker: int, data: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", 2 + len(data)) + data


def jpeg(w: int = 4, h: int = 4, before: bytes = b"", scan: bool = True) -> bytes:
    """A baseline grayscale JPEG of ``w`` x ``h`` mid-grey pixels: every block a DC
    difference of 0 and an end of block, each a one-bit code. ``before``: bytes put after
    SOI (markers, segments); ``scan=False``: SOS with no entropy data, for a header declaring
    more than a test should build."""
    dqt = jpeg_segment(0xDB, b"\x00" + b"\x01" * 64)
    sof = jpeg_segment(0xC0, struct.pack(">BHHB", 8, h, w, 1) + b"\x01\x11\x00")
    one_code = b"\x01" + b"\x00" * 15 + b"\x00"  # one code of length 1, for symbol 0
    dht = jpeg_segment(0xC4, b"\x00" + one_code) + jpeg_segment(0xC4, b"\x10" + one_code)
    sos = jpeg_segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
    blocks = -(-w // 8) * -(-h // 8) if scan else 0
    nbits = 2 * blocks  # all zeros, the last byte padded with ones
    data = bytes(nbits // 8) + (bytes([0xFF >> (nbits % 8)]) if nbits % 8 else b"")
    return b"\xff\xd8" + before + dqt + sof + dht + sos + data + b"\xff\xd9"


# -- chat bodies carrying them ----------------------------------------------------------
def data_url(raw: bytes, mime: str = "image/png") -> str:
    """``raw`` as a ``data:`` URL, as a client inlines an image."""
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def chat(*parts: dict[str, Any], text: str = "what is this?") -> dict[str, Any]:
    """An OpenAI chat body whose user message is ``text`` and then ``parts``."""
    return {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": text}, *parts]},
        ],
        "max_tokens": 4,
    }


def image(url: str) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part."""
    return {"type": "image_url", "image_url": {"url": url}}
