"""Pure address math: which bytes go where. No process, no transport, no threads.

Reading order: ``paged`` (blocks, runs, page-size mapping, bounds) -> ``heads`` (head slices
and the staged layout) and ``pieces`` (state slots split over TP) -> ``topology`` (which prefill rank a decode rank asks) -> ``chunk``
(one chunk's plan for one decode peer, TransferRequest validation, and the per-layer token
order a partial-layer ``send()`` must keep: ``claim``).
Imports only ``pools``, ``errors``, ``config`` and numpy.
"""

from .paged import (
    FEW_PAGES,
    MAX_BATCH_ENTRIES,
    Blocks,
    BufferPairing,
    as_indices,
    check_bounds,
    layer_subset,
    pair_buffers,
    plan_paged,
    plan_slots,
    runs,
)

__all__ = [
    "FEW_PAGES",
    "MAX_BATCH_ENTRIES",
    "Blocks",
    "BufferPairing",
    "as_indices",
    "check_bounds",
    "layer_subset",
    "pair_buffers",
    "plan_paged",
    "plan_slots",
    "runs",
]
