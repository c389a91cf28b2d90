"""How the workers use ``pdxfer.tiers``: the one prefix cache of the served system.

The model's pools are L1. L2 is host pages (``--l2-pages``). On the decode, L3 is files
(``--l3-dir``) or Mooncake Store (``--l3-mooncake``), so a prompt seen before a restart is
restored from storage. Keys are the tiers' hash chain, salted by the pools' layout and the
model fingerprint, and scoped per request by tenant: one tenant's prompts are never another's
hits. Target and draft pools share page ids, so a restored prefix brings its draft KV along.

The prefill uses the same cache without L3. At TP > 1 every rank has a cache of its own
over its own heads (keys salted by TP size and rank, L3 files under ``rank<r>``): a rank
restores its heads, and a restore that comes up short is repaired from the prefill rank
that sent them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import numpy as np

from pdxfer import RequestHandle
from pdxfer.netaddr import advertised
from pdxfer.tiers import FileStorage, RestoringReceiver, StorageBackend, TieredCache

from .kvpub import KvEventsObserver
from .worker import ModelHost, WorkerConfig

log = logging.getLogger(__name__)


def rank_l3_dir(cfg: WorkerConfig, tp_rank: int) -> str:
    """A rank's L3 folder: ``--l3-dir`` itself at TP 1."""
    return cfg.l3_dir if cfg.tp == 1 else os.path.join(cfg.l3_dir, f"rank{tp_rank}")


def make_storage(cfg: WorkerConfig, tp_rank: int = 0) -> StorageBackend | None:
    """The decode's L3, or None (``--no-l3``, or a prefill)."""
    if cfg.l3 == "file":
        return FileStorage(rank_l3_dir(cfg, tp_rank), max_bytes=cfg.l3_max_bytes or None)
    if cfg.l3 == "mooncake":
        from pdxfer.tiers import MooncakeStoreStorage

        # the store registers this decode's segment under the address peers dial
        return MooncakeStoreStorage(
            cfg.l3_mooncake,
            cfg.l3_mooncake_metadata,
            host=advertised(cfg.host, cfg.advertise),
            segment_bytes=cfg.l3_mooncake_segment_bytes,
        )
    return None


def make_cache(cfg: WorkerConfig, host: ModelHost) -> TieredCache | None:
    """The worker's tiered cache, or None when it has neither L2 nor L3."""
    if cfg.l2_pages <= 0:
        if cfg.l3 != "off":
            log.warning("L3 needs L2 pages to stage through: L3 is off (--l2-pages 0)")
        return None
    storage = make_storage(cfg, host.tp_rank)
    # host landing: pages are tokens, so the same capacity is l2_pages * page_size of them
    l2 = cfg.l2_pages * (cfg.page_size if cfg.token_granular else 1)
    cache = TieredCache(host.pools, host_pages=l2, storage=storage, model_id=host.fingerprint)
    log.info(
        "%s tiers: L2 %d pages, L3 %s",
        cfg.role,
        l2,
        {"file": cfg.l3_dir, "mooncake": cfg.l3_mooncake}.get(cfg.l3, "off"),
    )
    if cfg.kv_events and host.tp_rank == 0:
        ep, _, replay = cfg.kv_events.partition(",")
        cache.observer = KvEventsObserver(ep, replay or None, mute=cfg.kv_events_mute)
        log.info("%s KV events on %s", cfg.role, cfg.kv_events)
    return cache


def reuse(cache: TieredCache, tokens: Sequence[int], pages: Sequence[int], scope: str) -> int:
    """Load the longest cached prefix of ``tokens`` into ``pages`` (L2 only; at least the
    last token is left to compute); returns how many tokens are now in place."""
    m = cache.match(tokens, len(tokens), 0, scope)
    try:
        want = np.asarray(pages[: m.promised_pages], dtype=np.int64)
        good = cache.load(m, {"kv": want}) if m.promised_pages else 0
    finally:
        cache.finish(m)
    return good * cache.page_size


def open_receiver(
    host: ModelHost,
    cache: TieredCache | None,
    room: int,
    bootstrap: str,
    instance: str | None,
    tokens: Sequence[int],
    dst: Sequence[int],
    slot: int,
    n: int,
    tenant: str,
    release: Callable[..., None],
) -> RequestHandle:
    """One rank's receiver for a prompt's KV into pages ``dst``: restoring the prefix this
    rank holds (its own heads) while the network brings the rest, or the whole prompt from
    the network when the worker keeps no cache."""
    if cache is not None:
        return RestoringReceiver(
            cache,
            host.endpoint,
            room,
            bootstrap,
            tokens,
            {"kv": dst},
            {"aux": slot},
            num_tokens=n,
            release=release,
            instance=instance,
            scope=tenant,
        )
    rx = host.endpoint.receiver(room, bootstrap=bootstrap, instance=instance, release=release)
    rx.request({"kv": dst}, slots={"aux": slot}, num_tokens=n)
    return rx
