"""Images in OpenAI chat content parts: validated and bounded at the front door.

A chat message's content may hold ``image_url`` parts. The router forwards them unchanged to
both legs (the engine decodes the image), so it checks here, before anything reaches a
worker, what a hostile body could abuse: at most ``max_images`` per request; a data URL of
an image type whose base64 is well formed and decodes to at most ``max_image_bytes``, whose
bytes start as that type says, and whose header (read by hand, ``image_size.py``: no pixel
decoded, no imaging library run) declares at most ``max_image_pixels`` (a few dozen bytes
can declare a billion pixels, which each worker would decode); a remote ``http(s)`` URL only
when the operator allowed it (each worker would fetch it, a server-side request the client
steers); nothing else.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from pdxfer.setting import setting as setting_field

from ..errors import BadRequest
from .image_size import BadHeader, image_size

_DATA = re.compile(r"data:(image/[a-z0-9.+-]+);base64,", re.I)
_MAGIC: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/jpg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
    "image/webp": (b"RIFF",),
}
"""The image types accepted in data URLs, by the bytes each file starts with."""


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """What the front door accepts in ``image_url`` parts."""

    max_images: int = 8
    max_image_bytes: int = setting_field(
        4 << 20,
        "largest image (decoded bytes) a chat request's data URL may carry (the "
        "router's body limit bounds the request as a whole)",
        metavar="N",
    )
    max_image_pixels: int = setting_field(
        4096 * 4096,
        "largest image (width x height, as its header declares) a chat request may carry",
        metavar="N",
    )
    """4096 x 4096 (16.8 MP): above 4K screens (8.3 MP) and phone photos (12 MP), 48 MiB of
    RGB per decoded image, a fifth of Pillow's own bomb threshold (89.5 MP)."""
    allow_remote: bool = setting_field(
        False,
        "forward http(s) image URLs to the workers (each fetches them; off: a 400 asks "
        "for a data URL)",
        flags=("--allow-remote-images",),
    )


DEFAULT = MediaPolicy()


def check_image_part(part: dict[str, Any], where: str, policy: MediaPolicy) -> None:
    """Refuse (``BadRequest``, a 400) an ``image_url`` part the workers must not get."""
    iu = part.get("image_url")
    url = iu.get("url") if isinstance(iu, dict) else None
    if not isinstance(iu, dict) or not isinstance(url, str) or not url:
        raise BadRequest(f"{where}: 'image_url' must be an object with a 'url' string")
    detail = iu.get("detail")
    if detail is not None and detail not in ("auto", "low", "high"):
        raise BadRequest(f"{where}: 'image_url.detail' must be auto, low or high")
    low = url[:8].lower()
    if low.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise BadRequest(
                f"{where}: remote image URLs are not accepted by this router "
                f"(send the image as a data URL: data:image/png;base64,...)"
            )
        return
    m = _DATA.match(url)
    if m is None:
        raise BadRequest(f"{where}: an image URL must be a data URL (data:image/<type>;base64,...)")
    mime = m.group(1).lower()
    if mime not in _MAGIC:
        raise BadRequest(
            f"{where}: image type {mime} is not accepted ({', '.join(sorted(_MAGIC))})"
        )
    b64 = url[m.end() :]
    if len(b64) > 4 * (-(-policy.max_image_bytes // 3)):  # before decoding anything
        raise BadRequest(f"{where}: image over {policy.max_image_bytes} bytes")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: the data URL's base64 is malformed") from None
    if not raw or len(raw) > policy.max_image_bytes:
        raise BadRequest(f"{where}: image is empty or over {policy.max_image_bytes} bytes")
    if not raw.startswith(_MAGIC[mime]) or mime == "image/webp" and raw[8:12] != b"WEBP":
        raise BadRequest(f"{where}: the data is not a {mime} image")
    try:
        size = image_size(raw)
    except BadHeader as e:
        raise BadRequest(f"{where}: the image's header cannot be read ({e})") from None
    if size.pixels > policy.max_image_pixels:
        raise BadRequest(
            f"{where}: image over {policy.max_image_pixels} pixels ({size.width}x{size.height})"
        )


def parse_parts(
    content: list[Any], where: str, policy: MediaPolicy
) -> tuple[list[dict[str, Any]], int]:
    """A message's content parts, checked: (the parts for the chat template, text as it is
    and each image as ``{"type": "image"}``; how many images)."""
    out: list[dict[str, Any]] = []
    images = 0
    for j, x in enumerate(content):
        at = f"{where}[{j}]"
        kind = x.get("type") if isinstance(x, dict) else None
        if kind == "text" and isinstance(x.get("text"), str):
            out.append({"type": "text", "text": x["text"]})
        elif kind == "image_url":
            check_image_part(x, at, policy)
            images += 1
            out.append({"type": "image"})
        else:
            raise BadRequest(f"{at}: a content part must be text or image_url")
    return out, images
