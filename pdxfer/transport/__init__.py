"""Transports move blocks one-sidedly into a peer's registered memory.

``base.Transport`` is the protocol the endpoint uses; ``mooncake.MooncakeTransport`` is the real
implementation (TCP here, RDMA on clusters). ``make_transport`` picks one from a config.
"""

from __future__ import annotations

from .base import Transport, TransportStats
from .mooncake import MooncakeTransport, make_transport

__all__ = ["MooncakeTransport", "Transport", "TransportStats", "make_transport"]
