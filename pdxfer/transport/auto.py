"""``transport="auto"`` (the default): each side runs every transport it can, advertises them
at pairing, and both sides pick the same one for the pair.

A composite rather than a choice at start, because memory is registered before the peers
are known, and only the handshake tells what a peer runs and whether it shares the host. So
``AutoTransport`` starts each transport it can, registers memory with all of them and carries
one offer per transport plus a host id in ``peer_info``; ``add_peer`` applies one rule both
sides compute alike (``pick``: the intersection of both offers in ``preference`` order) and
routes every later call for that peer there. Host pools: NIXL on one host, Mooncake TCP
across hosts; device pools on both sides: ``nvlink``, NIXL, TCP on one host, RDMA first
across hosts. No transport in common, or ``auto`` facing an explicit transport, refuses the
pairing. Why this order: docs/performance.md#choosing-a-transport.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Annotated

import msgspec
import numpy as np

from ..errors import ConfigError, TransportError, TransportUnavailable
from .base import Started, Transport, TransportStats

log = logging.getLogger(__name__)

KINDS = ("nixl", "tcp")
"""What ``auto`` always tries to run, in the order it starts them."""
DEVICE_KINDS = ("nvlink", "rdma")
"""What it runs besides where the machine has them (``kinds_here``)."""
ALL_KINDS = KINDS + DEVICE_KINDS


def preference(same_host: bool, device: bool = False) -> tuple[str, ...]:
    """Best first (see the module docstring for the measurements behind it). ``device``:
    every pool of both sides is device memory."""
    if device:
        return ("nvlink", "nixl", "tcp", "rdma") if same_host else ("rdma", "tcp", "nixl")
    return ("nixl", "tcp", "rdma") if same_host else ("tcp", "nixl", "rdma")


def pick(
    mine: Sequence[str], theirs: Sequence[str], same_host: bool, device: bool = False
) -> str | None:
    """The pair's transport: the first of ``preference`` both sides offer. Symmetric in
    ``mine`` and ``theirs``, so both sides of a pair pick the same one."""
    return next((k for k in preference(same_host, device) if k in mine and k in theirs), None)


def rdma_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """The RDMA NICs of this host, by name (empty without any)."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def kinds_here(cuda: bool | None = None, nics: Sequence[str] | None = None) -> tuple[str, ...]:
    """What ``auto`` starts here: ``KINDS``, ``nvlink`` where Mooncake has it and torch sees a
    GPU (``cuda``), ``rdma`` where there is an RDMA NIC (``nics``)."""
    from . import nvlink

    if cuda is None:
        torch = sys.modules.get("torch")  # device pools come from torch: loaded if any
        cuda = bool(torch is not None and torch.cuda.is_available())
    nics = rdma_devices() if nics is None else nics
    return KINDS + (("nvlink",) if cuda and nvlink.built() else ()) + (("rdma",) if nics else ())


def host_id() -> str:
    """Who shares memory with whom: the kernel's boot id and this network namespace (hosts
    simulated with network namespaces count as apart, as real ones would)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()  # noqa: SIM115
    except OSError:
        boot = os.uname().nodename
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = ""
    return f"{boot}/{net}"


def mismatch(mine: str, theirs: str) -> str:
    """Why a prefill on ``mine`` refuses a decode on ``theirs`` ("" when they can pair)."""
    if not theirs or theirs == mine:
        return ""
    hint = (
        "set the transport on both sides, or on neither (auto)"
        if "auto" in (mine, theirs)
        else "start both with the same --transport"
    )
    return f"transport differs: prefill uses {mine!r}, decode uses {theirs!r} ({hint})"


_Name = Annotated[str, msgspec.Meta(max_length=16)]
_Session = Annotated[str, msgspec.Meta(max_length=512)]


class _Offer(msgspec.Struct, frozen=True, array_like=True):
    kind: _Name
    session: _Session
    info: bytes


class _Info(msgspec.Struct, frozen=True):
    host: Annotated[str, msgspec.Meta(max_length=512)]
    offers: Annotated[list[_Offer], msgspec.Meta(max_length=len(ALL_KINDS))]
    device: bool = False
    """Every region this side registered is device memory (a peer that predates the field:
    host memory, today's choices)."""


class AutoTransport:
    """Every transport this process can run, one chosen per peer at pairing (``pick``)."""

    name = "auto"

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        kinds: Sequence[str] | None = None,
        make: Callable[[str], Transport] | None = None,
    ) -> None:
        from . import make_transport

        kinds = kinds_here() if kinds is None else kinds
        build = make or (
            lambda k: make_transport(
                k, host, ",".join(rdma_devices()) if k == "rdma" else "", timeout_s
            )
        )
        self.inner: dict[str, Transport] = {}
        why: dict[str, str] = {}
        for k in kinds:
            try:
                self.inner[k] = build(k)
            except (TransportError, ImportError, RuntimeError) as e:  # then run the others
                why[k] = str(e)
                log.info("auto transport: %s unavailable here: %s", k, e)
        if not self.inner:
            raise TransportUnavailable(f"no transport can start here: {why}")
        self.unavailable = why
        self.stats = TransportStats()
        for t in self.inner.values():
            t.stats = self.stats  # one set of counters, whichever transport moved the bytes
        first = self.inner.get("tcp") or next(iter(self.inner.values()))
        self.session_id = first.session_id
        self.batch_entries = min(t.batch_entries for t in self.inner.values())
        self.host = host_id()
        self._routes: dict[str, tuple[str, str]] = {}
        self._regions: dict[int, bool] = {}
        """Registered address -> whether it is device memory."""
        self._unfit: dict[str, str] = {}
        """Device kinds whose registration failed here, and why: not offered (``nvlink`` is
        not offered either while a host region is registered: ``offered``)."""

    def device_only(self) -> bool:
        """Whether every region registered here is device memory (and there is one)."""
        return bool(self._regions) and all(self._regions.values())

    def offered(self) -> list[str]:
        """The kinds this side offers now: those running and fit for its memory."""
        return [
            k for k in self.inner if k not in self._unfit and (k != "nvlink" or self.device_only())
        ]

    # -- pairing -------------------------------------------------------------------------------
    def peer_info(self) -> bytes:
        return msgspec.msgpack.encode(
            _Info(
                self.host,
                [
                    _Offer(k, self.inner[k].session_id, self.inner[k].peer_info())
                    for k in self.offered()
                ],
                self.device_only(),
            )
        )

    def add_peer(self, peer: str, info: bytes) -> None:
        """Pick the pair's transport (``pick``) and pair that transport with the peer's. A
        peer with no offers at all predates the choice (its Hello names no transport): such
        peers ran Mooncake TCP, which finds a peer by its session alone, so it gets ``tcp``."""
        if not info:
            if "tcp" not in self.inner:
                raise TransportError(
                    f"{peer} offers no transport (a peer that predates "
                    f"'auto' runs Mooncake TCP), and this side cannot run "
                    f"it{self._why()}"
                )
            self.inner["tcp"].add_peer(peer, b"")
            self._routes[peer] = ("tcp", peer)
            log.info("auto transport: tcp with %s (it offers none)", peer)
            return
        try:
            parsed = msgspec.msgpack.decode(bytes(info), type=_Info)
        except msgspec.DecodeError as e:
            raise TransportError(
                f"transport offers of {peer} are malformed (is it on transport 'auto'?): {e}"
            ) from None
        theirs = {o.kind: o for o in parsed.offers}
        kind = pick(
            self.offered(),
            list(theirs),
            parsed.host == self.host,
            self.device_only() and parsed.device,
        )
        if kind is None:
            raise TransportError(
                f"no transport in common with {peer}: this side runs {sorted(self.offered())}"
                f"{self._why()}, the peer offers {sorted(theirs)} (install the same on both, "
                f"or set one transport explicitly on both sides)"
            )
        offer = theirs[kind]
        self.inner[kind].add_peer(offer.session, offer.info)
        self._routes[peer] = (kind, offer.session)
        log.info("auto transport: %s with %s", kind, peer)

    def _why(self) -> str:
        return "".join(
            f"; {k} unavailable: {w}" for k, w in {**self.unavailable, **self._unfit}.items()
        )

    def chosen(self) -> dict[str, str]:
        """The transport picked for each paired peer (metrics, tests)."""
        return {p: k for p, (k, _) in self._routes.items()}

    def _route(self, peer: str) -> tuple[Transport, str]:
        r = self._routes.get(peer)
        if r is None:
            raise TransportError(f"no transport chosen for peer {peer} (not paired)")
        return self.inner[r[0]], r[1]

    # -- memory --------------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, location: str = "cpu", item_bytes: int = 0) -> None:
        """Registered with every transport; ``nvlink`` skips host memory (and is then no
        longer offered), and a device kind that cannot register it is dropped from the
        offers (``_unfit``) rather than failing the endpoint."""
        device = location != "cpu"
        self._regions[addr] = device
        for k, t in self.inner.items():
            if k == "nvlink" and not device:
                continue
            if k in DEVICE_KINDS:
                try:
                    t.register(addr, nbytes, location, item_bytes)
                except (TransportError, ConfigError) as e:
                    self._unfit[k] = f"cannot register {location} memory: {e}"
                    log.info("auto transport: %s not offered: %s", k, e)
                continue
            t.register(addr, nbytes, location, item_bytes)

    def deregister(self, addr: int) -> None:
        self._regions.pop(addr, None)
        for t in self.inner.values():
            t.deregister(addr)

    # -- writes --------------------------------------------------------------------------------
    def write(
        self,
        peer: str,
        src: np.ndarray | list[int],
        dst: np.ndarray | list[int],
        nbytes: np.ndarray | list[int],
        *,
        deadline: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        tag: int | None = None,
    ) -> None:
        t, s = self._route(peer)
        t.write(s, src, dst, nbytes, deadline=deadline, should_stop=should_stop, tag=tag)

    def start(
        self,
        peer: str,
        src: list[int],
        dst: list[int],
        nbytes: list[int],
        *,
        tag: int | None = None,
    ) -> Started | None:
        t, s = self._route(peer)
        return t.start(s, src, dst, nbytes, tag=tag)

    def finish(self, peer: str, started: Started) -> None:
        t, s = self._route(peer)
        t.finish(s, started)

    def tainted(self, peer: str) -> bool:
        r = self._routes.get(peer)
        return r is not None and self.inner[r[0]].tainted(r[1])

    def tainted_peers(self) -> list[str]:
        return [p for p in self._routes if self.tainted(p)]

    def settle(self, peer: str) -> bool:
        if peer not in self._routes:
            return True
        t, s = self._route(peer)
        return t.settle(s)

    def probe(self, peer: str) -> bool:
        if peer not in self._routes:
            return True  # not paired yet: nothing says it is gone
        t, s = self._route(peer)
        return t.probe(s)

    def close(self) -> None:
        for t in self.inner.values():
            t.close()
