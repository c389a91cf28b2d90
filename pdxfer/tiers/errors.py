"""Failure kinds of the decode-side tiers (all ``PdxferError``, so metrics count them)."""

from __future__ import annotations

from ..errors import PdxferError


class CapacityError(PdxferError):
    """A tier has no free (unpinned) pages for a group allocation; nothing was taken."""

    kind = "capacity"


class StorageError(PdxferError):
    """An L3 backend could not be set up or answered with an error."""

    kind = "storage"


class RestoreFailed(PdxferError):
    """A promised prefix could not be restored and could not be repaired."""

    kind = "restore"
