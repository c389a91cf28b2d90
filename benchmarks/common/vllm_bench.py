"""What the vLLM benchmarks (``vllm``, ``stream``, ``models``) and traces share:
one streamed request timed to its first token, deterministic prompts, percentiles, and the
one-line reason a server did not start. Kept here so both measure the same way."""

from __future__ import annotations

import re
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import OpenAI

from benchmarks.common.runner import emit
from pdxfer.serving.vllm.servers import ServerNotReady

NIXL_SHIM = Path(__file__).resolve().parent / "nixl_shim"
"""Put on a vLLM process's PYTHONPATH so NixlConnector imports ``nixl`` (``nixl-cu12``)."""


@dataclass(frozen=True)
class Reply:
    """One streamed completion: seconds to its first token, the generated ids, and the
    router's ``pdxfer`` extension (empty when a bare vLLM server answered)."""

    ttft: float
    ids: list[int]
    ext: dict[str, Any] = field(default_factory=dict)


def stream_request(
    url: str,
    prompt: list[int],
    max_tokens: int,
    timeout: float,
    model: str = "llama",
    logprobs: int | None = None,
) -> Reply:
    """Greedy, ``ignore_eos``, streamed through the official client. The first token is the
    first chunk that carries one: a vLLM server's chunks carry ``token_ids``; pdxfer's router
    sends a chunk per token only when it has text or logprobs (ask ``logprobs=0`` through it,
    so a token whose text is still an incomplete UTF-8 sequence is a chunk too) and every id
    in its final ``pdxfer`` chunk."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    t0 = time.perf_counter()
    first = None
    ids: list[int] = []
    ext: dict[str, Any] = {}
    for chunk in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        logprobs=logprobs,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ):
        extra = chunk.model_extra or {}
        if isinstance(extra.get("pdxfer"), dict):
            ext = extra["pdxfer"]
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        got = list(getattr(ch, "token_ids", None) or [])
        lps = ch.logprobs.tokens if ch.logprobs is not None and ch.logprobs.tokens else []
        if first is None and (got or lps or ch.text):
            first = time.perf_counter() - t0
        ids += got
    if ext.get("token_ids") is not None and not ids:
        ids = [int(t) for t in ext["token_ids"]]
    assert first is not None, "no token streamed"
    return Reply(first, ids, ext)


def request_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The body ``stream_request`` sends (without ``logprobs``): what a front door is given
    for one benchmark request, and what it reshapes into a prefill's request."""
    return {
        "model": "llama",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }


def ttft(url: str, prompt: list[int], max_tokens: int, timeout: float) -> tuple[float, list[int]]:
    """(seconds to the first token, the generated ids) of one streamed request."""
    r = stream_request(url, prompt, max_tokens, timeout)
    return r.ttft, r.ids


def tokens(seed: int, n: int) -> list[int]:
    """``n`` prompt ids drawn from ``seed`` (inside the ``local_model`` vocabulary, no specials):
    different seeds give prompts that share no prefix block."""
    return [(seed * 7919 + 37 * i) % 700 + 300 for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    """The median for q 0.5, else the nearest rank."""
    if q == 0.5:
        return statistics.median(xs)
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def root_cause(log: Path) -> str:
    """The first exception a server's log reports, with the frame that raised it: why it did
    not start, in one line (its tail is vLLM's generic "Engine core initialization failed")."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for i, line in enumerate(lines):
        m = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if m is None or " WARNING " in line:
            continue
        frames = [j for j in range(i) if re.search(r'File "[^"]+", line \d+, in ', lines[j])]
        if not frames:
            return m.group(0)
        ours = [j for j in frames if "/vllm/" in lines[j]]  # vLLM's call, not torch's inside
        f = (ours or frames)[-1]
        where = re.search(r'File "([^"]+)", line (\d+), in (\S+)', lines[f])
        code = lines[f + 1].split("]", 1)[-1].strip() if f + 1 < i else ""
        assert where is not None
        return (
            f"{Path(where.group(1)).name}:{where.group(2)} in {where.group(3)}: {code}: "
            f"{m.group(0)}"
        )
    return ""


def run_and_report(
    name: str, run: Callable[[], dict[str, Any]], json_path: str | None
) -> dict[str, Any] | None:
    """The trace scripts' ending, as ``runner.run`` ends a benchmark: SIGTERM unwinds like
    Ctrl-C (every server is stopped by pid in the run's ``finally``), a server not ready by
    its deadline is one line on stderr (the caller exits 2), and the results are printed as
    JSON and written to ``json_path`` when given. Returns the results, or None if a server
    did not start."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        res = run()
    except ServerNotReady as e:
        print(f"[{name}] error: {e}", file=sys.stderr)
        return None
    emit(res, Path(json_path) if json_path else None)
    return res
