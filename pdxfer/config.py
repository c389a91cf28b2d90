"""Configuration in one place: ``EndpointConfig`` (with its ``Limits``) and the ``PDXFER_*`` knobs.

Each setting is one dataclass field carrying its default, help and environment name
(``setting.py``); CLI flags, the vLLM connector's keys, ``ENV_VARS`` and docs/configuration.md
are generated from those fields. Knobs come from the environment, read once on first use
(``knobs()``), never at import, so a test or tool can set them before the first endpoint starts.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .errors import ConfigError
from .netaddr import advertised, parse_hostports
from .setting import Setting, setting, settings_of


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


@dataclass(frozen=True, slots=True)
class Knobs:
    """Every ``PDXFER_*`` setting of the library, parsed and validated once (``from_env``)."""

    secret: str | None = setting(
        None,
        "shared secret (>= 16 bytes) for access control: signs bootstrap requests and "
        "every control frame; ``EndpointConfig(secret=...)`` overrides",
        env="PDXFER_SECRET",
    )
    secret_file: str | None = setting(
        None,
        "a file holding the shared secret (read at start; used when ``PDXFER_SECRET`` is unset)",
        env="PDXFER_SECRET_FILE",
    )
    insecure: bool = setting(
        False,
        "``1``: serve non-loopback peers without a secret (protected mode off; one "
        "warning at start names what is open)",
        env="PDXFER_INSECURE",
    )
    faults: str = setting(
        "",
        "fault injection for tests, e.g. ``delay_write=1.5,rooms=7;8,drop=0.01,seed=3`` "
        "(``pdxfer/faults.py`` lists every item); costs one attribute check when unset",
        env="PDXFER_FAULTS",
    )
    gather: bool = setting(
        True,
        "``0``: the prefill never gathers head slices through the decode's staging memory",
        env="PDXFER_GATHER",
    )
    staging_mb: float = setting(
        256.0,
        "decode staging memory for head slices of host pools (``0``: none, slices are "
        "written in place)",
        env="PDXFER_STAGING_MB",
    )
    pack_mb: float = setting(
        256.0,
        "pack staging of an endpoint whose pools may pack (``Limits.pack``: device "
        "pools under ``auto``), on their device: the decode's leases and the prefill's "
        "gather (``0``: no packing)",
        env="PDXFER_PACK_MB",
    )
    pack_min_pages: int = setting(
        64,
        "``pack='auto'``: a request packs a pool only when it asks at least this many of its pages",
        env="PDXFER_PACK_MIN_PAGES",
    )
    pack_max_page_kb: float = setting(
        256.0,
        "``pack='auto'``: a request packs a pool only when one page of one buffer is "
        "at most this large (larger pages already make large transfers)",
        env="PDXFER_PACK_MAX_PAGE_KB",
    )
    copy_threads: int = setting(
        0,
        "threads for L2 <-> L1 page copies and staging scatters",
        env="PDXFER_COPY_THREADS",
        shown="min(4, cores)",
    )
    copy_nice: int = setting(
        10, "how much nicer copy threads run than the process", env="PDXFER_COPY_NICE"
    )
    copy_stream: bool = setting(
        True,
        "``0``: plain ``memmove`` per page instead of the native streaming copier",
        env="PDXFER_COPY_STREAM",
    )
    nixl_threads: int = setting(
        0,
        "UCX threads a large NIXL write is split across (``1``: the posting thread alone)",
        env="PDXFER_NIXL_THREADS",
        shown="min(2, cores)",
    )
    nixl_tick_us: int = setting(
        100_000,
        "longest sleep of NIXL's UCX progress thread between events (NIXL's own: 0, it spins)",
        env="PDXFER_NIXL_TICK_US",
    )
    te_completion: str = setting(
        "paced",
        "how Mooncake writes are awaited: ``paced`` (a write of at most 64 entries "
        "and at least 1 MiB is polled without spinning; others sleep through most of the "
        "expected time, then spin) or ``sync`` (each batch one blocking call, which "
        "busy-waits)",
        env="PDXFER_TE_COMPLETION",
    )
    control_send: str = setting(
        "direct",
        "how control frames leave: ``direct`` (the sending thread writes ZMTP "
        "itself) or ``zmq`` (ZMQ PUSH sockets, one I/O-thread wake-up per message)",
        env="PDXFER_CONTROL_SEND",
    )
    log_level: str = setting(
        "WARNING", "log level of test and benchmark agent processes", env="PDXFER_LOG"
    )
    api_keys: str = setting(
        "",
        "router API keys, ``KEY`` or ``TENANT:KEY,TENANT:KEY``: clients must send "
        "``Authorization: Bearer KEY``; the key's tenant scopes prefix reuse",
        env="PDXFER_API_KEYS",
    )

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Knobs:
        """Each field from its variable: unset or empty keeps the default; a number must
        parse and be >= 0; a flag is off for ``0``."""
        vals: dict[str, Any] = {}
        for s in settings_of(Knobs).values():
            raw = env.get(s.env, "")
            if raw == "":
                continue
            if s.kind in ("int", "float"):
                kind = int if s.kind == "int" else float
                try:
                    vals[s.name] = kind(raw)
                except ValueError:
                    raise ConfigError(f"{s.env}={raw!r} is not a {s.kind}") from None
                if vals[s.name] < 0:
                    raise ConfigError(f"{s.env} must be >= 0, got {raw!r}")
            else:
                vals[s.name] = raw != "0" if s.kind == "bool" else raw
        return Knobs(**vals)

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


TRANSPORTS = ("auto", "tcp", "rdma", "nvlink", "nixl")
"""What a user may name (``memory``, the in-process transport, is for unit tests only)."""
IntegrityMode = Literal["sampled", "full", "off"]
"""How a decode checks received KV (``EndpointConfig.integrity``)."""
INTEGRITY_MODES: tuple[str, ...] = get_args(IntegrityMode)
PackMode = Literal["auto", "on", "off"]
"""Whether a decode has pages packed (``Limits.pack``)."""
PACK_MODES: tuple[str, ...] = get_args(PackMode)
Role = Literal["prefill", "decode"]
"""What an endpoint is (``EndpointConfig.role``)."""
ROLES: tuple[str, ...] = get_args(Role)


def one_of(name: str, value: object, allowed: tuple[str, ...], note: str = "") -> None:
    """``ConfigError`` naming ``name``, the value and what is allowed (and ``note``: what the
    values mean), unless it is allowed."""
    if value not in allowed:
        names = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"{name} must be one of {names}{note}; got {value!r}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Deadlines, table caps and the knobs a deployment rarely touches (defaults suit a
    cluster; tests shorten the deadlines)."""

    workers: int = setting(4, "threads that plan and await this rank's writes")
    bootstrap_timeout_s: float = setting(
        30.0,
        "seconds a prefill sender waits for the decode's request, and a decode "
        "receiver to find and handshake its prefill endpoints",
    )
    transfer_timeout_s: float = setting(
        60.0, "seconds from the decode's request to the last ``TransferDone``"
    )
    abort_timeout_s: float = setting(
        5.0,
        "seconds a failed request's pages wait for the prefill to confirm that no write "
        "is in flight before they are counted as quarantined",
    )
    room_grace_s: float = setting(
        5.0,
        "(prefill) seconds a decode's request for a room this prefill never saw is held "
        "for its engine to open it (early dispatch), at most ``bootstrap_timeout_s``; then "
        "it is refused as ``UnknownRoom``. A room the engine declared on arrival "
        "(``Endpoint.expect``) waits up to ``bootstrap_timeout_s``",
    )
    route_fresh_s: float = setting(
        10.0,
        "(decode) seconds a prefill instance's route (looked up at the bootstrap) is "
        "reused without a room through it succeeding; an older one is looked up again, so "
        "a restarted prefill is not dialled at its dead address",
    )
    heartbeat_s: float = setting(
        0.5,
        "seconds between liveness probes of the peers a request waits on; two failed "
        "probes in a row declare the peer lost",
    )
    register_interval_s: float = setting(
        10.0,
        "seconds between a prefill rank's registrations, so a route a bootstrap lost "
        "heals by itself",
    )
    start_in_send: bool = setting(
        True,
        "a chunk whose write is one small batch, with nothing else in flight to that "
        "decode, is submitted from ``send()`` itself and only awaited on a worker "
        "(docs/performance.md#what-pdxfer-does-to-be-fast-here); false leaves every write "
        "to the workers",
    )
    integrity_retry: bool = setting(
        False,
        "(decode) on a digest mismatch ask the prefill for the range once more "
        "before failing the request (the prefill then holds its pages until the decode's "
        "``Release``)",
    )
    pack: PackMode = setting(
        "auto",
        "whether a decode has a request's pages packed into one large write "
        "(``plan/pack.py``): ``auto``, device pools with small, many pages "
        "(``PDXFER_PACK_MAX_PAGE_KB``, ``PDXFER_PACK_MIN_PAGES``); ``on``, every pool of "
        "whole token rows; ``off``, never",
    )
    fan_out: bool = setting(
        False,
        "(prefill) a room may be served to several decode groups (a mirrored or "
        "standby decode); off, a room belongs to the decode named by ``sender(room, "
        "peer=...)``, else to the first decode group that asks",
    )
    max_pending: int = setting(
        4096,
        "(prefill) requests held for rooms whose sender does not exist yet; past it, "
        "a request is refused (``busy``)",
    )
    max_pending_bytes: int = setting(64 << 20, "(prefill) the bytes of those requests")
    max_peers: int = setting(
        4096,
        "(prefill) decode endpoints kept with a handshake (the least recently used "
        "idle one is dropped for a new one)",
    )
    max_tombstones: int = setting(
        65536,
        "rooms that ended remembered so that a late request for them is refused at "
        "once (oldest forgotten first)",
    )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError("workers must be >= 1")
        for name in ("max_pending", "max_pending_bytes", "max_peers", "max_tombstones"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in (
            "bootstrap_timeout_s",
            "transfer_timeout_s",
            "abort_timeout_s",
            "heartbeat_s",
            "register_interval_s",
            "room_grace_s",
            "route_fresh_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        one_of("pack", self.pack, PACK_MODES)


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One rank's settings: where it is, whom it trusts, how it moves KV; ``limits`` holds
    the deadlines and caps. Every field's help is in its metadata (``endpoint_settings``)."""

    role: Role = setting(help="``prefill`` (sends) or ``decode``")
    bootstrap: str | None = setting(
        None,
        "``host:port`` of the bootstrap server a prefill registers with and a decode "
        "looks its prefills up at",
    )
    instance: str = setting(
        "default",
        "instance name (a prefill's route on its bootstrap; a "
        "decode's name, which rooms are bound to)",
    )
    host: str = setting(
        "127.0.0.1",
        "the address the control socket binds (0.0.0.0: every interface, then "
        "``advertise`` is needed; Mooncake's listeners bind every interface whatever this "
        "says)",
    )
    advertise: str = setting(
        "",
        "the address peers reach this rank at (control socket, transport session); "
        "empty: ``host``. It must be an address of this host, and not a loopback one once "
        "a peer is on another host",
    )
    tp_rank: int = setting(0, "tensor-parallel rank")
    tp_size: int = setting(1, "tensor-parallel size")
    dp_rank: int = setting(0, "data-parallel rank")
    dp_size: int = setting(1, "data-parallel size")
    pp_rank: int = setting(0, "pipeline-parallel rank")
    pp_size: int = setting(1, "pipeline-parallel size")
    transport: str = setting(
        "auto",
        "how KV moves: ``auto`` (the fastest both sides run, picked at pairing: NIXL "
        "on one host, Mooncake TCP across hosts; for device pools NVLink on one node and "
        "RDMA across nodes), Mooncake ``tcp``, ``rdma`` or ``nvlink`` (its nvlink_intra: "
        "device pools on one node), or ``nixl`` (UCX); an explicit one must match on both "
        "sides",
        choices=TRANSPORTS,
    )
    device: str = setting("", "the RDMA device (NIC) for ``transport='rdma'``")
    integrity: IntegrityMode = setting(
        "sampled",
        "how a decode checks received KV before it reports Success (``sampled``: "
        "a fixed sample of every page; ``full``: every byte; ``off``)",
    )
    model_id: str = setting(
        "",
        "the engine's model fingerprint; a prefill refuses a decode whose fingerprint "
        "differs, naming the difference",
    )
    insecure: bool = setting(
        False,
        "without a shared secret, serve control peers on other hosts anyway "
        "(``PDXFER_INSECURE=1`` does the same); otherwise pdxfer serves loopback peers only",
    )
    secret: str | None = setting(
        None,
        "shared secret for HMAC on bootstrap requests and every control frame; None "
        "reads ``PDXFER_SECRET`` or ``PDXFER_SECRET_FILE``",
        repr=False,
    )
    trusted_bootstraps: tuple[str, ...] = setting(
        (),
        "a decode's trusted bootstrap servers (``host:port``): ``receiver()`` refuses any "
        "other address before connecting (``UntrustedBootstrap``); engines' decodes require "
        "it (SGLang's decodes read it from ``PDXFER_TRUSTED_BOOTSTRAPS``, ``host:port,...``)",
        env="PDXFER_TRUSTED_BOOTSTRAPS",
    )
    endpoint_id: str = setting(
        help="this endpoint's id (default: a fresh random one)",
        factory=lambda: uuid.uuid4().hex[:16],
    )
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def from_flat(cls, **settings: Any) -> EndpointConfig:
        """One flat set of names (as flags, connector keys and agents carry them), each
        routed to its group: ``from_flat(role="decode", heartbeat_s=0.2)``."""
        lim = {k: settings.pop(k) for k in list(settings) if k in _LIMITS}
        return cls(**settings, limits=Limits(**lim))

    @property
    def address(self) -> str:
        """The address this rank advertises (``advertise``, else ``host``)."""
        return advertised(self.host, self.advertise)

    def __post_init__(self) -> None:
        one_of("role", self.role, ROLES)
        for r, s, what in (
            (self.tp_rank, self.tp_size, "tp"),
            (self.dp_rank, self.dp_size, "dp"),
            (self.pp_rank, self.pp_size, "pp"),
        ):
            if s < 1 or not 0 <= r < s:
                raise ConfigError(f"{what}_rank {r} must be in [0, {what}_size={s})")
        one_of("integrity", self.integrity, INTEGRITY_MODES)
        advertised(self.host, self.advertise)  # a wildcard needs an address to advertise
        object.__setattr__(
            self,
            "trusted_bootstraps",
            parse_hostports(self.trusted_bootstraps, "trusted bootstrap"),
        )
        one_of(
            "transport",
            self.transport,
            (*TRANSPORTS, "memory"),
            " (tcp, rdma, nvlink: Mooncake, nvlink for device pools on one node; "
            "memory: in-process, for tests)",
        )


_LIMITS = frozenset(settings_of(Limits))


def endpoint_settings() -> dict[str, Setting]:
    """Every setting of an endpoint, flat by name (``EndpointConfig``'s, then ``Limits``'s):
    what CLI flags, connector keys and docs are generated from."""
    return {**settings_of(EndpointConfig), **settings_of(Limits)}


def _shown(s: Setting) -> str:
    if s.shown:
        return s.shown
    if s.default in (None, "", False):
        return "unset"
    if s.default is True:
        return "1"
    return f"{s.default:g}" if isinstance(s.default, float) else str(s.default)


TOOL_VARS = (
    EnvVar(
        "PDXFER_EXTRAS",
        "cpu,router,test,bench,nixl",
        "``scripts/setup.sh``: the extras of pdxfer to install (``scripts/test.sh`` adds ``vllm``)",
        "tools",
    ),
    EnvVar(
        "PDXFER_SOAK_FULL",
        "unset",
        "tests: ``1`` runs the full 20,000-request soak instead of the reduced one",
        "tools",
    ),
    EnvVar("PDXFER_FLOOD_S", "10", "tests: seconds of the control-socket flood test", "tools"),
    EnvVar(
        "PDXFER_VLLM_PRELOAD",
        "unset",
        "``1``: ``VllmServer`` forks each ``vllm serve`` from one process that imported vLLM "
        "once (``pdxfer.serving.vllm.forked``); the tests set it",
        "tools",
    ),
    EnvVar(
        "PDXFER_TRACE_VLLM",
        "unset",
        "``scripts/trace_vllm_prefill.py``/``bench_vllm.py``: a folder where a vLLM server "
        "started with ``scripts/trace_hooks`` on its PYTHONPATH writes its prefill-leg stamps",
        "tools",
    ),
    EnvVar(
        "PDXFER_TRACE_NO_PAUSE",
        "unset",
        "tracing only: ``1`` turns off the prefill's yield to vLLM's output thread in the step "
        "after a finish (to measure what it buys)",
        "tools",
    ),
    EnvVar(
        "PDXFER_SGLANG_SHOW_STDERR",
        "unset",
        "tests: ``1`` prints the SGLang test servers' stderr",
        "tools",
    ),
)
"""Variables only the set-up scripts, tests and benchmarks read (no field of the library)."""

ENV_VARS: tuple[EnvVar, ...] = (
    *(EnvVar(s.env, _shown(s), s.help) for s in settings_of(Knobs).values()),
    *(EnvVar(s.env, "unset", s.help, "engine") for s in endpoint_settings().values() if s.env),
    *TOOL_VARS,
)
"""Every ``PDXFER_*`` variable, in one place: the library's from ``Knobs``' fields, the
engines' from ``EndpointConfig``'s, the tools' from ``TOOL_VARS``."""
