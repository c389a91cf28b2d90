"""Error taxonomy: one class per failure kind.

Every failure path in pdxfer raises (or records as a request's ``failure``) one of these
classes, so an engine can branch on the kind and the metrics can count by kind
(``kind`` is the counter label). Messages say what went wrong and where.
"""

from __future__ import annotations


class PdxferError(Exception):
    """Base of every pdxfer error."""

    kind = "error"


class ConfigError(PdxferError, ValueError):
    """Invalid configuration or geometry given by the caller (caught at construction)."""

    kind = "config"


class LayoutMismatch(PdxferError):
    """The two sides' pools cannot be paired (dtype, head size, page size, missing pool)."""

    kind = "layout_mismatch"


class PlanError(PdxferError):
    """A transfer plan would touch memory outside a registered buffer, or indices are invalid."""

    kind = "plan"


class WireError(PdxferError):
    """A control message could not be decoded or failed validation."""

    kind = "wire"


class TransportError(PdxferError):
    """The transport (Mooncake TE) failed a registration or a write."""

    kind = "transport"


class TransportUnavailable(TransportError):
    """The transport library cannot be loaded (missing package or system library)."""

    kind = "transport_unavailable"


class BootstrapError(PdxferError):
    """The bootstrap server refused a registration or a lookup, or could not be reached."""

    kind = "bootstrap"


class DuplicateRoom(PdxferError):
    """A room id is already active on this endpoint."""

    kind = "duplicate_room"


class DeadlineExceeded(PdxferError):
    """A request stayed in a non-terminal state past its deadline."""

    kind = "deadline"


class PeerLost(PdxferError):
    """A peer endpoint stopped answering (process died, transport session closed)."""

    kind = "peer_lost"


class Aborted(PdxferError):
    """The request was aborted by the local engine or by the peer."""

    kind = "aborted"


class RemoteFailure(PdxferError):
    """The peer reported that the request failed on its side; the message carries its reason."""

    kind = "remote"


FAILURE_KINDS: tuple[str, ...] = tuple(
    c.kind
    for c in (
        PdxferError,
        ConfigError,
        LayoutMismatch,
        PlanError,
        WireError,
        TransportError,
        TransportUnavailable,
        BootstrapError,
        DuplicateRoom,
        DeadlineExceeded,
        PeerLost,
        Aborted,
        RemoteFailure,
    )
)
