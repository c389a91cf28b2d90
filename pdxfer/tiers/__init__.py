"""Decode-side KV tiers: L2 host cache, L3 storage, prefix restore with incremental transfer.

An engine builds one ``TieredCache`` per decode rank over its pool group, then per request
either a plain ``KVReceiver`` or a ``RestoringReceiver`` (prefix from L1/L2/L3, suffix over
the network), and calls ``write_back`` when a request finishes.
"""

from typing import TYPE_CHECKING

from .cache import Match, TieredCache
from .errors import CapacityError, RestoreFailed, StorageError
from .host import HostCache
from .keys import page_keys, pool_key
from .observer import CacheObserver
from .restore import RestoreState, RestoringReceiver
from .storage import FileStorage, StorageBackend, prefix_hits

if TYPE_CHECKING:  # at run time ``__getattr__`` imports them on first use
    from .mooncake_store import MooncakeMaster as MooncakeMaster
    from .mooncake_store import MooncakeStoreStorage as MooncakeStoreStorage


def __getattr__(name: str) -> object:
    """Mooncake Store's names load Mooncake only when asked for."""
    if name in ("MooncakeMaster", "MooncakeStoreStorage"):
        from . import mooncake_store

        return getattr(mooncake_store, name)
    raise AttributeError(f"module 'pdxfer.tiers' has no attribute {name!r}")


__all__ = [
    "CacheObserver",
    "CapacityError",
    "FileStorage",
    "HostCache",
    "Match",
    "RestoreFailed",
    "RestoreState",
    "RestoringReceiver",
    "StorageBackend",
    "StorageError",
    "TieredCache",
    "page_keys",
    "pool_key",
    "prefix_hits",
]
