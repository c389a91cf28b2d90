"""A bootstrap, one prefill, one decode and a router on loopback: what the demo, the bench
and the end-to-end tests run. Children are stopped by pid on exit, error or Ctrl-C."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from pdxfer import BootstrapServer

from .procs import Proc, stop_all


class Cluster:
    def __init__(self, *, worker_args: Sequence[str] = (), prefill_args: Sequence[str] = (),
                 decode_args: Sequence[str] = (), router_args: Sequence[str] = (),
                 log_level: str = "WARNING", quiet: bool = True, timeout: float = 180.0) -> None:
        self.worker_args, self.prefill_args = list(worker_args), list(prefill_args)
        self.decode_args, self.router_args = list(decode_args), list(router_args)
        self.log_level, self.quiet, self.timeout = log_level, quiet, timeout
        self.bootstrap: BootstrapServer | None = None
        self.prefill: Proc | None = None
        self.decode: Proc | None = None
        self.router: Proc | None = None

    def _proc(self, name: str, args: list[str], wait: bool = True) -> Proc:
        return Proc(name, ["--log-level", self.log_level, *args], timeout=self.timeout,
                    quiet=self.quiet, wait=wait)

    def start_prefill(self, port: int = 0, wait: bool = True) -> Proc:
        assert self.bootstrap is not None
        self.prefill = self._proc("prefill", [
            "prefill", "--port", str(port), "--bootstrap", self.bootstrap.address,
            *self.worker_args, *self.prefill_args], wait)
        return self.prefill

    def start(self) -> Cluster:
        try:
            self.bootstrap = BootstrapServer("127.0.0.1", 0).start()
            self.start_prefill(wait=False)
            self.decode = self._proc("decode", ["decode", "--port", "0",
                                                *self.worker_args, *self.decode_args], False)
            assert self.prefill is not None
            self.prefill.wait_ready()
            self.decode.wait_ready()
            self.router = self._proc("router", [
                "router", "--port", "0", "--prefill",
                f"{self.prefill.url},{self.bootstrap.address}", "--decode", self.decode.url,
                *self.router_args])
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def procs(self) -> list[Proc]:
        return [p for p in (self.prefill, self.decode, self.router) if p is not None]

    def stop(self) -> None:
        stop_all(self.procs)
        if self.bootstrap is not None:
            self.bootstrap.stop()
            self.bootstrap = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- client helpers ----------------------------------------------------------------------
    def complete(self, body: Any, timeout: float = 120.0, raw: bytes | None = None
                 ) -> tuple[int, Any]:
        """POST to the router's /v1/completions; returns (status, parsed JSON or SSE events)."""
        assert self.router is not None
        return post(f"{self.router.url}/v1/completions", body, timeout, raw)

    def metrics(self, which: str) -> dict[str, float]:
        proc = {"prefill": self.prefill, "decode": self.decode, "router": self.router}[which]
        assert proc is not None
        with urllib.request.urlopen(f"{proc.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
                name = smp.name.removesuffix("_total")  # counters read like the old names
                out[f"{name}{{{labels}}}" if labels else name] = smp.value
        return out


def post(url: str, body: Any, timeout: float = 120.0, raw: bytes | None = None
         ) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text, ctype = r.status, r.read().decode(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, text, ctype = e.code, e.read().decode(), e.headers.get("Content-Type", "")
    if ctype.startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: ") and line[6:] != "[DONE]"]
        return status, events
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, {"error": {"message": text}}
