"""What the tests across network namespaces share: the root check and a remote bootstrap."""

from __future__ import annotations

import pytest

from pdxfer.serving.procs import Proc
from pdxfer.serving.toy.cluster import RemoteBootstrap
from pdxfer.testing.hosts import Host, root_reason

needs_root = pytest.mark.skipif(root_reason() is not None, reason=root_reason() or "")
"""Network namespaces need root; CI runs as root, so there these tests run."""


def bootstrap_on(host: Host) -> RemoteBootstrap:
    """A ``pdxfer bootstrap`` process on ``host``, bound to and advertising its address."""
    return RemoteBootstrap(Proc("bootstrap", ["bootstrap", "--host", host.addr, "--port", "0"],
                                prefix=host.prefix, timeout=60))


def port_of(addr: str) -> int:
    """The port of ``tcp://h:p``, ``http://h:p`` or ``h:p``."""
    return int(addr.rstrip("/").rpartition(":")[2])
