"""Transports move blocks one-sidedly into a peer's registered memory.

``base.Transport`` is the protocol the endpoint uses; ``mooncake.MooncakeTransport`` is the real
implementation (TCP here, RDMA on clusters); ``nixl.NixlTransport`` the second (NIXL with
UCX: shared memory on one host); ``memory.MemoryTransport`` copies between buffers
of one process, for unit tests of the state machines; ``auto.AutoTransport`` (the default)
runs every transport it can and picks one per peer at pairing. ``make_transport`` picks one.
"""

from __future__ import annotations

from .base import Started, Transport, TransportStats
from .memory import MemoryFabric, MemoryTransport
from .mooncake import MooncakeTransport


def make_transport(kind: str, host: str, device: str = "", timeout_s: float = 30.0) -> Transport:
    """The transport an endpoint config names: ``auto`` (every one this process can run, one
    picked per peer at pairing), ``tcp``, ``rdma`` or ``nvlink`` (Mooncake; ``nvlink`` is its
    ``nvlink_intra``: device pools on one node), ``nixl``, ``memory``."""
    if kind == "memory":
        return MemoryTransport()
    if kind == "auto":
        from .auto import AutoTransport

        return AutoTransport(host=host, timeout_s=timeout_s)
    if kind == "nixl":
        from .nixl import NixlTransport  # loads NIXL only when asked for

        return NixlTransport(host=host, timeout_s=timeout_s)
    protocol = "nvlink_intra" if kind == "nvlink" else kind
    return MooncakeTransport(host=host, protocol=protocol, device=device, timeout_s=timeout_s)


__all__ = [
    "MemoryFabric",
    "MemoryTransport",
    "MooncakeTransport",
    "Started",
    "Transport",
    "TransportStats",
    "make_transport",
]
