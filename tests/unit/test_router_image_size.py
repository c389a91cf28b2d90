"""The router's image header reader (``image_size.py``): it reads the size a decoder would
allocate from real files of each format, built here by hand, and refuses -- as ``BadHeader``,
never another exception -- anything cut short, malformed, evasive (a second size header,
a GIF frame past its screen) or unknown, within a bounded walk."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pdxfer.serving.errors import BadRequest
from pdxfer.serving.router.image_size import BadHeader, ImageSize, image_size
from pdxfer.serving.router.media import MediaPolicy
from pdxfer.serving.router.openai_api import parse_chat
from tests.harness.images import (
    WEBP_LOSSY,
    chat,
    data_url,
    gif,
    image,
    jpeg,
    jpeg_segment,
    png,
    png_chunk,
    riff_webp,
    webp_extended,
    webp_lossless,
)

SIZES = [(1, 1), (3, 5), (17, 9), (300, 2)]
MAKERS: dict[str, tuple[str, Callable[[int, int], bytes]]] = {
    "png": ("png", png),
    "gif": ("gif", gif),
    "webp lossless": ("webp", webp_lossless),
    "webp extended": ("webp", webp_extended),
    "jpeg": ("jpeg", jpeg),
    "jpeg, fill bytes and standalone markers first": (
        "jpeg",
        lambda w, h: jpeg(
            w,
            h,
            before=b"\xff\xff\xff"
            + jpeg_segment(0xFE, b"made by hand")
            + b"\xff\xd0"
            + b"\xff\x01"
            + jpeg_segment(0xE1, b"Exif\x00\x00" + bytes(40)),
        ),
    ),
}


def refuses(raw: bytes, why: str | None = None) -> None:
    with pytest.raises(BadHeader, match=why):
        image_size(raw)


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("w,h", SIZES)
def test_each_format_reads_the_size_of_a_valid_image(name: str, w: int, h: int) -> None:
    kind, make = MAKERS[name]
    assert image_size(make(w, h)) == ImageSize(kind, w, h)


def test_a_lossy_webp_reads_its_size_and_a_gif_frame_past_the_screen_grows_it() -> None:
    assert image_size(WEBP_LOSSY) == ImageSize("webp", 3, 2)
    # Pillow enlarges a GIF's image to fit a frame that reaches past the logical screen
    assert image_size(gif(2, 2, frames=((0, 0, 2, 2), (5, 7, 3, 3)))) == ImageSize("gif", 8, 10)
    assert image_size(gif(9, 9, frames=((1, 1, 2, 2),))) == ImageSize("gif", 9, 9)
    assert image_size(gif(4, 4)[:-1]) == ImageSize("gif", 4, 4)  # no trailer: as Pillow


def _header_end(name: str, raw: bytes) -> int:
    """The shortest prefix of ``raw`` (as the makers build it) that holds the whole header:
    through the first IDAT, the GIF's last block, the first WebP chunk, JPEG's SOS."""
    if name == "png":
        at = raw.index(b"IDAT") - 4
        return at + 12 + int.from_bytes(raw[at : at + 4], "big")
    if name == "gif":
        return len(raw) - 1
    if name.startswith("webp"):
        return 20 + int.from_bytes(raw[16:20], "little")
    return raw.index(b"\xff\xda") + 10


@pytest.mark.parametrize("name", list(MAKERS))
def test_every_prefix_short_of_the_header_is_refused_and_none_reads_another_size(name: str) -> None:
    kind, make = MAKERS[name]
    raw = make(17, 9)
    end = _header_end(name, raw)
    for k in range(len(raw)):
        if k < end:
            refuses(raw[:k])
        else:
            assert image_size(raw[:k]) == ImageSize(kind, 17, 9)


def test_a_png_with_a_second_or_late_ihdr_a_bad_crc_or_no_image_data_is_refused() -> None:
    raw = png(4, 4)
    ihdr, rest = raw[8:33], raw[33:]
    big = png_chunk(b"IHDR", (5000).to_bytes(4, "big") * 2 + b"\x08\x02\x00\x00\x00")
    refuses(raw[:33] + big + rest, "only one")  # Pillow would take 5000x5000
    refuses(raw[:8] + png_chunk(b"tEXt", b"a\x00b") + ihdr + rest, "first chunk")
    refuses(raw[:8] + png_chunk(b"IHDR", ihdr[8:21] + b"\x00") + rest, "13 bytes")
    refuses(raw[:29] + b"\x00\x00\x00\x00" + rest, "CRC")
    refuses(raw[:33] + png_chunk(b"IEND", b""), "without image data")
    refuses(raw[:33] + (1 << 31).to_bytes(4, "big") + b"IDAT", "past the end")
    refuses(png(1 << 31, 1, pixels=False), "2\\^31")
    refuses(png(0, 5, pixels=False), "0x5")


def test_a_gif_without_a_frame_or_with_an_unknown_block_is_refused() -> None:
    screen = gif(4, 4, frames=())
    refuses(screen, "without an image")
    refuses(screen[:-1] + b"\x21\xfe\x03abc\x00" + b"\x3b", "without an image")
    refuses(screen[:-1] + b"\x99" + gif(4, 4)[13 + 768 :], "unknown GIF block 0x99")
    refuses(gif(4, 4)[: 13 + 768 + 5], "cut short")


def test_a_webp_with_an_unknown_first_chunk_or_a_bad_frame_header_is_refused() -> None:
    refuses(b"RIFF\x10\x00\x00\x00WAVEfmt " + bytes(8), "not WebP")
    refuses(riff_webp((b"ALPH", bytes(16))), "ALPH")
    refuses(riff_webp((b"VP8X", bytes(6))), "VP8X")  # too short for its canvas
    refuses(WEBP_LOSSY[:20] + b"\x01" + WEBP_LOSSY[21:], "key frame")  # an inter frame
    refuses(WEBP_LOSSY[:23] + b"\x00\x00\x00" + WEBP_LOSSY[26:], "key frame")
    lossless = webp_lossless(4, 4)
    refuses(lossless[:20] + b"\x2e" + lossless[21:], "signature")
    refuses(lossless[:24] + bytes([lossless[24] | 0x20]) + lossless[25:], "version")
    refuses(WEBP_LOSSY[:26] + bytes(4) + WEBP_LOSSY[30:], "0x0")


def test_a_jpeg_whose_segment_runs_past_the_end_or_whose_markers_go_wrong_is_refused() -> None:
    good = jpeg(8, 8)
    refuses(b"\xff\xd8" + b"\xff\xe0\xff\xff" + bytes(100), "past the end")
    refuses(b"\xff\xd8" + b"\xff\xe0\x00\x01", "past the end")  # a length under 2
    refuses(
        jpeg(8, 8, before=jpeg_segment(0xC2, b"\x08\x00\x01\x00\x01\x01\x01\x11\x00")), "second"
    )  # Pillow would take the second frame header; libjpeg refuses it
    refuses(good.replace(b"\xff\xc0", b"\xff\xfe"), "scan before any frame")
    refuses(b"\xff\xd8\xff\xd9", "ends")
    refuses(b"\xff\xd8\xff\x00", "stuffed")
    refuses(b"\xff\xd8" + b"junk" + good[2:], "no marker")
    refuses(jpeg(8, 8, before=b"\xff" * 100)[:104], "cut short")  # fill bytes, then nothing
    refuses(jpeg(0, 8), "0x8")  # a height or width of 0 (DNL) libjpeg does not support
    big = jpeg_segment(0xC0, b"\x08\xea\x60\xea\x60\x01\x01\x11\x00")  # 60000x60000
    # a frame header Pillow takes from where it reads JPGn as having no length (it then
    # scans on byte by byte), or from DHP
    refuses(
        jpeg(8, 8).replace(b"\xff\xc4", jpeg_segment(0xF0, big) + b"\xff\xc4", 1),
        "0xf0 has no place",
    )
    refuses(jpeg(8, 8, before=b"\xff\xc8" + big), "0xc8 has no place")
    refuses(jpeg(8, 8, before=jpeg_segment(0xDE, big[4:])), "second")
    refuses(jpeg(8, 8, before=jpeg_segment(0x02, b"")), "0x02 has no place")


def test_an_endless_marker_chain_is_refused_within_a_bounded_walk() -> None:
    refuses(b"\xff\xd8" + b"\xff\xd0" * 100_000 + jpeg(8, 8)[2:], "too many")
    refuses(b"\xff\xd8" + jpeg_segment(0xFE, b"") * 100_000 + jpeg(8, 8)[2:], "too many")
    comments = b"".join(png_chunk(b"tEXt", b"k\x00v") for _ in range(50_000))
    raw = png(4, 4)
    refuses(raw[:33] + comments + raw[33:], "too many")
    tiny_blocks = b"\x21\xfe" + b"\x01x" * 100_000 + b"\x00"
    refuses(gif(4, 4)[: 13 + 768] + tiny_blocks + gif(4, 4)[13 + 768 :], "too many")
    # as many markers as a real file has are walked
    many = b"".join(jpeg_segment(0xE2, bytes(60_000)) for _ in range(60))
    assert image_size(jpeg(8, 8, before=many)) == ImageSize("jpeg", 8, 8)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"BM" + bytes(60),
        b"II*\x00" + bytes(60),
        b"\x00\x00\x01\x00" + bytes(60),
        b"<svg/>",
        b"\x89PNG",
        b"GIF88a" + bytes(20),
        b"\xff\xd9\xff\xd8",
    ],
)
def test_an_unknown_format_is_refused(raw: bytes) -> None:
    refuses(raw)


SAMPLES = [make(w, h) for _, make in MAKERS.values() for w, h in SIZES] + [WEBP_LOSSY]
MAGICS = [b"\x89PNG\r\n\x1a\n", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBP", b"\xff\xd8"]


def _fuzzed(rng: random.Random) -> bytes:
    """A magic and random bytes, or a sample with bytes of its header changed, cut at random,
    or both."""
    if rng.random() < 0.2:
        return rng.choice(MAGICS) + rng.randbytes(rng.randrange(64))
    raw = bytearray(rng.choice(SAMPLES))
    if rng.random() < 0.7:
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(min(len(raw), 64))] = rng.randrange(256)
    if rng.random() < 0.5:
        raw = raw[: rng.randrange(1, len(raw) + 1)]
    return bytes(raw)


def test_fuzzed_headers_are_read_or_refused_cleanly() -> None:
    rng = random.Random(46)
    read = 0
    for _ in range(4000):
        raw = _fuzzed(rng)
        try:
            size = image_size(raw)
        except BadHeader:
            continue
        assert size.width > 0 and size.height > 0
        read += 1
    assert 400 < read < 3600  # both outcomes are exercised


def test_fuzzed_images_at_the_front_door_pass_within_the_cap_or_get_a_400() -> None:
    rng = random.Random(47)
    policy = MediaPolicy(max_image_pixels=64 * 64)
    mime = {
        b"\x89P": "image/png",
        b"GI": "image/gif",
        b"RI": "image/webp",
        b"\xff\xd8": "image/jpeg",
    }
    passed = 0
    for _ in range(1500):
        raw = _fuzzed(rng)
        try:
            parse_chat(chat(image(data_url(raw, mime.get(raw[:2], "image/png")))), media=policy)
        except BadRequest:
            continue
        assert image_size(raw).pixels <= policy.max_image_pixels
        passed += 1
    assert 150 < passed < 1350
