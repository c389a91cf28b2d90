"""Text the router streams: UTF-8 split across tokens, stop strings split across deltas."""

from __future__ import annotations

from pdxfer.serving.router.openai_api import Detok, StopText, chat_prompt, encode


def test_a_multibyte_character_split_over_two_tokens_streams_whole() -> None:
    ids = encode("é€😀 ok")  # 2-, 3- and 4-byte characters
    d = Detok()
    deltas = [d.feed([t]) for t in ids] + [d.flush()]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == "é€😀 ok"
    assert deltas[0] == "" and deltas[1] == "é"  # the first byte alone is held back


def test_joined_deltas_equal_the_whole_decode_even_for_invalid_bytes() -> None:
    ids = [0xE2, 0x82, 65, 0xFF, 0xF0, 0x9F, 0x98, 0x80, 0xC3]
    d = Detok()
    joined = "".join(d.feed([t]) for t in ids) + d.flush()
    assert joined == bytes(ids).decode("utf-8", errors="replace")


def test_a_stop_string_split_across_deltas_is_cut_before_it() -> None:
    s = StopText(["STOP"])
    out = "".join(s.feed(x) for x in ["abc S", "TO", "P and more"])
    assert out == "abc " and s.stopped
    s2 = StopText(["STOP"])
    out2 = "".join(s2.feed(x) for x in ["abc S", "TOx"]) + s2.flush()
    assert out2 == "abc STOx" and not s2.stopped


def test_chat_template_is_the_documented_one() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat_prompt(msgs) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
