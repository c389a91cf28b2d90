"""Sampling: greedy, temperature and top-p, reproducible wherever a position is sampled.

The token at absolute position ``p`` is drawn with a generator seeded from ``(seed, p)``, so
the prefill (which picks the first token) and the decode (every later one) draw from one
seeded stream without sharing any state, and a request sampled twice with the same seed
gives the same text. Temperature 0 is greedy: the colocated reference.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BadRequest
from .model import EOS_ID

MAX_LOGPROBS = 5


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise BadRequest(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stops(self, token: int) -> bool:
        return token == EOS_ID and not self.ignore_eos


def _num(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"field {name!r} must be a number, got {type(v).__name__}")
    return float(v)


def parse_sampling(body: dict[str, Any]) -> Sampling:
    """Sampling fields of a worker request (missing temperature: greedy)."""
    seed = body.get("seed", 0)
    if seed is None:
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise BadRequest("field 'seed' must be an integer in [0, 2^63)")
    ignore = body.get("ignore_eos", False)
    if not isinstance(ignore, bool):
        raise BadRequest("field 'ignore_eos' must be a boolean")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int)):
        raise BadRequest("field 'logprobs' must be an integer or null")
    return Sampling(_num(body, "temperature", 0.0), _num(body, "top_p", 1.0), seed, ignore, lp)


def _generator(seed: int, position: int) -> torch.Generator:
    d = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(d, "little") >> 1)


def probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution a token is drawn from (float64; temperature and top-p applied)."""
    p = torch.softmax(logits.to(torch.float64) / max(s.temperature, 1e-6), dim=-1)
    if s.top_p < 1.0:
        order = torch.argsort(p, descending=True)
        keep = torch.cumsum(p[order], 0) - p[order] < s.top_p  # the smallest set reaching top_p
        mask = torch.zeros_like(p, dtype=torch.bool)
        mask[order[keep]] = True
        p = torch.where(mask, p, torch.zeros_like(p))
        p = p / p.sum()
    return p


def sample(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """The token at ``position`` given the logits that predict it."""
    if s.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probs(logits, s), 1, generator=_generator(s.seed, position)))


def top_logprobs(logits: torch.Tensor, s: Sampling, token: int) -> dict[str, Any]:
    """The chosen token's log-probability and the ``s.logprobs`` most likely tokens (under the
    temperature used, or the plain softmax when greedy)."""
    lp = torch.log_softmax(logits.to(torch.float64) / (s.temperature or 1.0), dim=-1)
    k = s.logprobs or 0
    top = torch.topk(lp, k) if k else None
    return {
        "token_id": token,
        "logprob": float(lp[token]),
        "top": {int(i): float(v) for v, i in zip(top.values, top.indices)} if top else {},
    }
