"""HTTP plumbing shared by workers and router (no torch here: the router stays light)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from aiohttp import web

from pdxfer.metrics import prometheus_text
from pdxfer.netaddr import advertised
from pdxfer.trust import check_http, check_serving, http_replay_guard, load_secret, peer_allowed

from .errors import BadRequest, ServingError

log = logging.getLogger(__name__)

READY = "PDXFER_READY"
"""Printed on stdout with the server's URL once it serves: launchers wait for this line."""


RETRY_AFTER_S = 1


def error_body(message: str, kind: str, status: int) -> dict[str, Any]:
    """OpenAI's error shape; ``type`` is the failure kind, ``code`` the HTTP status class."""
    return {"error": {"message": message, "type": kind, "code": status, "param": None}}


OPEN_PATHS = frozenset({"/health", "/metrics"})


def router_only(secret: bytes | None) -> Any:
    """Middleware for the workers: with a shared secret, every request but ``/health`` and
    ``/metrics`` must carry the router's signature (``pdxfer.trust.http_headers``), so a client that
    reaches a worker directly can neither generate, nor abort, nor name a bootstrap server.
    Without a secret (loopback and trusted networks) nothing is checked."""

    replay = http_replay_guard()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if secret is not None and request.path not in OPEN_PATHS:
            body = await request.read()
            why = check_http(
                secret,
                request.method,
                request.raw_path,
                body,
                request.headers.get("X-Pdxfer-Time"),
                request.headers.get("X-Pdxfer-Signature"),
                request.headers.get("X-Pdxfer-Nonce"),
                replay,
            )
            if why:
                return web.json_response(error_body(why, "unauthorized", 401), status=401)
        return await handler(request)

    return check


@web.middleware
async def loopback_only(request: web.Request, handler: Any) -> web.StreamResponse:
    """Protected mode (``pdxfer.trust``): with no shared secret, a peer on another host is
    refused whatever the server is bound to."""
    if not peer_allowed(request.remote):
        log.warning(
            "refused a request from %s: no shared secret is set, so only loopback peers are served",
            request.remote,
        )
        return web.json_response(
            error_body(
                "this server has no shared secret and serves loopback peers only", "forbidden", 403
            ),
            status=403,
        )
    return await handler(request)


def error_response(err: BaseException) -> web.Response:
    status = err.status if isinstance(err, ServingError) else 500
    kind = getattr(err, "kind", type(err).__name__)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return web.json_response(error_body(str(err), kind, status), status=status, headers=headers)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def field(
    body: dict[str, Any],
    name: str,
    kind: type,
    *,
    default: Any = ...,
    lo: int | None = None,
    hi: int | None = None,
) -> Any:
    """One typed field; bools are not ints here (JSON ``true`` is not a token count)."""
    if name not in body:
        if default is ...:
            raise BadRequest(f"missing field {name!r}")
        return default
    v = body[name]
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
        raise BadRequest(f"field {name!r} must be {kind.__name__}, got {type(v).__name__}")
    if lo is not None or hi is not None:
        assert isinstance(v, (int, float)), f"field {name!r}: bounds are for numbers"
        if lo is not None and v < lo or hi is not None and v > hi:
            raise BadRequest(f"field {name!r} = {v} outside [{lo}, {hi}]")
    return v


def token_list(body: dict[str, Any], name: str, vocab: int) -> list[int]:
    v = field(body, name, list)
    if not v:
        raise BadRequest(f"{name!r} is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in v):
        raise BadRequest(f"{name!r} must be token ids in [0, {vocab})")
    return v


def metrics_text(prefix: str, values: dict[str, Any], labels: dict[str, str] | None = None) -> str:
    """Prometheus text (via prometheus_client) for a flat snapshot of numeric values."""
    return prometheus_text(prefix, lambda: values, labels).decode()


def merge_metrics(parts: list[tuple[str, dict[str, str]]]) -> str:
    """Several processes' Prometheus texts as one (each family once), every sample of a part
    labelled with that part's labels (a TP rank, a DP group)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    fams: dict[str, Metric] = {}
    for text, labels in parts:
        for f in text_string_to_metric_families(text):
            into = fams.get(f.name)
            if into is None:
                into = fams[f.name] = Metric(f.name, f.documentation, f.type)
            into.samples += [smp._replace(labels={**smp.labels, **labels}) for smp in f.samples]

    class _Merged:
        def collect(self) -> Any:
            return list(fams.values())

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Merged())
    return generate_latest(reg).decode()


async def poll_until_terminal(handle: Any, deadline_s: float) -> None:
    """Poll a sender/receiver from the event loop without blocking it."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    delay = 0.0005
    while not handle.poll().terminal:
        if loop.time() > end:
            handle.abort(f"worker deadline of {deadline_s} s passed")
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)


def serve(
    app: web.Application,
    host: str,
    port: int,
    on_stop: Any = None,
    advertise: str = "",
    announce: Any = None,
    what: str = "HTTP server",
) -> int:
    """Run ``app`` until SIGINT/SIGTERM; print the ready line with the URL peers use (the
    ``advertise`` address, else ``host``: a wildcard bind without one is refused), or hand
    that URL to ``announce`` (a worker behind a front that is not its launcher's).

    Shutdown is bounded: in-flight HTTP requests get a second, ``on_stop`` (closing the
    endpoint: deregister, join threads) a few more, then the process exits regardless, so a
    supervisor's SIGTERM never turns into a hang.

    Without a shared secret it serves loopback peers only, and refuses to start on a
    non-loopback address unless ``PDXFER_INSECURE`` opts in (``pdxfer.trust``)."""

    shown = advertised(host, advertise)
    if check_serving(what, host, advertise, secret=load_secret()):
        app.middlewares.insert(0, loopback_only)

    async def main() -> None:
        # a client that disconnects cancels its handler: its request stops (and frees its
        # pages) instead of running to max_tokens for nobody
        runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
        await runner.setup()
        # one socket: a wildcard left to aiohttp binds IPv4 and IPv6 apart, each on its own
        # random port, and the ready line could name the one a client does not dial
        site = web.TCPSite(
            runner, "0.0.0.0" if host in ("", "*") else host, port, shutdown_timeout=1.0
        )
        await site.start()
        bound = runner.addresses[0][1]
        if announce is not None:
            announce(f"http://{shown}:{bound}")
        else:
            print(f"{READY} http://{shown}:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        try:
            await asyncio.wait_for(runner.cleanup(), 3.0)
        except asyncio.TimeoutError:
            log.warning("HTTP shutdown took over 3 s; exiting anyway")

    code = 0
    try:
        asyncio.run(main())
    except Exception as e:  # noqa: BLE001 - a server that cannot start says why, not 0
        log.error("cannot serve on %s:%s: %s", host, port, e)
        print(f"error: cannot serve on {host}:{port}: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        if on_stop is not None:
            t = threading.Thread(target=on_stop, daemon=True, name="pdxfer-close")
            t.start()
            t.join(5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # non-daemon transport threads must not keep a stopped worker alive
