"""``transport="auto"`` (the default) between real processes: with no transport set, a pair on
one host moves its KV over NIXL (UCX, CMA), measured faster than Mooncake TCP over loopback;
a side that cannot run NIXL (``nixl_cu12`` not importable) makes the pair fall back to
Mooncake TCP; an explicit transport on one side only is refused, naming both. Bytes are
checked at the decode every time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import FAST
from .helpers import Factory, run, verify

GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=256, page_size=16, heads=2, head_dim=16, dtype="float16"),
    PoolGeom("aux", "slots", layers=1, pages=16, dim=8, dtype="int32"),
]
EXT = "tests.harness.transport_cmds:choices"


@pytest.fixture()
def bootstrap() -> Iterator[BootstrapServer]:
    """One per test: each test's decode finds only that test's prefill."""
    srv = BootstrapServer("127.0.0.1", 0).start()
    yield srv
    srv.stop()


def without_nixl(tmp: Path) -> dict[str, str]:
    """An environment in which ``import nixl_cu12`` fails, as on a host without it: a
    ``sitecustomize`` on PYTHONPATH (run at interpreter start, before multiprocessing's spawn
    replaces ``sys.path``) puts a finder first that refuses the package."""
    d = tmp / "no_nixl"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoNixl:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'nixl_cu12':\n"
        "            raise ImportError('nixl_cu12 hidden by the test')\n"
        "sys.meta_path.insert(0, _NoNixl())\n"
    )
    return {
        "PYTHONPATH": os.pathsep.join([str(d), *filter(None, [os.environ.get("PYTHONPATH", "")])])
    }


START_S = 300.0
"""Each side starts NIXL and Mooncake: on a loaded 2-core VM that took over 120 s."""


def start_pair(
    bootstrap: BootstrapServer,
    prefill: dict | None = None,
    decode: dict | None = None,
    prefill_env: dict[str, str] | None = None,
) -> tuple[Agent, Agent]:
    pf = Agent(
        "prefill",
        {**FAST, "bootstrap": bootstrap.address, **(prefill or {})},
        GEOMS,
        env=prefill_env,
        start_timeout=START_S,
    )
    try:
        return pf, Agent("decode", {**FAST, **(decode or {})}, GEOMS, start_timeout=START_S)
    except Exception:
        pf.close()
        raise


def moves_bytes(pf: Agent, dc: Agent, bootstrap: str) -> None:
    f = Factory(GEOMS, GEOMS, seed=3)
    reqs = [f.make(n, chunks=c) for n, c in [(40, 1), (129, 3)]]
    out = run(pf, dc, bootstrap, reqs)
    assert all(o["state"] == "Success" for o in out.values()), out
    assert not any(c[0] for c in verify(dc, reqs).values())


def chosen(a: Agent) -> set[str]:
    return set(a.call("ext", fn=EXT)["chosen"].values())


def test_a_pair_with_no_transport_set_moves_its_kv_over_nixl_on_one_host(
    bootstrap: BootstrapServer,
) -> None:
    pf, dc = start_pair(bootstrap)
    try:
        assert pf.call("ext", fn=EXT)["name"] == "auto"
        assert set(dc.call("ext", fn=EXT)["runs"]) == {"nixl", "tcp"}
        moves_bytes(pf, dc, bootstrap.address)
        assert chosen(pf) == {"nixl"}  # the prefill writes with it
        assert chosen(dc) == {"nixl"}  # and the decode probes with the same one
    finally:
        pf.close()
        dc.close()


def test_a_side_without_nixl_makes_the_pair_fall_back_to_mooncake_tcp(
    bootstrap: BootstrapServer, tmp_path: Path
) -> None:
    pf, dc = start_pair(bootstrap, prefill_env=without_nixl(tmp_path))
    try:
        assert pf.call("ext", fn=EXT)["runs"] == ["tcp"]
        moves_bytes(pf, dc, bootstrap.address)
        assert chosen(pf) == {"tcp"}
        assert chosen(dc) == {"tcp"}
    finally:
        pf.close()
        dc.close()


@pytest.mark.parametrize("explicit", ["prefill", "decode"])
def test_an_explicit_transport_on_one_side_only_is_refused_naming_both(
    bootstrap: BootstrapServer, explicit: str
) -> None:
    tcp = {"transport": "tcp"}
    pf, dc = (
        start_pair(bootstrap, prefill=tcp)
        if explicit == "prefill"
        else start_pair(bootstrap, decode=tcp)
    )
    try:
        f = Factory(GEOMS, GEOMS, seed=4)
        reqs = [f.make(20)]
        out = run(pf, dc, bootstrap.address, reqs, timeout=30.0)
        (o,) = out.values()
        assert o["state"] == "Failed", o
        why = str(o.get("failure"))
        assert "transport differs" in why and "'auto'" in why and "'mooncake'" in why, why
        assert "on neither" in why, why
    finally:
        pf.close()
        dc.close()
