"""Error taxonomy: one class per failure kind.

Every failure path in pdxfer raises (or records as a request's ``failure``) one of these
classes, so an engine can branch on the kind and the metrics can count by kind
(``kind`` is the counter label). Messages say what went wrong and where.
"""

from __future__ import annotations

_BY_KIND: dict[str, type[PdxferError]] = {}


class PdxferError(Exception):
    """Base of every pdxfer error. Each subclass names its own ``kind`` and is registered
    under it, so a kind that crossed the wire becomes the same class on the other side."""

    kind = "error"

    def __init_subclass__(cls, **kw: object) -> None:
        # Only this module's classes name kinds that cross the wire; subpackages and engines
        # may reuse a label (a metrics kind) without taking it over.
        super().__init_subclass__(**kw)
        if cls.__module__ == __name__:
            assert cls.kind not in _BY_KIND, f"failure kind {cls.kind!r} defined twice"
            _BY_KIND[cls.kind] = cls


class ConfigError(PdxferError, ValueError):
    """Invalid configuration or geometry given by the caller (caught at construction)."""

    kind = "config"


class UntrustedBootstrap(ConfigError):
    """A request named a bootstrap server that is not in the decode's trusted list: refused
    before any connection, so a caller cannot make a decode load KV from a prefill it chose."""

    kind = "untrusted_bootstrap"


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


class IntegrityError(PdxferError):
    """KV that arrived (or was restored) does not match the digest of what was sent (or
    stored); the message names the pool, layer and token range."""

    kind = "integrity"


class ProtocolError(PdxferError):
    """A peer broke the protocol (a message out of order, from an unknown peer, or for a
    room it does not own)."""

    kind = "protocol"


class UnknownRoom(PdxferError):
    """The prefill asked does not hold the room and does not expect it: it ended there
    already, or the prefill's engine did not open it within ``room_grace_s`` of the
    request (a room nobody holds fails in seconds, not at the bootstrap deadline)."""

    kind = "unknown_room"


_BY_KIND[PdxferError.kind] = PdxferError


def failure_kinds() -> tuple[str, ...]:
    """Every failure kind an endpoint can report (and a peer can name on the wire)."""
    return tuple(sorted(_BY_KIND))


def from_kind(kind: str, message: str) -> PdxferError:
    """The error a peer named by ``kind`` (a ``RemoteFailure`` for a kind this side does not
    know: a newer peer, or garbage); the message says where it came from."""
    cls = _BY_KIND.get(kind, RemoteFailure)
    try:
        return cls(message)
    except Exception:  # noqa: BLE001 - a class that needs other arguments
        return RemoteFailure(message)
