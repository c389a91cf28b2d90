"""What the tests across network namespaces share: the root check, the secret and a remote
bootstrap. Processes on different hosts are not on loopback, so without a secret protected
mode would refuse them: every process these tests start across hosts gets ``NET_ENV``."""

from __future__ import annotations

import pytest

from pdxfer.serving.procs import Proc
from pdxfer.serving.toy.cluster import RemoteBootstrap
from tests.harness.hosts import Host, root_reason

SECRET = "a-secret-shared-by-the-hosts-of-a-test-network"
NET_ENV = {"PDXFER_SECRET": SECRET}

needs_root = pytest.mark.skipif(root_reason() is not None, reason=root_reason() or "")
"""Network namespaces need root; CI runs as root, so there these tests run."""


def bootstrap_on(host: Host) -> RemoteBootstrap:
    """A ``pdxfer bootstrap`` process on ``host``, bound to and advertising its address."""
    return RemoteBootstrap(
        Proc(
            "bootstrap",
            ["bootstrap", "--host", host.addr, "--port", "0"],
            prefix=host.prefix,
            timeout=60,
            env=NET_ENV,
        )
    )


def port_of(addr: str) -> int:
    """The port of ``tcp://h:p``, ``http://h:p`` or ``h:p``."""
    return int(addr.rstrip("/").rpartition(":")[2])
