"""The router's tokenizers: prompts become the served model's own token ids in the router.

The router tokenizes once and sends token ids to both workers, so prefill and decode compute
the very same prompt, and KV-aware routing hashes pages of the ids the engine will see.

- ``ByteTokenizer``: the toy model's bytes (no torch, no files).
- ``HFTokenizer``: a Hugging Face model folder (``tokenizer.json`` and its chat template), as
  vLLM loads it; imported lazily so the toy router never pays for ``transformers``.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any, Protocol


class Detokenizer(Protocol):
    def feed(self, ids: list[int]) -> str: ...
    def flush(self) -> str: ...


class Tokenizer(Protocol):
    """What the front door needs of a model's tokenizer."""

    model: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def chat(self, messages: list[dict[str, Any]]) -> str: ...
    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]: ...
    def detokenizer(self) -> Detokenizer: ...
    def token_text(self, t: int) -> str: ...
    def token_bytes(self, t: int) -> list[int]: ...


TOY_MODEL = "pdxfer-toy"


def encode(text: str) -> list[int]:
    """The toy model's byte tokenizer (same as ``toy.model.encode``, without torch)."""
    return list(text.encode("utf-8"))


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The toy chat template: ``<|role|>\\n{content}\\n`` per message, then the reply's start."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class Detok:
    """Token ids to text, holding back an incomplete UTF-8 sequence until it completes."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: list[int]) -> str:
        return self._dec.decode(bytes(t for t in ids if 0 <= t < 256))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    model = TOY_MODEL
    vocab_size = 257  # 256 bytes and EOS

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids: list[int]) -> str:
        return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def chat(self, messages: list[dict[str, Any]]) -> str:
        return chat_prompt(messages)

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return encode(chat_prompt(messages))

    def detokenizer(self) -> Detokenizer:
        return Detok()

    def token_text(self, t: int) -> str:
        return bytes([t]).decode("utf-8", errors="backslashreplace") if 0 <= t < 256 else ""

    def token_bytes(self, t: int) -> list[int]:
        return [t] if 0 <= t < 256 else []


class _PrefixDetok:
    """Incremental text of a subword tokenizer: decode everything so far and emit what grew,
    holding back a trailing replacement character (a multi-byte character still arriving)."""

    def __init__(self, tok: HFTokenizer) -> None:
        self.tok, self.sent = tok, 0
        self.ids: list[int] = []

    def feed(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tok.decode(self.ids)
        stable = len(text.rstrip("\ufffd"))
        out, self.sent = text[self.sent : stable], max(self.sent, stable)
        return out

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        out, self.sent = text[self.sent :], len(text)
        return out


def _config_vocab(path: str) -> int:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return int(json.load(f).get("vocab_size") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


class HFTokenizer:
    """A model folder's tokenizer and chat template, loaded with ``transformers`` (what vLLM
    itself uses, so the router's ids are the ones ``vllm serve`` would make)."""

    def __init__(self, path: str, model: str | None = None) -> None:
        from transformers import AutoTokenizer  # lazy: only engines with HF folders need it

        self._t = AutoTokenizer.from_pretrained(path)
        self.model = model or path
        # ids a client may send: the model's embedding rows, which may outnumber the
        # tokenizer's own tokens (padded vocabularies)
        self.vocab_size = max(len(self._t), _config_vocab(path))

    def encode(self, text: str) -> list[int]:
        return list(self._t.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return str(self._t.decode(ids, skip_special_tokens=True))

    def chat(self, messages: list[dict[str, Any]]) -> str:
        return str(
            self._t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat prompt's ids as the template makes them (its text already holds any BOS
        token, so it is not encoded again with special tokens)."""
        return list(self._t.encode(self.chat(messages), add_special_tokens=False))

    def detokenizer(self) -> Detokenizer:
        return _PrefixDetok(self)

    def token_text(self, t: int) -> str:
        return str(self._t.decode([t]))

    def token_bytes(self, t: int) -> list[int]:
        return list(self.token_text(t).encode("utf-8"))
