"""OpenAI's completions and chat API: parsing, text and response shapes.

No torch and no network here: the router parses a client's request into an ``Ask`` with the
served model's tokenizer (``tokenizers.py``), and turns the decode's token events into OpenAI
text, chunks and responses.

- Every known field is type-checked (a wrong type is a 400); unknown fields are accepted, as
  OpenAI does; a feature the toy model does not have (penalties, ``best_of``, ``logit_bias``,
  ``suffix``) is refused with a 400 that says so instead of being ignored.
- Text is decoded incrementally: an incomplete UTF-8 sequence is held back until its last
  byte arrives, so the joined stream equals the non-streamed text.
- Chat: the tokenizer's template (the toy's is documented in docs/serving.md). Image parts
  are checked by ``media.py`` and kept as the client sent them (``Ask.messages``), for the
  engine to render; text-only chat is rendered here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadRequest
from .media import DEFAULT as MEDIA
from .media import MediaPolicy, parse_parts
from .tokenizers import TOY_MODEL, ByteTokenizer, Detok, Tokenizer, chat_prompt, encode

MODEL = TOY_MODEL
BYTES = ByteTokenizer()
MAX_N = 8
MAX_STOP = 4
MAX_SPEC_K = 8
MAX_LOGPROBS = 5
ROLES = ("system", "user", "assistant", "tool", "developer")


__all__ = ["Detok", "chat_prompt", "encode"]  # the toy tokenizer's helpers, re-exported


@dataclass(slots=True)
class Ask:
    """One client request, validated: prompts as token ids plus how to generate."""

    chat: bool
    prompts: list[list[int]]
    prompt_texts: list[str]
    max_tokens: int = 16
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    echo: bool = False
    logprobs: int | None = None
    spec_k: int = 0
    ignore_eos: bool = False
    model: str = MODEL
    tenant: str = ""
    """Whose request this is (from the API key): scopes prefix reuse."""
    tok: Tokenizer = BYTES
    """The served model's tokenizer: prompts were encoded with it, output is rendered by it."""
    messages: list[dict[str, Any]] | None = None
    """A chat with images: its messages as the client sent them (content parts unchanged),
    for the engine to render on both legs. ``prompts`` then holds the router's rendering with
    one image token per image (for routing, not for the engine). None: text only."""


class _Body:
    """Typed access to a JSON body's known fields."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.b = body

    def get(self, name: str, kinds: tuple[type, ...], default: Any = None, what: str = "") -> Any:
        v = self.b.get(name)
        if v is None:
            return default
        if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
            raise BadRequest(
                f"'{name}' must be {what or ' or '.join(k.__name__ for k in kinds)}"
                f", got {type(v).__name__}"
            )
        return v

    def int_in(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        v = self.get(name, (int,), default, "an integer")
        if v is not None and not lo <= v <= hi:
            raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {v}")
        return v

    def num_in(self, name: str, default: float, lo: float, hi: float) -> float:
        v = float(self.get(name, (int, float), default, "a number"))
        if not lo <= v <= hi:
            raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {v}")
        return v

    def unsupported(self, name: str, ok: Any, model: str = MODEL) -> None:
        v = self.b.get(name)
        if v is not None and v != ok and not (isinstance(ok, tuple) and v in ok):
            raise BadRequest(f"'{name}' is not supported by {model} (got {v!r})")


def _common(b: _Body, chat: bool, tok: Tokenizer) -> dict[str, Any]:
    out: dict[str, Any] = {"tok": tok}
    model = b.get("model", (str,), tok.model, "a string")
    out["model"] = model
    mt = b.int_in("max_completion_tokens", None, 1, 1 << 20) if chat else None
    out["max_tokens"] = mt if mt is not None else b.int_in("max_tokens", 16, 1, 1 << 20)
    out["n"] = b.int_in("n", 1, 1, MAX_N)
    out["stream"] = b.get("stream", (bool,), False, "a boolean")
    so = b.get("stream_options", (dict,), {}, "an object")
    inc = so.get("include_usage", False)
    if not isinstance(inc, bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean")
    out["include_usage"] = inc
    out["temperature"] = b.num_in("temperature", 1.0, 0.0, 2.0)
    out["top_p"] = b.num_in("top_p", 1.0, 1e-9, 1.0)
    out["seed"] = b.int_in("seed", None, -(1 << 63), (1 << 63) - 1)
    stop = b.get("stop", (str, list), [], "a string or a list of strings")
    if isinstance(stop, str):
        stop = [stop]
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be up to {MAX_STOP} non-empty strings")
    out["stop"] = stop
    out["spec_k"] = b.int_in("speculative_k", 0, 0, MAX_SPEC_K)
    out["ignore_eos"] = b.get("ignore_eos", (bool,), False, "a boolean")
    if out["spec_k"] and out["temperature"] != 0:
        raise BadRequest("'speculative_k' needs temperature 0 (speculative decoding is greedy)")
    for name in ("presence_penalty", "frequency_penalty"):
        b.unsupported(name, (0, 0.0), tok.model)
        b.get(name, (int, float), 0, "a number")
    b.unsupported("logit_bias", ({},), tok.model)
    b.get("user", (str,), None, "a string")
    return out


def parse_completion(body: dict[str, Any], tok: Tokenizer = BYTES) -> Ask:
    b = _Body(body)
    p = body.get("prompt")
    vocab = tok.vocab_size
    if isinstance(p, str):
        texts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        texts = list(p)
    elif isinstance(p, list) and p and all(_is_ids(x, vocab) for x in p):
        texts = None
        prompts = [list(x) for x in p]
    elif _is_ids(p, vocab):
        texts = None
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        raise BadRequest(
            f"'prompt' must be a string, a list of strings, a list of token ids "
            f"in [0, {vocab}) or a list of such lists"
        )
    if len(texts if texts is not None else prompts) > MAX_N:
        raise BadRequest(f"at most {MAX_N} prompts per request")
    if texts is None:
        texts = [tok.decode(x) for x in prompts]
    else:
        prompts = [tok.encode(x) for x in texts]
    if not prompts or any(not x for x in prompts):
        raise BadRequest("'prompt' is empty")
    c = _common(b, chat=False, tok=tok)
    b.unsupported("best_of", (1,), tok.model)
    b.unsupported("suffix", ("",), tok.model)
    lp = b.int_in("logprobs", None, 0, MAX_LOGPROBS)
    echo = b.get("echo", (bool,), False, "a boolean")
    return Ask(False, prompts, texts, logprobs=lp, echo=echo, **c)


def parse_chat(body: dict[str, Any], tok: Tokenizer = BYTES, media: MediaPolicy = MEDIA) -> Ask:
    b = _Body(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list")
    clean, parts, images = [], [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role in {ROLES}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text, and images (media.py)
            shown, k = parse_parts(content, f"messages[{i}].content", media)
            images += k
            parts.append({"role": m["role"], "content": shown})
            content = "".join(x["text"] for x in shown if x["type"] == "text")
        elif isinstance(content, str):
            parts.append({"role": m["role"], "content": content})
        else:
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        clean.append({"role": m["role"], "content": content})
    if images > media.max_images:
        raise BadRequest(f"at most {media.max_images} images per request, got {images}")
    c = _common(b, chat=True, tok=tok)
    want = b.get("logprobs", (bool,), False, "a boolean")
    top = b.int_in("top_logprobs", None, 0, MAX_LOGPROBS)
    try:
        text, ids = tok.chat(clean), tok.chat_ids(clean)
        if images:  # the router's view (one image token per image), if the template can
            try:
                text, ids = tok.chat(parts), tok.chat_ids(parts)
            except Exception:  # noqa: BLE001 - a template without parts: the text view
                pass
    except Exception as e:  # a template may refuse a conversation (roles out of order)
        raise BadRequest(f"'messages': the chat template refused them: {e}") from None
    return Ask(
        True,
        [ids],
        [text],
        logprobs=(top or 0) if want else None,
        messages=[{"role": m["role"], "content": m.get("content")} for m in msgs]
        if images
        else None,
        **c,
    )


def _is_ids(x: Any, vocab: int) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in x)
    )


class StopText:
    """Cuts the text before the first stop string, never emitting a stop string's prefix
    that may still complete (it is held until it cannot)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        s = self._held + text
        hits = [i for i in (s.find(x) for x in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return s[: min(hits)]
        keep = 0
        for x in self.stops:
            for k in range(min(len(x) - 1, len(s)), 0, -1):
                if s.endswith(x[:k]):
                    keep = max(keep, k)
                    break
        self._held = s[len(s) - keep :] if keep else ""
        return s[: len(s) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


@dataclass(slots=True)
class Choice:
    """One generated choice as the router assembles it."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


def completion_logprobs(
    tok: Tokenizer, lps: list[dict[str, Any]], offset0: int = 0
) -> dict[str, Any]:
    token_text = tok.token_text
    tokens = [token_text(x["token_id"]) for x in lps]
    offsets, at = [], offset0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [x["logprob"] for x in lps],
        "top_logprobs": [{token_text(int(k)): v for k, v in x["top"].items()} for x in lps],
        "text_offset": offsets,
    }


def chat_logprobs(tok: Tokenizer, lps: list[dict[str, Any]]) -> dict[str, Any]:
    def one(t: int, lp: float) -> dict[str, Any]:
        return {"token": tok.token_text(t), "logprob": lp, "bytes": tok.token_bytes(t)}

    return {
        "content": [
            {
                **one(x["token_id"], x["logprob"]),
                "top_logprobs": [one(int(k), v) for k, v in x["top"].items()],
            }
            for x in lps
        ]
    }


def usage(ask: Ask, choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(len(p) for p in ask.prompts)
    engine = [int(c.stats["prompt_tokens"]) for c in choices if "prompt_tokens" in c.stats]
    if ask.messages is not None and engine:  # images: the engine's count (their tokens too)
        prompt = engine[0]
    done = sum(len(c.token_ids) for c in choices)
    cached = sum(int(c.stats.get("restored_tokens", 0)) for c in choices if c.index % ask.n == 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "total_tokens": prompt + done,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def extension(c: Choice) -> dict[str, Any]:
    """pdxfer's own per-choice figures (the documented ``pdxfer`` field)."""
    s = c.stats
    out = {
        "room": s.get("room"),
        "prefill": s.get("prefill"),
        "decode": s.get("decode"),
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "restored_tokens": s.get("restored_tokens", 0),
        "bytes": s.get("bytes", 0),
        "decode_ttft_s": s.get("ttft_s"),
        "seconds": s.get("seconds"),
    }
    for k in (
        "queued_steps",
        "end_step",
        "restored_l2_tokens",
        "restored_l3_tokens",
        "prefill_reused_tokens",
        "prefill_layer_sends",
        "repaired_tokens",
        "ranks",
        "decode_dp",
        "prefill_dp",
        "prefill_s",
        "prefill_cached_tokens",
        "decode_cached_tokens",
        "dispatch",
        "kv_wait_s",
        "kv_local_s",
        "kv_net_s",
    ):
        if k in s:
            out[k] = s[k]
    if "accept_lengths" in s:
        out["accept_lengths"] = s["accept_lengths"]
        out["mean_accept_length"] = s["mean_accept_length"]
    return out


def response(ask: Ask, rid: str, choices: list[Choice]) -> dict[str, Any]:
    created = int(time.time())
    if ask.chat:
        body_choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "logprobs": chat_logprobs(ask.tok, c.logprobs)
                if ask.logprobs is not None
                else None,
            }
            for c in choices
        ]
        obj = "chat.completion"
    else:
        body_choices = []
        for c in choices:
            echo = ask.prompt_texts[c.index // ask.n] if ask.echo else ""
            body_choices.append(
                {
                    "index": c.index,
                    "text": echo + c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": completion_logprobs(ask.tok, c.logprobs, len(echo))
                    if ask.logprobs is not None
                    else None,
                }
            )
        obj = "text_completion"
    ext = extension(choices[0]) if choices else {}
    if len(choices) > 1:
        ext["choices"] = [extension(c) for c in choices]
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": ask.model,
        "choices": body_choices,
        "usage": usage(ask, choices),
        "pdxfer": ext,
    }


def chunk(
    ask: Ask,
    rid: str,
    created: int,
    index: int,
    text: str | None,
    finish_reason: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed chunk of one choice (``text`` None: no text in it)."""
    if ask.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        ch: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": chat_logprobs(ask.tok, logprobs) if logprobs else None,
        }
        obj = "chat.completion.chunk"
    else:
        ch = {
            "index": index,
            "text": text or "",
            "finish_reason": finish_reason,
            "logprobs": completion_logprobs(ask.tok, logprobs) if logprobs else None,
        }
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": ask.model, "choices": [ch]}


def usage_chunk(ask: Ask, rid: str, created: int, choices: list[Choice]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if ask.chat else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": ask.model,
        "choices": [],
        "usage": usage(ask, choices),
    }


def models(name: str = MODEL) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pdxfer"}],
    }
