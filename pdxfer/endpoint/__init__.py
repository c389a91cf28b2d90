"""One rank: the ``Endpoint`` front, its shared core, and the prefill and decode sides.

Reading order: ``handles`` (the engine's contract: KVPoll, RequestHandle) -> ``endpoint``
(the thin front) -> ``core`` (one rank's shared state) -> ``sender`` (prefill side, with
its parts) -> ``receiver`` (decode side) -> ``connect`` / ``liveness`` -> ``control`` (ZMQ,
workers) -> ``staging`` (head-slice staging buffers). README.md lists every file.
"""

from .endpoint import Endpoint, validate_pools
from .handles import KVPoll, Release, ReleaseOnce, RequestHandle
from .receiver import KVReceiver
from .sender import KVSender

__all__ = [
    "Endpoint",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "Release",
    "ReleaseOnce",
    "RequestHandle",
    "validate_pools",
]
