"""Shared fixtures: a real bootstrap server, and a prefill/decode process pair."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

FAST = {
    "bootstrap_timeout_s": 5.0,
    "transfer_timeout_s": 10.0,
    "abort_timeout_s": 2.0,
    "heartbeat_s": 0.25,
}
"""Short deadlines so failure tests end in seconds."""


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[BootstrapServer]:
    srv = BootstrapServer("127.0.0.1", 0).start()
    yield srv
    srv.stop()


def start_pair(
    bootstrap: BootstrapServer,
    geoms: list[PoolGeom],
    dgeoms: list[PoolGeom] | None = None,
    instance: str = "default",
    prefill_env: dict[str, str] | None = None,
    **cfg: object,
) -> tuple[Agent, Agent]:
    """A prefill process registered with ``bootstrap`` and a decode process."""
    conf = {**FAST, **cfg}
    pf = Agent(
        "prefill",
        {**conf, "bootstrap": bootstrap.address, "instance": instance},
        geoms,
        env=prefill_env,
    )
    try:
        dc = Agent("decode", dict(conf), dgeoms or geoms)
    except Exception:
        pf.close()
        raise
    return pf, dc
