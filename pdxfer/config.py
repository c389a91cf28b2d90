"""Configuration in one place: ``EndpointConfig`` and every ``PDXFER_*`` knob.

Knobs are process-wide settings that come from the environment. They are read once, on first
use (``knobs()``), never at import, so a test or tool can set them before the first endpoint
starts. ``ENV_VARS`` lists every ``PDXFER_*`` variable the project reads, with its help text:
docs/configuration.md is generated from it (``scripts/gen_config_docs.py``), and
``tests/unit/test_config_docs.py`` fails on a ``PDXFER_`` name used anywhere but missing here.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigError
from .netaddr import advertised, parse_hostports


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One ``PDXFER_*`` environment variable: where it is read and what it does."""

    name: str
    default: str
    help: str
    scope: Literal["library", "engine", "tools"] = "library"
    """``library``: read by ``knobs()`` in every pdxfer process; ``engine``: read by an engine
    integration when one of its managers starts (not cached); ``tools``: read only by the
    set-up scripts, tests or benchmarks."""


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("PDXFER_SECRET", "unset",
           "shared secret (>= 16 bytes) for access control: signs bootstrap requests and every "
           "control frame; ``EndpointConfig(secret=...)`` overrides"),
    EnvVar("PDXFER_SECRET_FILE", "unset",
           "a file holding the shared secret (read at start; used when ``PDXFER_SECRET`` is "
           "unset)"),
    EnvVar("PDXFER_INSECURE", "unset",
           "``1``: serve non-loopback peers without a secret (protected mode off; one warning "
           "at start names what is open)"),
    EnvVar("PDXFER_TRUSTED_BOOTSTRAPS", "unset",
           "SGLang decodes: the bootstrap servers (``host:port,...``) they load from",
           "engine"),
    EnvVar("PDXFER_FAULTS", "unset",
           "fault injection for tests, e.g. ``delay_write=1.5,rooms=7;8,drop=0.01,seed=3`` "
           "(``pdxfer/faults.py`` lists every item); costs one attribute check when unset"),
    EnvVar("PDXFER_GATHER", "1",
           "``0``: the prefill never gathers head slices through the decode's staging memory"),
    EnvVar("PDXFER_STAGING_MB", "256",
           "decode staging memory for head slices of host pools (``0``: none, slices are "
           "written in place)"),
    EnvVar("PDXFER_PACK_MB", "256",
           "pack staging of an endpoint whose pools may pack (``EndpointConfig.pack``: device "
           "pools under ``auto``), on their device: the decode's leases and the prefill's "
           "gather (``0``: no packing)"),
    EnvVar("PDXFER_PACK_MIN_PAGES", "64",
           "``pack='auto'``: a request packs a pool only when it asks at least this many of "
           "its pages"),
    EnvVar("PDXFER_PACK_MAX_PAGE_KB", "256",
           "``pack='auto'``: a request packs a pool only when one page of one buffer is at "
           "most this large (larger pages already make large transfers)"),
    EnvVar("PDXFER_COPY_THREADS", "min(4, cores)",
           "threads for L2 <-> L1 page copies and staging scatters"),
    EnvVar("PDXFER_COPY_NICE", "10", "how much nicer copy threads run than the process"),
    EnvVar("PDXFER_COPY_STREAM", "1",
           "``0``: plain ``memmove`` per page instead of the native streaming copier"),
    EnvVar("PDXFER_NIXL_THREADS", "min(2, cores)",
           "UCX threads a large NIXL write is split across (``1``: the posting thread alone)"),
    EnvVar("PDXFER_NIXL_TICK_US", "100000",
           "longest sleep of NIXL's UCX progress thread between events (NIXL's own: 0, it spins)"),
    EnvVar("PDXFER_TE_COMPLETION", "paced",
           "how Mooncake writes are awaited: ``paced`` (a write of at most 64 entries and at "
           "least 1 MiB is polled without spinning; others sleep through most of the "
           "expected time, then spin) or ``sync`` (each batch one blocking call, which busy-waits)"),
    EnvVar("PDXFER_CONTROL_SEND", "direct",
           "how control frames leave: ``direct`` (the sending thread writes ZMTP itself) or "
           "``zmq`` (ZMQ PUSH sockets, one I/O-thread wake-up per message)"),
    EnvVar("PDXFER_LOG", "WARNING", "log level of test and benchmark agent processes"),
    EnvVar("PDXFER_API_KEYS", "unset",
           "router API keys, ``KEY`` or ``TENANT:KEY,TENANT:KEY``: clients must send "
           "``Authorization: Bearer KEY``; the key's tenant scopes prefix reuse"),
    EnvVar("PDXFER_EXTRAS", "cpu,test,bench,nixl", "``scripts/setup.sh``: the extras of "
           "pdxfer to install (``scripts/test.sh`` adds ``vllm``)", "tools"),
    EnvVar("PDXFER_SOAK_FULL", "unset",
           "tests: ``1`` runs the full 20,000-request soak instead of the reduced one", "tools"),
    EnvVar("PDXFER_FLOOD_S", "10", "tests: seconds of the control-socket flood test", "tools"),
    EnvVar("PDXFER_TRACE_VLLM", "unset",
           "``scripts/trace_vllm_prefill.py``/``bench_vllm.py``: a folder where a vLLM server "
           "started with ``scripts/trace_hooks`` on its PYTHONPATH writes its prefill-leg stamps",
           "tools"),
    EnvVar("PDXFER_TRACE_NO_PAUSE", "unset",
           "tracing only: ``1`` turns off the prefill's yield to vLLM's output thread in the step "
           "after a finish (to measure what it buys)", "tools"),
    EnvVar("PDXFER_SGLANG_SHOW_STDERR", "unset",
           "tests: ``1`` prints the SGLang test servers' stderr", "tools"),
)
"""Every ``PDXFER_*`` variable, in one place (``Knobs.from_env`` reads the ``library`` ones)."""


@dataclass(frozen=True, slots=True)
class Knobs:
    """Every ``PDXFER_*`` environment setting, parsed and validated once."""

    secret: str | None = None
    secret_file: str | None = None
    insecure: bool = False
    faults: str = ""
    gather: bool = True
    staging_mb: float = 256.0
    pack_mb: float = 256.0
    pack_min_pages: int = 64
    pack_max_page_kb: float = 256.0
    copy_threads: int = 0
    copy_nice: int = 10
    copy_stream: bool = True
    nixl_threads: int = 0
    nixl_tick_us: int = 100_000
    te_completion: str = "paced"
    control_send: str = "direct"
    log_level: str = "WARNING"
    api_keys: str = ""

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Knobs:
        def num(name: str, kind: type, default: float) -> float:
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                v = kind(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a {kind.__name__}") from None
            if v < 0:
                raise ConfigError(f"{name} must be >= 0, got {raw!r}")
            return v

        return Knobs(
            secret=env.get("PDXFER_SECRET") or None,
            secret_file=env.get("PDXFER_SECRET_FILE") or None,
            insecure=env.get("PDXFER_INSECURE", "") not in ("", "0"),
            faults=env.get("PDXFER_FAULTS", ""),
            gather=env.get("PDXFER_GATHER", "1") != "0",
            staging_mb=float(num("PDXFER_STAGING_MB", float, 256.0)),
            pack_mb=float(num("PDXFER_PACK_MB", float, 256.0)),
            pack_min_pages=int(num("PDXFER_PACK_MIN_PAGES", int, 64)),
            pack_max_page_kb=float(num("PDXFER_PACK_MAX_PAGE_KB", float, 256.0)),
            copy_threads=int(num("PDXFER_COPY_THREADS", int, 0)),
            copy_nice=int(num("PDXFER_COPY_NICE", int, 10)),
            copy_stream=env.get("PDXFER_COPY_STREAM", "1") != "0",
            nixl_threads=int(num("PDXFER_NIXL_THREADS", int, 0)),
            nixl_tick_us=int(num("PDXFER_NIXL_TICK_US", int, 100_000)),
            te_completion=env.get("PDXFER_TE_COMPLETION", "") or "paced",
            control_send=env.get("PDXFER_CONTROL_SEND", "") or "direct",
            log_level=env.get("PDXFER_LOG", "") or "WARNING",
            api_keys=env.get("PDXFER_API_KEYS", ""),
        )

    @property
    def copy_workers(self) -> int:
        return self.copy_threads or max(1, min(4, os.cpu_count() or 1))

    @property
    def nixl_workers(self) -> int:
        return self.nixl_threads or max(1, min(2, os.cpu_count() or 1))


_KNOBS: Knobs | None = None
_KNOBS_LOCK = threading.Lock()


def knobs() -> Knobs:
    """The process's knobs, read from the environment on the first call."""
    global _KNOBS
    if _KNOBS is None:
        with _KNOBS_LOCK:
            if _KNOBS is None:
                _KNOBS = Knobs.from_env(os.environ)
    return _KNOBS


def mooncake_env_defaults(timeout_s: float, protocol: str) -> None:
    """Mooncake Transfer Engine reads its settings only from the environment, once, when an
    engine starts: this is the one place pdxfer sets them, and it never overrides a value the
    user exported (``MC_*`` variables are Mooncake's, listed in its documentation)."""
    secs = max(1, int(timeout_s + 0.999))
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, secs)))
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(secs))
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if protocol == "tcp":
        # More lanes per peer than Mooncake's 4 let paced (non-spinning) completion overlap
        # more entries in bulk; 16 made a lone write slower than 8
        # (docs/performance.md#what-pdxfer-does-to-be-fast-here).
        os.environ.setdefault("MC_TCP_LANES_PER_PEER", "8")


def nixl_env_defaults() -> None:
    """NIXL logs every agent and backend start at INFO; keep warnings and errors (a value
    the user exported wins). UCX's own transport choice (``UCX_TLS``) is left alone."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One rank's settings. Every wait has a deadline here; defaults suit a cluster, tests
    shorten them. Each field's meaning is in the string below it."""

    role: Literal["prefill", "decode"]
    bootstrap: str | None = None
    instance: str = "default"
    host: str = "127.0.0.1"
    """The address the control socket binds (a wildcard binds every interface; Mooncake's
    listeners bind every interface whatever this says)."""
    advertise: str = ""
    """The address peers reach this rank at (control socket, transport session); empty: the
    bound ``host``, which then must not be a wildcard. It must be an address of this host;
    a loopback one is refused as soon as a peer is known to be on another host
    (``netaddr``)."""
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    transport: str = "auto"
    """``auto``: the fastest transport both sides run, picked at pairing (``transport/auto.py``:
    NIXL on one host, Mooncake TCP across hosts; for device pools NVLink on one node and RDMA
    across nodes where they run); ``tcp``/``rdma``/``nvlink`` (Mooncake; ``nvlink`` is its
    ``nvlink_intra``, device pools on one node only) or ``nixl`` explicitly (then both sides
    must name the same)."""
    device: str = ""
    workers: int = 4
    bootstrap_timeout_s: float = 30.0
    """A prefill sender waits this long for the decode's request; a
    decode receiver this long to find and handshake its prefill endpoints."""
    transfer_timeout_s: float = 60.0
    """From the decode's request to the last ``TransferDone``."""
    abort_timeout_s: float = 5.0
    """How long a failed request's pages wait for the prefill to confirm
    that no write is in flight before they are counted as quarantined."""
    room_grace_s: float = 5.0
    """(prefill) How long a decode's request for a room this prefill never
    saw is held for its engine to open it (early dispatch: the decode may ask first), at
    most ``bootstrap_timeout_s``; then it is refused as ``UnknownRoom``. A request for a
    room that already ended here is refused at once. An engine that opens a room only
    once it schedules a queued request declares it on arrival (``Endpoint.expect``): a
    request for an expected room waits up to ``bootstrap_timeout_s``."""
    route_fresh_s: float = 10.0
    """(decode) How long a prefill instance's route (its endpoints, looked up
    at the bootstrap) is reused without a room through it succeeding. A prefill that died
    while no room waited on it and came back as a new process is otherwise still reached
    at its dead address by the next request, which then fails (``PeerLost``); an older
    route is looked up again (one bootstrap request)."""
    heartbeat_s: float = 0.5
    """How often the decode probes the prefill endpoints it waits on; two
    failed probes in a row declare the peer lost."""
    start_in_send: bool = True
    """A chunk whose write is one small batch (at most ``max_batch / 2``
    entries, 32 MiB), with nothing else in flight to that decode, is planned and submitted
    from ``send()`` itself (once it has released the endpoint's lock) and only awaited on a
    worker: a small request then does not wait for a worker thread to wake, and the caller
    pays the transport's submission instead (docs/performance.md#what-pdxfer-does-to-be-fast-here).
    False leaves every write to the workers."""
    integrity: Literal["off", "sampled", "full"] = "sampled"
    """How a decode checks the KV it received before it reports Success
    (``sampled``: a fixed sample of every page, ``full``: every byte, ``off``); the decode
    asks its senders for digests in this mode (``integrity.py``)."""
    integrity_retry: bool = False
    """On a digest mismatch, ask that sender for the range once more
    (through the repair path the tiers use: the prefill holds the room's pages until the
    decode's ``Release``) before failing with ``IntegrityError``. It costs the prefill its
    pages for one more round trip per request, so it is off by default; it does nothing
    with ``integrity='off'``."""
    pack: Literal["auto", "on", "off"] = "auto"
    """Whether a decode has a request's pages packed (``plan/pack.py``): the prefill
    gathers a chunk's token rows into its pack staging, one large write moves them into
    a lease of the decode's, which scatters them into its pages before Success. ``auto``
    (default): pools on a device on both sides, with small pages
    (``PDXFER_PACK_MAX_PAGE_KB``) and many of them (``PDXFER_PACK_MIN_PAGES``); host
    pools keep the direct path. ``on``: every pool of whole token rows, host pools too;
    ``off``: never. Both sides allocate ``PDXFER_PACK_MB`` of staging on their pools'
    device (a request that does not fit is written directly)."""
    fan_out: bool = False
    """(prefill) A room may be served to several decode groups, each asking with
    its own request. Off by default: a room belongs to the decode named by
    ``sender(room, peer=...)``, else to the decode group (the TP ranks of one decode
    instance) that asks first, and any other decode asking for it is refused. Turn it on
    only when the engine sends one prefill to several decodes on purpose (a mirrored or
    standby decode that must hold the same KV)."""
    register_interval_s: float = 10.0
    """A prefill rank registers again this often, so a route a bootstrap lost or another
    endpoint took over heals by itself."""
    model_id: str = ""
    """The engine's model fingerprint (weights digest and config, e.g. ``key=value`` pairs);
    a prefill refuses a decode whose fingerprint differs, naming the difference."""
    max_pending: int = 4096
    max_pending_bytes: int = 64 << 20
    """With ``max_pending``: requests (and their bytes) a prefill holds for rooms whose sender
    does not exist yet; past either, a request is refused (``busy``)."""
    max_peers: int = 4096
    """Decode endpoints a prefill keeps a handshake with (the least recently used idle one is
    dropped for a new one)."""
    max_tombstones: int = 65536
    """Rooms that ended (succeeded, failed or aborted) remembered so that a late request for
    them is refused at once (oldest forgotten first)."""
    endpoint_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    secret: str | None = field(default=None, repr=False)
    """Shared secret for HMAC on bootstrap requests and every control frame; None reads ``PDXFER_SECRET``
    or ``PDXFER_SECRET_FILE`` (and leaves access control off when neither is set)."""
    insecure: bool = False
    """Without a secret, serve control peers on other hosts anyway (``PDXFER_INSECURE`` does the
    same); otherwise such an endpoint accepts loopback peers only and refuses to start on a
    non-loopback address (``protect``)."""
    trusted_bootstraps: tuple[str, ...] = ()
    """A decode's trusted bootstrap servers (``host:port``): when set, ``receiver()`` refuses
    any other address before connecting (``UntrustedBootstrap``). Engines' decodes require it
    (a caller must never choose where the decode loads KV from)."""

    @property
    def address(self) -> str:
        """The address this rank advertises (``advertise``, else ``host``)."""
        return advertised(self.host, self.advertise)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        for r, s, what in ((self.tp_rank, self.tp_size, "tp"), (self.dp_rank, self.dp_size, "dp"),
                           (self.pp_rank, self.pp_size, "pp")):
            if s < 1 or not 0 <= r < s:
                raise ConfigError(f"{what}_rank {r} must be in [0, {what}_size={s})")
        if self.workers < 1:
            raise ConfigError("workers must be >= 1")
        for name in ("max_pending", "max_pending_bytes", "max_peers", "max_tombstones"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "abort_timeout_s", "heartbeat_s",
                     "register_interval_s", "room_grace_s", "route_fresh_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.pack not in ("auto", "on", "off"):
            raise ConfigError(f"pack must be auto, on or off, got {self.pack!r}")
        if self.integrity not in ("off", "sampled", "full"):
            raise ConfigError(f"integrity must be off, sampled or full, got {self.integrity!r}")
        advertised(self.host, self.advertise)  # a wildcard needs an address to advertise
        object.__setattr__(self, "trusted_bootstraps",
                           parse_hostports(self.trusted_bootstraps, "trusted bootstrap"))
        if self.transport not in ("auto", "tcp", "rdma", "nvlink", "nixl", "memory"):
            raise ConfigError(f"transport must be 'auto', 'tcp', 'rdma' or 'nvlink' (Mooncake; "
                              f"nvlink: device pools on one node), 'nixl', or 'memory' "
                              f"(in-process, for tests), got {self.transport!r}")
