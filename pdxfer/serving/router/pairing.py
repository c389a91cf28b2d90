"""Pairing: which prefill and which decode take a choice.

Policies: ``round_robin`` (prefill and decode each in turn), ``least_outstanding``, and
``kv_aware`` (``auto``'s choice wherever a leg has several workers): on each leg the worker
whose cached prefix of the prompt, weighed against its load, leaves the least to do
(``kv_policy``). What a worker holds comes from its KV events where it publishes them
(``kv_feed``, ``--kv-events``), else from the router's history of the prompts it sent there
(``pdxfer.tiers``' hash chain); a feed its worker's answers contradict is taken as out of
sync (``kv_stale``, told by ``judge``).
"""

from __future__ import annotations

import itertools
from typing import Any

from pdxfer.tiers import page_keys

from .backends import Backend, Decode, Prefill
from .kv_feed import KvFeeds
from .kv_policy import Held, choose, pending_tokens, per_request
from .kv_stale import Served, StaleCheck
from .settings import POLICIES as SETTINGS_POLICIES

POLICIES = tuple(p for p in SETTINGS_POLICIES if p != "auto")
"""The pairing policies ``auto`` resolves to."""


def usable(xs: list[Any], avoid: set[str]) -> list[Any]:
    """The workers a choice may take: healthy ones not avoided, else any not avoided."""
    return (
        [x for x in xs if x.key not in avoid and x.healthy]
        or [x for x in xs if x.key not in avoid]
        or xs
    )


def auto_policy(n_prefills: int, n_decodes: int) -> str:
    """``auto``: KV-aware wherever a leg has a choice (several prefills or several decodes),
    so configured KV events are used; round robin for a single pair, where nothing differs."""
    return "kv_aware" if n_prefills > 1 or n_decodes > 1 else "round_robin"


class Pairing:
    """Picks a pair per choice from the router's worker lists. The lists are shared: health
    grows them in place as data-parallel ranks show up, and ``auto`` follows their count."""

    def __init__(
        self,
        prefills: list[Prefill],
        decodes: list[Decode],
        policy: str,
        backend: Backend,
        kv: KvFeeds | None,
        stale: StaleCheck | None,
        load_weight: float,
    ) -> None:
        if policy != "auto" and policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES} or auto, got {policy!r}")
        self.prefills, self.decodes = prefills, decodes
        self.auto = policy == "auto"
        """Whether the policy follows the number of workers (DP groups show up later)."""
        self._policy = policy
        self.backend = backend
        """Only for its tenants' cache salt (the keys the workers' events carry)."""
        self.kv = kv
        """The workers' KV event feeds and their index (None: history only)."""
        self.stale = stale
        """What the workers' answers say of their feeds (a stale feed is suspected)."""
        self.load_weight = load_weight
        self._rr_p = itertools.count()
        self._rr_d = itertools.count()

    @property
    def policy(self) -> str:
        """The policy in force: ``auto`` resolved for the workers known now (a DP front's
        ranks are a choice, as several workers are)."""
        if self.auto:
            return auto_policy(len(self.prefills), len(self.decodes))
        return self._policy

    def pick(
        self, ids: list[int], avoid_p: set[str], avoid_d: set[str], tenant: str = ""
    ) -> tuple[Prefill, Decode, int, int]:
        """A (prefill, decode) pair, and how many leading prompt tokens each holds as far
        as the router knows (0 but under ``kv_aware``)."""

        ps, ds = usable(self.prefills, avoid_p), usable(self.decodes, avoid_d)
        pf_held = dc_held = 0
        # ties go to the worker used least, so an idle fleet is still spread
        if self.policy == "least_outstanding":
            pf = min(ps, key=lambda x: (x.outstanding, x.used))
            dc = min(ds, key=lambda x: (x.outstanding, x.used))
        elif self.policy == "kv_aware":
            if self.stale is not None:
                self.stale.sweep()
            cached = self._cached(ids, tenant)  # KV events: workers in sync
            pf, pf_held = choose(ps, self._held(ps, ids, tenant, cached), len(ids), pending_tokens)
            dc, dc_held = choose(
                ds,
                self._held(ds, ids, tenant, cached),
                len(ids),
                per_request(self.load_weight, len(ids)),
            )
        else:
            pf = ps[next(self._rr_p) % len(ps)]
            dc = ds[next(self._rr_d) % len(ds)]
        pf.used += 1
        dc.used += 1
        return pf, dc, pf_held, dc_held

    def _salt(self, tenant: str) -> str | None:
        salt_of = getattr(self.backend, "cache_salt", None)
        return salt_of(tenant) if salt_of else None

    def _cached(self, ids: list[int], tenant: str) -> Held:
        """Workers whose KV event feed is in sync, by the prompt's leading tokens held."""
        if self.kv is None:
            return []
        return self.kv.cached_groups(ids, self._salt(tenant))

    def _held(self, ws: list[Any], ids: list[int], tenant: str, cached: Held) -> Held:
        """What each of ``ws`` holds of the prompt: from its KV events while its feed is in
        sync (``cached``), else from the router's own history (at the decodes' page size)."""
        out = list(cached)
        keys: dict[int, list[str]] = {}
        for w in ws:
            if self.kv is not None and self.kv.synced(w.key):
                continue
            size = getattr(w, "page_size", self.decodes[0].page_size)
            if size not in keys:
                keys[size] = page_keys(ids, size, tenant)
            h = w.hit(keys[size]) * size
            if h:
                out.append((h, [w.key]))
        return out

    def judge(
        self,
        n_tokens: int,
        stats: dict[str, Any],
        pf: tuple[str, int, int | None],
        dc: tuple[str, int, int | None],
    ) -> None:
        """A served choice as evidence on its workers' feeds: per leg, its worker, what the
        router credited it with and its feed's mark at the choice (None: the credit did not
        come from its events), against what the worker reported it held (the prefill's
        reused prompt tokens, the decode's restored ones; either may be absent)."""
        if self.stale is None:
            return
        got = [stats.get("prefill_reused_tokens"), stats.get("restored_tokens")]
        self.stale.served(
            n_tokens,
            [
                Served(w, held, ev, int(a) if isinstance(a, (int, float)) else None)
                for (w, held, ev), a in zip((pf, dc), got)
            ],
        )
