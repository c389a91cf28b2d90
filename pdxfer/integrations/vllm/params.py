"""``kv_transfer_params``: what a router, the prefill and the decode say to each other.

1. to the prefill (``max_tokens=1``): ``do_remote_decode: true``, optional ``pdxfer_room``
   (a 63-bit int; else the prefill draws one) and ``pdxfer_decode`` (binds the room);
2. its answer: ``do_remote_prefill: true``, ``pdxfer_room``, ``pdxfer_bootstrap``,
   ``pdxfer_instance``, ``pdxfer_dp`` (the data-parallel rank that computed it: the decode
   loads from that rank's endpoints), ``pdxfer_num_tokens`` (the prompt tokens whose KV it
   holds);
3. the decode gets those keys unchanged (sequential form) or, in the early form, the same
   keys without ``pdxfer_num_tokens`` at the same time as the prefill's request (with
   ``pdxfer_dp`` when the prefill runs data parallel: the router then sent the prefill's
   request to that rank, vLLM's ``X-data-parallel-rank`` header).

The two sides pair by room only (vLLM suffixes its request ids). Params are client input:
every field is type- and range-checked here, and malformed pdxfer params count as none
(logged), never a crash. The full protocol: docs/vllm.md.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

from pdxfer import ConfigError, parse_hostport

log = logging.getLogger(__name__)

ROOM_MAX = (1 << 63) - 1
MAX_NAME = 128
DP_MAX = 4096
"""Data-parallel ranks a ``pdxfer_dp`` may name (the bootstrap's bound)."""


@dataclass(frozen=True, slots=True)
class PrefillAsk:
    """What a prefill request asks for: send its KV to a decode (room, bound decode)."""

    room: int
    decode: str | None
    dp: int | None = None
    """The data-parallel rank the router sent the request to (``pdxfer_dp``)."""


@dataclass(frozen=True, slots=True)
class DecodeAsk:
    """What a decode request asks for: load its prompt's KV from that prefill and room."""

    room: int
    bootstrap: str
    instance: str | None
    early: bool = False
    dp: int | None = None
    """The prefill's data-parallel rank holding the KV (``pdxfer_dp``; None: the bootstrap
    picks, which is right only for a prefill of one DP rank)."""
    """Sent at dispatch, beside the prefill's request (no ``pdxfer_num_tokens``): the
    prefill may not have the request yet, so it holds this decode's ask until its deadline."""


def _room(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= ROOM_MAX:
        return None
    return v


def _name(v: Any) -> str | None:
    if isinstance(v, str) and 0 < len(v) <= MAX_NAME:
        return v
    return None


def _dp(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < DP_MAX:
        return None
    return v


def _hostport(v: Any) -> str | None:
    """A well-formed ``host:port`` (normalised), else None: malformed like any other field,
    so it is never dialled."""
    try:
        return parse_hostport(v, "pdxfer_bootstrap")
    except ConfigError:
        return None


def draw_room() -> int:
    """A fresh 63-bit room (unique while a request lives, with overwhelming probability)."""
    return secrets.randbits(63)


def prefill_ask(params: dict[str, Any] | None) -> PrefillAsk | None:
    """The prefill's view of a request: None unless it asks for a remote decode."""
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
        return None
    room = params.get("pdxfer_room")
    decode = params.get("pdxfer_decode")
    dp = params.get("pdxfer_dp")
    if dp is not None and _dp(dp) is None:
        log.warning(
            "kv_transfer_params.pdxfer_dp %r is not a data-parallel rank: ignored, "
            "the request is served without a remote decode",
            dp,
        )
        return None
    if room is not None and _room(room) is None:
        log.warning(
            "kv_transfer_params.pdxfer_room %r is not a 63-bit integer: ignored, "
            "the request is served without a remote decode",
            room,
        )
        return None
    if decode is not None and _name(decode) is None:
        log.warning(
            "kv_transfer_params.pdxfer_decode %r is not an instance name: ignored, "
            "the request is served without a remote decode",
            decode,
        )
        return None
    return PrefillAsk(draw_room() if room is None else room, decode, dp)


def decode_ask(params: dict[str, Any] | None) -> DecodeAsk | None:
    """The decode's view of a request: None unless it carries a prefill's pdxfer answer."""
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    room, boot = _room(params.get("pdxfer_room")), _hostport(params.get("pdxfer_bootstrap"))
    inst, dp = params.get("pdxfer_instance"), params.get("pdxfer_dp")
    if (
        room is None
        or boot is None
        or (inst is not None and _name(inst) is None)
        or (dp is not None and _dp(dp) is None)
    ):
        if any(k.startswith("pdxfer_") for k in params):
            log.warning(
                "kv_transfer_params without a valid pdxfer_room / pdxfer_bootstrap / pdxfer_dp "
                "(%r): the decode computes the prompt itself",
                params,
            )
        return None
    return DecodeAsk(room, boot, inst, early="pdxfer_num_tokens" not in params, dp=dp)


def prefill_answer(
    room: int, bootstrap: str, instance: str, num_tokens: int, dp: int = 0
) -> dict[str, Any]:
    """What ``request_finished`` returns on the prefill (the router forwards it); ``dp``:
    the data-parallel rank that computed the KV."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pdxfer_room": room,
        "pdxfer_bootstrap": bootstrap,
        "pdxfer_instance": instance,
        "pdxfer_dp": dp,
        "pdxfer_num_tokens": num_tokens,
    }
