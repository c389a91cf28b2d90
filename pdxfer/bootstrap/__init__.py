"""HTTP bootstrap: prefill endpoints register, decode endpoints look up who serves a room.

Reading order: ``registration`` (what a prefill rank registers; an instance's slots) ->
``server`` (``BootstrapServer``: the registry and its HTTP routes) -> ``guard`` (the
server's connection cap, header deadline and protected mode) -> ``client``
(``BootstrapClient``: timeouts, retries with backoff).
"""

from .client import BootstrapClient
from .registration import Refusal, Registration
from .server import BootstrapServer

__all__ = ["BootstrapClient", "BootstrapServer", "Refusal", "Registration"]
