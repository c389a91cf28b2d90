"""How the workers use ``pdxfer.tiers``: the one prefix cache of the served system.

The model's pools are L1. L2 is host pages (``--l2-pages``). On the decode, L3 is files
(``--l3-dir``) or Mooncake Store (``--l3-mooncake``), so a prompt seen before a restart is
restored from storage. Keys are the tiers' hash chain, salted by the pools' layout and the
model fingerprint, and scoped per request by tenant: one tenant's prompts are never another's
hits. Target and draft pools share page ids, so a restored prefix brings its draft KV along.

The prefill uses the same cache without L3: a prefix it computed before is loaded into the
request's pages instead of being recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdxfer.tiers import FileStorage, StorageBackend, TieredCache

from .worker import ModelHost, WorkerConfig

log = logging.getLogger("pdxfer.serving.toy.tiered")


def make_storage(cfg: WorkerConfig) -> StorageBackend | None:
    """The decode's L3, or None (``--no-l3``, or a prefill)."""
    if cfg.l3 == "file":
        return FileStorage(cfg.l3_dir, max_bytes=cfg.l3_max_bytes or None)
    if cfg.l3 == "mooncake":
        from pdxfer.tiers import MooncakeStoreStorage

        return MooncakeStoreStorage(cfg.l3_mooncake, cfg.l3_mooncake_metadata, host=cfg.host,
                                    segment_bytes=cfg.l3_mooncake_segment_bytes)
    return None


def make_cache(cfg: WorkerConfig, host: ModelHost) -> TieredCache | None:
    """The worker's tiered cache, or None when it has neither L2 nor L3."""
    if cfg.l2_pages <= 0:
        if cfg.l3 != "off":
            log.warning("L3 needs L2 pages to stage through: L3 is off (--l2-pages 0)")
        return None
    storage = make_storage(cfg)
    # host landing: pages are tokens, so the same capacity is l2_pages * page_size of them
    l2 = cfg.l2_pages * (cfg.page_size if cfg.token_granular else 1)
    cache = TieredCache(host.pools, host_pages=l2, storage=storage,
                        model_id=host.fingerprint)
    log.info("%s tiers: L2 %d pages, L3 %s", cfg.role, l2,
             {"file": cfg.l3_dir, "mooncake": cfg.l3_mooncake}.get(cfg.l3, "off"))
    return cache


def reuse(cache: TieredCache, tokens: Sequence[int], pages: Sequence[int], scope: str) -> int:
    """Load the longest cached prefix of ``tokens`` into ``pages`` (L2 only; at least the
    last token is left to compute); returns how many tokens are now in place."""
    m = cache.match(tokens, len(tokens), 0, scope)
    try:
        good = cache.load(m, {"kv": list(pages[:m.promised_pages])}) if m.promised_pages else 0
    finally:
        cache.finish(m)
    return good * cache.page_size
