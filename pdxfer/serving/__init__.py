"""The model side of the serving layer: a toy transformer with paged, transferable KV."""

from .kv import AttentionKind, KVPool, OutOfPagesError, PageAllocator, PageTable, copy_pages
from .model import (
    EOS_ID,
    KV_DTYPES,
    SpecResult,
    ToyConfig,
    ToyModel,
    decode,
    encode,
    make_draft,
    speculative_generate,
)

__all__ = [
    "EOS_ID", "KV_DTYPES", "AttentionKind", "KVPool", "OutOfPagesError", "PageAllocator",
    "PageTable", "SpecResult", "ToyConfig", "ToyModel", "copy_pages", "decode", "encode",
    "make_draft", "speculative_generate",
]
