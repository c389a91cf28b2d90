"""Images at the router's front door: ``image_url`` parts are checked and bounded before any
worker sees them (size, base64, type, pixels as the header declares them, count; remote URLs
only when allowed), forwarded as the client sent them, and a text-only chat is parsed as
before. (``test_router_image_size.py``: the header reader itself.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from pdxfer.serving.errors import BadRequest
from pdxfer.serving.router.backends import ToyBackend
from pdxfer.serving.router.media import DEFAULT, MediaPolicy
from pdxfer.serving.router.openai_api import parse_chat
from tests.harness.images import (
    WEBP_LOSSY,
    chat,
    data_url,
    gif,
    image,
    jpeg,
    png,
    riff_webp,
    webp_lossless,
)


def refused(body: dict[str, Any], policy: MediaPolicy = DEFAULT) -> str:
    with pytest.raises(BadRequest) as e:
        parse_chat(body, media=policy)
    return str(e.value)


def test_image_parts_are_forwarded_as_the_client_sent_them() -> None:
    body = chat(image(data_url(png())), image(data_url(png(seed=9))))
    sent = copy.deepcopy(body["messages"])
    ask = parse_chat(body)
    assert ask.messages == sent
    assert ask.prompts and ask.prompts[0]


def test_a_text_only_chat_is_parsed_as_before() -> None:
    ask = parse_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
                }
            ]
        }
    )
    plain = parse_chat({"messages": [{"role": "user", "content": "hi there"}]})
    assert ask.messages is None and ask.prompts == plain.prompts
    assert ask.prompt_texts == ["<|user|>\nhi there\n<|assistant|>\n"]


def test_an_oversized_data_url_is_refused_before_it_is_decoded() -> None:
    small = MediaPolicy(max_image_bytes=1000)
    assert "over 1000 bytes" in refused(chat(image(data_url(png(40, 40)))), small)
    just = png(4, 4)
    parse_chat(chat(image(data_url(just))), media=MediaPolicy(max_image_bytes=len(just)))
    # base64 whose length passes the pre-check but decodes past the cap by a byte
    one_over = MediaPolicy(max_image_bytes=len(just) - 1)
    assert "over" in refused(chat(image(data_url(just))), one_over)


def test_malformed_base64_is_refused() -> None:
    good = data_url(png())
    for url in (good[:-3] + "!!=", good + "A", "data:image/png;base64,", good.replace("Q", " ")):
        assert "base64" in refused(chat(image(url))) or "empty" in refused(chat(image(url)))


def test_data_that_is_not_the_image_type_it_claims_is_refused() -> None:
    assert "not a image/jpeg" in refused(chat(image(data_url(png(), "image/jpeg"))))
    assert "not a image/png" in refused(chat(image(data_url(b"GIF89a" + bytes(20)))))
    assert "not accepted" in refused(chat(image(data_url(png(), "image/svg+xml"))))
    assert "data URL" in refused(chat(image("file:///etc/passwd")))


def test_a_remote_url_is_refused_unless_the_operator_allows_it() -> None:
    for url in ("http://169.254.169.254/latest/meta-data", "HTTPS://example.com/cat.png"):
        assert "remote image URLs are not accepted" in refused(chat(image(url)))
        ask = parse_chat(chat(image(url)), media=MediaPolicy(allow_remote=True))
        assert ask.messages is not None


def test_too_many_images_and_malformed_parts_are_refused() -> None:
    one = image(data_url(png()))
    assert "at most 2 images" in refused(chat(one, one, one), MediaPolicy(max_images=2))
    assert "'url' string" in refused(chat({"type": "image_url", "image_url": "x"}))
    assert "text or image_url" in refused(chat({"type": "input_audio", "input_audio": {}}))
    assert "detail" in refused(
        chat({"type": "image_url", "image_url": {"url": data_url(png()), "detail": "ultra"}})
    )


def test_the_toy_engine_refuses_images_with_a_400() -> None:
    ask = parse_chat(chat(image(data_url(png()))))
    with pytest.raises(BadRequest, match="images"):
        ToyBackend().check(ask)
    ToyBackend().check(parse_chat({"messages": [{"role": "user", "content": "hi"}]}))


def test_the_routers_view_of_an_image_chat_has_one_image_token_per_image(tmp_path: Path) -> None:
    from pdxfer.serving.router.tokenizers import HFTokenizer
    from tests.harness.hf_vlm import IMAGE_TOKEN, build_vlm

    tok = HFTokenizer(str(build_vlm(tmp_path / "vlm")))
    image_id = tok.encode(IMAGE_TOKEN)[-1]
    ask = parse_chat(chat(image(data_url(png())), image(data_url(png(seed=3)))), tok)
    assert ask.prompts[0].count(image_id) == 2
    text = parse_chat({"messages": [{"role": "user", "content": "what is this?"}]}, tok)
    assert image_id not in text.prompts[0] and text.messages is None


def test_both_vllm_legs_get_the_clients_messages_and_text_keeps_token_ids() -> None:
    from pdxfer.serving.router.backends import Attempt, Decode, Prefill
    from pdxfer.serving.router.vllm import VllmBackend, _chat_logprobs, _path

    b = VllmBackend()
    body = chat(image(data_url(png())))
    sent = copy.deepcopy(body["messages"])
    ask = parse_chat(body)
    job = Attempt(ask, ask.prompts[0], 7, Prefill("http://p", "127.0.0.1:1"), Decode("http://d"), 1)
    leg = b._sampling(job)
    assert leg["messages"] == sent and "prompt" not in leg
    assert _path(job) == "/v1/chat/completions"
    text = parse_chat({"messages": [{"role": "user", "content": "hi"}]})
    tjob = Attempt(text, text.prompts[0], 7, job.pf, job.dc, 2)
    assert b._sampling(tjob)["prompt"] == text.prompts[0] and _path(tjob) == "/v1/completions"
    lp = {
        "content": [
            {
                "token": "token_id:5",
                "logprob": -0.5,
                "top_logprobs": [
                    {"token": "token_id:5", "logprob": -0.5},
                    {"token": "token_id:9", "logprob": -1.5},
                ],
            }
        ]
    }
    assert _chat_logprobs(lp) == [{"token_id": 5, "logprob": -0.5, "top": {5: -0.5, 9: -1.5}}]


def _lossy(w: int, h: int) -> bytes:
    """``WEBP_LOSSY`` with its VP8 frame header declaring ``w`` x ``h``."""
    return WEBP_LOSSY[:26] + w.to_bytes(2, "little") + h.to_bytes(2, "little") + WEBP_LOSSY[30:]


BOMBS = {
    "png 50000x50000": (png(50_000, 50_000, pixels=False), "image/png"),
    "png 1x2^30": (png(1, 1 << 30, pixels=False), "image/png"),
    "gif screen 65535x65535": (gif(65_535, 65_535, frames=((0, 0, 1, 1),)), "image/gif"),
    "gif 1x1 screen, frame reaching 65536x65536": (
        gif(1, 1, frames=((0, 0, 1, 1), (65_535, 65_535, 1, 1))),
        "image/gif",
    ),
    "webp lossless 16384x16384, a real bomb": (webp_lossless(16_384, 16_384), "image/webp"),
    "webp lossy 16383x16383": (_lossy(16_383, 16_383), "image/webp"),
    "webp canvas 2^24x2^24": (riff_webp((b"VP8X", b"\x00" * 4 + b"\xff" * 6)), "image/webp"),
    "jpeg 65535x65535": (jpeg(65_535, 65_535, scan=False), "image/jpeg"),
    "jpeg 4097x4096": (jpeg(4097, 4096, scan=False), "image/jpeg"),
}
"""Files of a few bytes to a few KiB declaring more pixels than the default cap."""


@pytest.mark.parametrize("name", list(BOMBS))
def test_an_image_declaring_more_pixels_than_allowed_is_refused_before_any_worker(
    name: str,
) -> None:
    """A few bytes can declare a billion pixels, which every worker would decode."""
    raw, mime = BOMBS[name]
    assert len(raw) < 4096
    assert "pixels" in refused(chat(image(data_url(raw, mime))))


@pytest.mark.parametrize(
    "make,mime",
    [(png, "image/png"), (gif, "image/gif"), (webp_lossless, "image/webp"), (jpeg, "image/jpeg")],
)
def test_the_pixel_cap_is_a_setting_and_images_within_it_pass(make: Any, mime: str) -> None:
    small = MediaPolicy(max_image_pixels=15)
    assert "over 15 pixels (4x4)" in refused(chat(image(data_url(make(4, 4), mime))), small)
    parse_chat(chat(image(data_url(make(3, 5), mime))), media=small)


@pytest.mark.parametrize("make,mime", [(webp_lossless, "image/webp"), (jpeg, "image/jpeg")])
def test_a_real_image_of_exactly_the_default_cap_passes_one_row_more_does_not(
    make: Any, mime: str
) -> None:
    assert DEFAULT.max_image_pixels == 4096 * 4096
    parse_chat(chat(image(data_url(make(4096, 4096), mime))))
    assert "(4096x4097)" in refused(chat(image(data_url(make(4096, 4097), mime))))


def test_a_header_that_cannot_be_read_is_refused() -> None:
    broken = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40  # the signature, then no IHDR
    assert "header cannot be read" in refused(chat(image(data_url(broken))))
    cut = jpeg(8, 8)[:40]
    assert "header cannot be read" in refused(chat(image(data_url(cut, "image/jpeg"))))
