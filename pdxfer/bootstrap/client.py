"""The bootstrap client: synchronous (stdlib HTTP), with timeouts and retries with backoff.

Endpoints call it from their own threads, never from the engine loop.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import msgspec

from .. import trust
from ..errors import BootstrapError
from .registration import Registration


class BootstrapClient:
    """Talks to a bootstrap server with timeouts and retries with backoff."""

    def __init__(
        self,
        address: str,
        timeout: float = 5.0,
        retries: int = 5,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        secret: str | bytes | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """``stop``: set it to end any retry wait at once (an endpoint closing)."""
        self._secret = trust.load_secret(secret)
        self._stop = stop or threading.Event()
        if "://" not in address:
            address = "http://" + address
        self.base = address.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff

    def _call(
        self, method: str, path: str, body: bytes | None = None, deadline: float | None = None
    ) -> Any:
        """One request with retries on connection errors and 5xx; 4xx raise at once."""
        delay = self.backoff
        attempt = 0
        while True:
            attempt += 1
            headers = {
                "Content-Type": "application/json",
                **trust.http_headers(self._secret, method, path, body or b""),
            }
            req = urllib.request.Request(
                self.base + path, data=body, method=method, headers=headers
            )
            not_ready = False
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read() or b"null")
            except urllib.error.HTTPError as e:
                msg = _error_text(e)
                if e.code < 500:
                    raise BootstrapError(f"bootstrap {method} {path} -> {e.code}: {msg}") from None
                last, not_ready = f"{e.code}: {msg}", e.code == 503
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                why = getattr(e, "reason", e)
                last = f"unreachable: {why}"
                # no answer in time: a server too busy to answer (a loaded host), or a network
                # that lost it; neither is proof that it is gone, so wait as for a 503
                not_ready = isinstance(why, TimeoutError)
            # 503 means "not all ranks registered yet" and a timeout "not answering yet":
            # worth waiting for up to the deadline. Anything else (a refused connection: no
            # server there) gets the retry budget, so a dead server fails fast.
            waiting = not_ready and deadline is not None
            out_of_time = deadline is not None and time.monotonic() + delay > deadline
            if out_of_time or (not waiting and attempt > self.retries):
                raise BootstrapError(f"bootstrap {self.base}{path}: {last} (after {attempt} tries)")
            if self._stop.wait(delay * (0.5 + random.random())):
                raise BootstrapError(f"bootstrap {self.base}{path}: given up, client closing")
            delay = min(delay * 2, self.max_backoff)

    def register(self, reg: Registration) -> None:
        self._call("PUT", "/register", msgspec.json.encode(reg))

    def deregister(self, endpoint_id: str) -> None:
        q = urllib.parse.urlencode({"endpoint_id": endpoint_id})
        self._call("DELETE", f"/register?{q}")

    def route(
        self,
        room: int,
        instance: str | None = None,
        dp: int | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Who serves ``room``; waits (retrying 503) until the instance is complete or
        ``deadline`` (monotonic) passes."""
        q: dict[str, Any] = {"room": room}
        if instance:
            q["instance"] = instance
        if dp is not None:
            q["dp"] = dp
        return self._call("GET", "/route?" + urllib.parse.urlencode(q), deadline=deadline)

    def refusals(self, instance: str | None = None) -> dict[str, str]:
        """The decodes ``instance`` (None: the only one) refused to pair with, and why
        (``{decode: reason}``)."""
        q = urllib.parse.urlencode({"instance": instance} if instance else {})
        body = self._call("GET", f"/refusals?{q}" if q else "/refusals")
        out = body.get("refused") if isinstance(body, dict) else None
        if not isinstance(out, dict):
            return {}
        return {str(k): str(v) for k, v in out.items()}

    def health(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=self.timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read() or b"{}")
        return str(body.get("error") or body)
    except (ValueError, OSError):
        return e.reason if isinstance(e.reason, str) else str(e.reason)
