"""API keys: with keys configured, ``/v1/*`` needs ``Authorization: Bearer KEY``; the key
names the tenant, which scopes prefix reuse (a tenant's prompts meet only its own cache).
This is the clients' side; the router's requests to its workers are signed (``Http``).
"""

from __future__ import annotations

import collections
from typing import Any

from aiohttp import web

from pdxfer.config import knobs

from ..http import error_body


def parse_api_keys(spec: str) -> dict[str, str]:
    """``PDXFER_API_KEYS``: ``KEY`` (one tenant) or ``TENANT:KEY,TENANT:KEY`` -> key: tenant."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        tenant, sep, key = item.rpartition(":")
        if not sep:
            tenant, key = "default", item
        if len(key) < 16:
            raise ValueError("an API key must be at least 16 characters")
        out[key] = tenant or "default"
    return out


class ApiKeys:
    """The middleware that admits a request by its key and tags it with its tenant."""

    def __init__(self, keys: dict[str, str] | None, counters: collections.Counter[str]) -> None:
        self.keys = parse_api_keys(knobs().api_keys) if keys is None else keys
        """Key: tenant (None: from ``PDXFER_API_KEYS``; empty: every request is let in)."""
        self.counters = counters

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With API keys configured, ``/v1/*`` needs ``Authorization: Bearer KEY``; the key
        names the tenant, which scopes prefix reuse."""
        request["tenant"] = ""
        if self.keys and request.path.startswith("/v1/"):
            auth = request.headers.get("Authorization", "")
            tenant = self.keys.get(auth.removeprefix("Bearer ").strip())
            if not auth.startswith("Bearer ") or tenant is None:
                self.counters["unauthorized"] += 1
                return web.json_response(
                    error_body("invalid or missing API key", "invalid_api_key", 401), status=401
                )
            request["tenant"] = tenant
        return await handler(request)
