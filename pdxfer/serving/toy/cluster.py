"""A bootstrap, prefill and decode workers and a router: what the demo, the bench and the
end-to-end tests run, on loopback or each on a host of its own (``hosts``). Children are
stopped by pid on exit, error or Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pdxfer import BootstrapServer

from ..procs import Proc, stop_all


class Place(Protocol):
    """Where a process runs: a command prefix that runs it there, and the address it binds
    and advertises (``tests.harness.hosts.Host`` is one)."""

    prefix: list[str]
    addr: str


class RemoteBootstrap:
    """A ``pdxfer bootstrap`` process (on a host of its own), addressed like a server."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.address = proc.url.removeprefix("http://")

    @property
    def port(self) -> int:
        return self.proc.port

    def stop(self) -> None:
        self.proc.stop()


class Cluster:
    """``prefills`` prefill workers (each its own instance on the one bootstrap server),
    ``decodes`` decode workers, and the router in front of them all.

    ``hosts`` places processes by name (``bootstrap``, ``router``, ``prefill``, ``prefill1``,
    ..., ``decode``, ``decode1``, ...): each runs under its place's prefix and binds and
    advertises its place's address (``bind_all``: binds every interface and advertises its
    place's address); unnamed ones run here on loopback. ``client`` is entered
    around this object's own HTTP calls (a client on a host of the network). Processes
    placed on hosts talk across a network, so they share a fresh secret (``PDXFER_SECRET``)
    unless ``env`` or this process names one: protected mode refuses them otherwise."""

    def __init__(
        self,
        *,
        worker_args: Sequence[str] = (),
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
        log_level: str = "WARNING",
        quiet: bool = True,
        timeout: float = 180.0,
        prefills: int = 1,
        decodes: int = 1,
        env: dict[str, str] | None = None,
        expose_cache_stats: bool = True,
        hosts: Mapping[str, Place] | None = None,
        client: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        bind_all: bool = False,
        each_prefill: Sequence[Sequence[str]] = (),
        each_decode: Sequence[Sequence[str]] = (),
    ) -> None:
        """``each_prefill[i]`` / ``each_decode[i]``: options of that worker alone (a TP size,
        a landing), after the shared ones."""
        self.worker_args, self.prefill_args = list(worker_args), list(prefill_args)
        self.decode_args, self.router_args = list(decode_args), list(router_args)
        self.each_prefill = [list(a) for a in each_prefill]
        self.each_decode = [list(a) for a in each_decode]
        self.log_level, self.quiet, self.timeout = log_level, quiet, timeout
        self.n_prefills, self.n_decodes, self.env = prefills, decodes, env
        if hosts and not (
            {**os.environ, **(env or {})}.get("PDXFER_SECRET")
            or {**os.environ, **(env or {})}.get("PDXFER_SECRET_FILE")
        ):
            self.env = {**(env or {}), "PDXFER_SECRET": secrets.token_hex(16)}
        self.expose_cache_stats = expose_cache_stats  # the demo and tests show cache hits
        self.hosts = dict(hosts or {})
        self.bind_all = bind_all  # placed processes bind 0.0.0.0 and advertise their address
        self.client = client or contextlib.nullcontext
        self.bootstrap: BootstrapServer | RemoteBootstrap | None = None
        self.prefills: list[Proc | None] = []
        self.decodes: list[Proc] = []
        self.router: Proc | None = None
        self.routers: list[Proc] = []  # more routers over some of the workers (add_router)
        # a fresh L3 folder per cluster (a run never hits what an earlier run stored), one
        # subfolder per decode as each node has its own disk, kept across a decode's
        # restart; removed at stop
        self.l3_dir: str | None = None
        if "--l3-dir" not in self.decode_args + self.worker_args:
            self.l3_dir = tempfile.mkdtemp(prefix="pdxfer-l3-")

    @property
    def prefill(self) -> Proc | None:
        return self.prefills[0] if self.prefills else None

    @property
    def decode(self) -> Proc | None:
        return self.decodes[0] if self.decodes else None

    def _proc(
        self, name: str, args: list[str], wait: bool = True, env: dict[str, str] | None = None
    ) -> Proc:
        place = self.hosts.get(name)
        where = (
            []
            if place is None
            else ["--host", place.addr]
            if not self.bind_all
            else ["--host", "0.0.0.0", "--advertise", place.addr]
        )
        return Proc(
            name,
            ["--log-level", self.log_level, *args, *where],
            timeout=self.timeout,
            quiet=self.quiet,
            wait=wait,
            env={**(self.env or {}), **(env or {})},
            prefix=place.prefix if place is not None else (),
        )

    def _instance(self, i: int) -> str:
        return "default" if i == 0 else f"prefill{i}"

    def start_prefill(
        self, port: int = 0, wait: bool = True, i: int = 0, env: dict[str, str] | None = None
    ) -> Proc:
        """``env``: more variables for this start alone (e.g. ``PDXFER_FAULTS``)."""
        assert self.bootstrap is not None
        proc = self._proc(
            f"prefill{i or ''}",
            [
                "prefill",
                "--port",
                str(port),
                "--bootstrap",
                self.bootstrap.address,
                "--instance",
                self._instance(i),
                *self.worker_args,
                *self.prefill_args,
                *(self.each_prefill[i] if i < len(self.each_prefill) else []),
            ],
            wait,
            env,
        )
        while len(self.prefills) <= i:
            self.prefills.append(None)
        self.prefills[i] = proc
        return proc

    def _decode(self, i: int, port: int, wait: bool) -> Proc:
        l3 = ["--l3-dir", os.path.join(self.l3_dir, f"decode{i}")] if self.l3_dir else []
        own = self.each_decode[i] if i < len(self.each_decode) else []
        assert self.bootstrap is not None  # the decode trusts the cluster's bootstrap only
        return self._proc(
            f"decode{i or ''}",
            [
                "decode",
                "--port",
                str(port),
                *l3,
                "--bootstrap",
                self.bootstrap.address,
                *self.worker_args,
                *self.decode_args,
                *own,
            ],
            wait,
        )

    def restart_decode(self, i: int = 0) -> Proc:
        """Stop decode ``i`` and start it again on the same port (the router keeps its URL):
        its L2 is gone, its L3 is not."""
        old = self.decodes[i]
        port = old.port
        stop_all([old])
        self.decodes[i] = self._decode(i, port, True)
        for router in (self.router, *self.routers):  # routers learn the new endpoint id now
            if router is not None:
                with self.client(), urllib.request.urlopen(f"{router.url}/health", timeout=10) as r:
                    r.read()
        return self.decodes[i]

    def start(self) -> Cluster:
        try:
            if "bootstrap" in self.hosts:
                self.bootstrap = RemoteBootstrap(
                    self._proc("bootstrap", ["bootstrap", "--port", "0"])
                )
            else:
                self.bootstrap = BootstrapServer("127.0.0.1", 0).start()
            for i in range(self.n_prefills):
                self.start_prefill(wait=False, i=i)
            self.decodes = [self._decode(i, 0, False) for i in range(self.n_decodes)]
            for p in [*self.prefills, *self.decodes]:
                assert p is not None
                p.wait_ready()
            self.router = self._router(
                range(len(self.prefills)), range(len(self.decodes)), self.router_args
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _router(
        self, prefills: Sequence[int], decodes: Sequence[int], extra: Sequence[str]
    ) -> Proc:
        assert self.bootstrap is not None
        args = ["router", "--port", "0"]
        for i in prefills:
            p = self.prefills[i]
            assert p is not None
            args += ["--prefill", f"{p.url},{self.bootstrap.address},{self._instance(i)}"]
        for i in decodes:
            args += ["--decode", self.decodes[i].url]
        if self.expose_cache_stats:
            args.append("--expose-cache-stats")
        return self._proc("router", [*args, *extra])

    def add_router(
        self, prefills: Sequence[int], decodes: Sequence[int], extra: Sequence[str] = ()
    ) -> Proc:
        """Another router, over only these prefills and decodes (one pair: its traffic goes
        exactly there); stopped with the cluster."""
        r = self._router(prefills, decodes, extra)
        self.routers.append(r)
        return r

    @property
    def procs(self) -> list[Proc]:
        return [
            p for p in (*self.prefills, *self.decodes, self.router, *self.routers) if p is not None
        ]

    def stop(self) -> None:
        stop_all(self.procs)
        if self.bootstrap is not None:
            self.bootstrap.stop()
            self.bootstrap = None
        if self.l3_dir is not None:
            shutil.rmtree(self.l3_dir, ignore_errors=True)
            self.l3_dir = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- client helpers ----------------------------------------------------------------------
    def complete(
        self,
        body: Any,
        timeout: float = 120.0,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """POST to the router's /v1/completions; returns (status, parsed JSON or SSE events)."""
        assert self.router is not None
        with self.client():
            return post(f"{self.router.url}/v1/completions", body, timeout, raw, headers)

    def metrics(self, which: str) -> dict[str, float]:
        proc = {"prefill": self.prefill, "decode": self.decode, "router": self.router}.get(which)
        if proc is None and which.startswith(("prefill", "decode")):  # "decode1", "prefill1"
            i = int(which.removeprefix("prefill").removeprefix("decode"))
            proc = (self.prefills if which.startswith("prefill") else self.decodes)[i]
        assert proc is not None
        with self.client(), urllib.request.urlopen(f"{proc.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
                name = smp.name.removesuffix("_total")  # counters read like the old names
                out[f"{name}{{{labels}}}" if labels else name] = smp.value
        return out


def post(
    url: str,
    body: Any,
    timeout: float = 120.0,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text, ctype = r.status, r.read().decode(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, text, ctype = e.code, e.read().decode(), e.headers.get("Content-Type", "")
    if ctype.startswith("text/event-stream"):
        events = [
            json.loads(line[6:])
            for line in text.splitlines()
            if line.startswith("data: ") and line[6:] != "[DONE]"
        ]
        return status, events
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, {"error": {"message": text}}
