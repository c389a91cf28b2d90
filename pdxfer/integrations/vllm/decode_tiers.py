"""A decode rank's tiers: host DRAM (L2) and storage (L3) under vLLM's blocks (``l2_pages``).

Built once at registration from the rank's pools (``rank.RankKV``); the loader
(``loader.py``) restores through them and writes finished requests back to them. A hybrid
model keeps only its full-attention groups (``groups.tiered`` says why).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pdxfer import ConfigError
from pdxfer.tiers import FileStorage, StorageBackend, TieredCache

from . import groups as G
from .rank import RankKV

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeTiers:
    cache: TieredCache | None
    """None: no tiers (``l2_pages`` 0, a prefill, or a hybrid model's tiers refused)."""
    tiered: tuple[str, ...] = ()
    """A hybrid model's pools kept in and restored from L2/L3 (``groups.tiered``)."""

    def stats(self) -> dict[str, int] | None:
        return self.cache.stats() if self.cache is not None else None

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            if self.cache.storage is not None:
                self.cache.storage.close()


def build(kv: RankKV) -> DecodeTiers:
    """The tiers ``kv.cfg`` asks for (none on a prefill)."""
    if kv.cfg.side != "decode" or kv.cfg.l2_pages <= 0:
        return DecodeTiers(None)
    if kv.hybrid:
        return _group_tiers(kv)
    return DecodeTiers(_cache(kv, list(kv.pools.values())))


def _cache(kv: RankKV, pools: list) -> TieredCache:
    r = kv.rank
    return TieredCache(
        pools,
        host_pages=kv.cfg.l2_pages,
        storage=_storage(kv),
        model_id=f"{kv.fingerprint} blocks={','.join(str(g.block_size) for g in kv.groups)}",
        salt=f"tp{r.tp_rank}/{r.tp_size}",
    )


def _group_tiers(kv: RankKV) -> DecodeTiers:
    """Decode-side tiers for a hybrid model: its full-attention groups only
    (``groups.tiered`` says why the others always come from the prefill)."""
    keep = G.tiered(kv.groups)
    rest = ", ".join(g.describe() for g in kv.groups if g not in keep)
    out = DecodeTiers(None)
    if keep:
        try:
            out = DecodeTiers(
                _cache(kv, [kv.pools[g.pool] for g in keep]), tuple(g.pool for g in keep)
            )
        except ConfigError as e:
            log.warning("pdxfer: decode-side tiers (l2_pages) are not used for this model: %s", e)
            return out
    log.log(
        logging.INFO if keep else logging.WARNING,
        "pdxfer: decode-side tiers restore %s; %s always load from the prefill (a "
        "window block is not kept once the window passed it; a Mamba/linear state "
        "is sound only at a position the prefill checkpointed, so none is saved)",
        ", ".join(g.describe() for g in keep) or "no group of this model",
        rest,
    )
    return out


def _storage(kv: RankKV) -> StorageBackend | None:
    c, r = kv.cfg, kv.rank
    if c.l3 == "file":
        # one folder per rank: each rank's pages hold its own heads
        root = os.path.join(c.l3_dir, f"tp{r.tp_rank}of{r.tp_size}")
        if c.dp_size > 1:  # and per data-parallel rank: each is a decode of its own
            root = os.path.join(c.l3_dir, f"dp{c.dp_rank}", f"tp{r.tp_rank}of{r.tp_size}")
        return FileStorage(root, max_bytes=int(c.l3_max_gb * (1 << 30)) or None)
    if c.l3 == "mooncake":
        from pdxfer.tiers import MooncakeStoreStorage

        return MooncakeStoreStorage(
            c.l3_mooncake,
            c.l3_mooncake_metadata,
            host=c.get("host"),
            segment_bytes=c.l3_mooncake_segment_mb << 20,
        )
    return None
