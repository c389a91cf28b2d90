"""The toy engine: a tiny seeded transformer with paged, transferable KV, its prefill and
decode workers, a local cluster and the demo. One engine among others behind the router.

Names are imported lazily (PEP 562) so that ``pdxfer --help`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_KV = ("AttentionKind", "KVPool", "OutOfPagesError", "PageAllocator", "PageTable", "copy_pages")
_MODEL = (
    "EOS_ID",
    "KV_DTYPES",
    "SpecResult",
    "ToyConfig",
    "ToyModel",
    "decode",
    "encode",
    "make_draft",
    "speculative_generate",
)

__all__ = sorted(_KV + _MODEL)


def __getattr__(name: str) -> Any:
    if name in _KV:
        return getattr(importlib.import_module(".kv", __name__), name)
    if name in _MODEL:
        return getattr(importlib.import_module(".model", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
