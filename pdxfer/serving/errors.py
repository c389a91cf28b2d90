"""Serving-layer failure kinds; each maps to one HTTP status so callers can branch on it."""

from __future__ import annotations

from pdxfer import PdxferError


class ServingError(PdxferError):
    """Base of serving failures; ``status`` is the HTTP status a worker or router answers."""

    kind = "serving"
    status = 500


class BadRequest(ServingError):
    """The client's request is malformed or out of range: retrying it elsewhere cannot help."""

    kind = "bad_request"
    status = 400


class Forbidden(ServingError):
    """The request asks for something this worker must not do for anyone (a bootstrap server
    it does not trust): retrying it elsewhere cannot help either."""

    kind = "forbidden"
    status = 403


class OutOfCapacity(ServingError):
    """No pages or aux slots free right now: another pair (or a later try) may serve it."""

    kind = "capacity"
    status = 503


class TransferFailed(ServingError):
    """The KV transfer for a request failed; the message carries the transfer layer's reason."""

    kind = "transfer"
    status = 502


class WorkerBroken(ServingError):
    """A rank of this worker's TP group is gone: the worker cannot serve until it is restarted
    (its ``/health`` says which rank and why); the router sends the request elsewhere."""

    kind = "worker_broken"
    status = 503


class Unpaired(ServingError):
    """The prefill and the decode chosen for a request refused to pair (their models or
    layouts differ; the message names both values): only a change of configuration, or
    another pair, can serve it."""

    kind = "unpaired"
    status = 409


class UpstreamError(ServingError):
    """A worker behind the router failed or could not be reached."""

    kind = "upstream"
    status = 502


def about(room: int, failure: object) -> str:
    """A transfer failure's message naming its room once (pdxfer's own errors already do)."""
    msg = str(failure)
    return msg if msg.startswith(f"room {room}:") else f"room {room}: {msg}"
