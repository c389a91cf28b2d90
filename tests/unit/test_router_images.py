"""Images at the router's front door: ``image_url`` parts are checked and bounded before any
worker sees them (size, base64, type, count; remote URLs only when allowed), forwarded as
the client sent them, and a text-only chat is parsed as before."""

from __future__ import annotations

import base64
import copy
import random
import zlib
from pathlib import Path
from typing import Any

import pytest

from pdxfer.serving.errors import BadRequest
from pdxfer.serving.router.backends import ToyBackend
from pdxfer.serving.router.media import DEFAULT, MediaPolicy
from pdxfer.serving.router.openai_api import parse_chat


def png(w: int = 4, h: int = 4, seed: int = 0) -> bytes:
    """A real PNG file (RGB, ``w`` x ``h``), made without an imaging library."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (len(data).to_bytes(4, "big") + kind + data
                + zlib.crc32(kind + data).to_bytes(4, "big"))
    rng = random.Random(seed)  # noise: it does not compress
    rows = b"".join(b"\x00" + rng.randbytes(3 * w) for _ in range(h))
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + b"\x08\x02\x00\x00\x00"
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def chat(*parts: dict[str, Any], text: str = "what is this?") -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": text},
                                                      *parts]}], "max_tokens": 4}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


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
    ask = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]})
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
    assert "detail" in refused(chat({"type": "image_url", "image_url": {
        "url": data_url(png()), "detail": "ultra"}}))


def test_the_toy_engine_refuses_images_with_a_400() -> None:
    ask = parse_chat(chat(image(data_url(png()))))
    with pytest.raises(BadRequest, match="images"):
        ToyBackend().check(ask)
    ToyBackend().check(parse_chat({"messages": [{"role": "user", "content": "hi"}]}))


def test_the_routers_view_of_an_image_chat_has_one_image_token_per_image(
        tmp_path: Path) -> None:
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
    job = Attempt(ask, ask.prompts[0], 7, Prefill("http://p", "127.0.0.1:1"),
                  Decode("http://d"), 1)
    leg = b._sampling(job)
    assert leg["messages"] == sent and "prompt" not in leg
    assert _path(job) == "/v1/chat/completions"
    text = parse_chat({"messages": [{"role": "user", "content": "hi"}]})
    tjob = Attempt(text, text.prompts[0], 7, job.pf, job.dc, 2)
    assert b._sampling(tjob)["prompt"] == text.prompts[0] and _path(tjob) == "/v1/completions"
    lp = {"content": [{"token": "token_id:5", "logprob": -0.5, "top_logprobs": [
        {"token": "token_id:5", "logprob": -0.5}, {"token": "token_id:9", "logprob": -1.5}]}]}
    assert _chat_logprobs(lp) == [{"token_id": 5, "logprob": -0.5, "top": {5: -0.5, 9: -1.5}}]
