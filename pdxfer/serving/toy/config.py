"""``WorkerConfig``: a toy worker's settings, each field carrying its flag's default and help.

``pdxfer prefill`` and ``pdxfer decode`` generate their flags from these fields
(``serving/cli_args.py``); the endpoint settings a worker passes on keep theirs in ``pdxfer``.
Torch is imported only when a config is validated, so ``pdxfer --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from pdxfer import (
    ConfigError,
    endpoint_settings,
    parse_hostport,
    parse_hostports,
    require_trusted,
)
from pdxfer.config import INTEGRITY_MODES, ROLES, TRANSPORTS, one_of
from pdxfer.setting import setting as setting_field

from .shape import MAX_SEQ_LEN, PAGE_SIZE

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .model import ToyConfig

Landing = Literal["device", "host"]
"""Where a decode receives KV (``WorkerConfig.kv_landing``)."""
LANDINGS: tuple[str, ...] = get_args(Landing)
WHY_DEFAULTS_DIFFER = {
    "l2_pages": "the toy workers exist to show and test the tiers, so their decode keeps a "
    "small L2 (512 toy pages are a few MiB); a vLLM decode's L2 page is a vLLM block of every "
    "layer (MiBs on a real model), host memory the operator sizes, so it is off until set",
    "l3_max_gb": "a toy decode writes L3 files by default (under ``$XDG_CACHE_HOME``), so an "
    "unattended demo is bounded; a vLLM decode has no L3 until the operator names "
    "``l3='file'`` and its folder, and the bound is theirs to choose (0: none)",
}
"""Why a ``WorkerConfig`` default differs from the vLLM connector's key of the same name
(printed in docs/configuration.md; the generator refuses a difference without a line here)."""
_DEFAULT = {k: s.default for k, s in endpoint_settings().items()}
"""The endpoint settings a worker passes on keep their defaults (and help) in ``pdxfer``."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker's settings, validated at construction (``ConfigError``, as every config)."""

    role: str
    host: str = _DEFAULT["host"]
    advertise: str = _DEFAULT["advertise"]
    """The address other hosts reach this worker at (default ``host``; see ``pdxfer``'s
    ``EndpointConfig.advertise``)."""
    port: int = setting_field(0, "HTTP port (0: pick a free one)")
    bootstrap: str | None = setting_field(
        None,
        "prefill: the bootstrap server host:port to register with; decode: the bootstrap "
        "servers it trusts (host:port, several separated by commas; required): it loads KV "
        "only from prefills found through them, and refuses a request naming any other",
    )
    instance: str = _DEFAULT["instance"]
    torch_device: str = setting_field(
        "cpu",
        "where the toy model computes and its KV pools live: cpu (default) or cuda[:N] "
        "(the forward on that GPU, the pools registered with the transport as device memory; "
        "needs --tp 1)",
        metavar="DEVICE",
    )
    pages: int = setting_field(1024, "KV pages in the pool")
    aux_slots: int = setting_field(64, "aux rows (concurrent requests)")
    seed: int = setting_field(0, "toy model seed (same on both sides)")
    page_size: int = setting_field(PAGE_SIZE, "tokens per KV page")
    max_seq_len: int = setting_field(MAX_SEQ_LEN, "longest prompt plus output, in tokens")
    chunk_size: int = setting_field(64, "prefill chunk (tokens)")
    l2_pages: int = setting_field(
        512,
        "host-DRAM prefix cache (L2, pdxfer.tiers) in pages (0: off): the decode restores "
        "a cached prefix instead of receiving it, the prefill instead of recomputing it",
        flags=("--l2-pages", "--prefix-cache-pages"),
    )
    kv_events: str = setting_field(
        "",
        "publish the L2 prefix cache's KV events (vLLM's schema, ZMQ PUB) here, e.g. "
        "tcp://127.0.0.1:5557; a second endpoint serves replays",
        metavar="ENDPOINT[,REPLAY]",
    )
    kv_events_mute: str = setting_field(
        "",
        "fault injection (tests): after AFTER batches the KV event publisher drops the "
        "next COUNT, sending and numbering none, as a hung publisher would",
        metavar="AFTER:COUNT",
    )
    l3_dir: str = setting_field(
        "",
        "L3 (storage) folder: prefixes survive a decode restart (default: "
        "$XDG_CACHE_HOME/pdxfer/l3)",
    )
    l3_max_gb: float = setting_field(4.0, "size bound of the L3 folder; a full L3 is a logged miss")
    l3_mooncake: str = setting_field(
        "", "use Mooncake Store as L3: its master's host:port", metavar="MASTER"
    )
    l3_mooncake_metadata: str = setting_field(
        "", "the Mooncake Store metadata URL (http://host:port/metadata)", metavar="URL"
    )
    l3_mooncake_segment_mb: int = setting_field(
        256,
        "store memory this decode contributes to Mooncake Store (0: none; objects then "
        "live in other clients' segments and survive this decode's restart)",
    )
    no_l3: bool = setting_field(False, "no L3: host DRAM only")
    kv_landing: Landing = setting_field(
        "device",
        "host: receive into a token-granular host pool (page size 1, HiSparse-style) "
        "and decode from it; pairs with a prefill of any page size",
    )
    integrity: str = _DEFAULT["integrity"]
    integrity_retry: bool = _DEFAULT["integrity_retry"]
    transport: str = _DEFAULT["transport"]
    device: str = _DEFAULT["device"]
    kv_ballast_bytes_per_token: int = setting_field(
        0,
        "benchmark device: a sidecar pool of N bytes per token (a multiple of 8) that is "
        "transferred, tiered and checked with the KV, so the toy model moves as many bytes as "
        "a real one (131072: an 8B model with GQA); prefill and decode must agree (0: off)",
        metavar="N",
    )
    tp: int = setting_field(
        1,
        "tensor-parallel ranks: one process each (this one is rank 0), each holding and "
        "transferring its share of the KV heads; any TP size pairs with any other that "
        "divides it or that it divides",
    )
    dp: int = setting_field(
        1,
        "independent decode groups (each of --tp ranks) behind this one address; the "
        "router routes to each group as to a decode of its own",
    )
    dp_rank: int = 0
    """Which of those groups this worker is."""
    min_step_s: float = setting_field(
        0.0,
        "a floor on each decode step's duration (an emulated slower model: a generation "
        "of N tokens then lasts at least N times this on any machine; tests that must outlast "
        "a client use it)",
        flags=("--min-step-s",),
        metavar="SECONDS",
    )
    threads: int = setting_field(
        1, "torch threads (the toy model's ops are tiny: more threads only spin)"
    )
    bootstrap_timeout_s: float = _DEFAULT["bootstrap_timeout_s"]
    transfer_timeout_s: float = _DEFAULT["transfer_timeout_s"]
    heartbeat_s: float = _DEFAULT["heartbeat_s"]
    max_waiting: int = setting_field(
        256, "requests that may wait for pages; more get 503 with Retry-After"
    )
    admission_timeout_s: float = setting_field(
        20.0,
        "seconds a request waits for pages before a 503 (keep it under the prefill's "
        "--bootstrap-timeout: the prefill waits that long for the decode to admit a request)",
    )

    def __post_init__(self) -> None:
        one_of("role", self.role, ROLES)
        if self.role == "prefill" and not self.bootstrap:
            raise ConfigError("a prefill worker needs --bootstrap (host:port of the bootstrap)")
        if self.role == "prefill":
            parse_hostport(self.bootstrap, "--bootstrap")
        else:
            require_trusted(self.bootstrap, "--bootstrap")
        for name in ("pages", "aux_slots", "page_size", "max_seq_len", "chunk_size", "threads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port out of range: {self.port}")
        if self.l2_pages < 0:
            raise ConfigError(f"l2_pages must be >= 0, got {self.l2_pages}")
        if self.l3 == "mooncake" and not self.l3_mooncake_metadata:
            raise ConfigError(
                "Mooncake Store as L3 needs the master (--l3-mooncake HOST:PORT) "
                "and its metadata URL (--l3-mooncake-metadata)"
            )
        one_of("integrity", self.integrity, INTEGRITY_MODES)
        one_of("transport", self.transport, TRANSPORTS)
        one_of("kv_landing", self.kv_landing, LANDINGS)
        if self.kv_landing == "host" and self.role != "decode":
            raise ConfigError("--kv-landing host is a decode option")
        if not 1 <= self.tp <= 64:
            raise ConfigError(f"tp must be in [1, 64], got {self.tp}")
        if not 1 <= self.dp <= 64 or not 0 <= self.dp_rank < self.dp:
            raise ConfigError(
                f"dp must be in [1, 64] and dp_rank in [0, dp), got {self.dp_rank} of {self.dp}"
            )
        if self.dp > 1 and self.role != "decode":
            raise ConfigError("--dp is a decode option (a prefill scales as more instances)")
        if self.role == "decode" and self.admission_timeout_s >= self.bootstrap_timeout_s:
            log.warning(
                "--admission-timeout %s s is not under --bootstrap-timeout %s s: a request "
                "that waits that long for this decode's pages is failed by its prefill first "
                "(which waits --bootstrap-timeout for the decode's ask), a 502 instead of "
                "this decode's 503",
                self.admission_timeout_s,
                self.bootstrap_timeout_s,
            )
        self._check_device()

    def _check_device(self) -> None:
        import torch

        from . import ballast
        from .model import head_shard

        try:
            ballast.validate(self.kv_ballast_bytes_per_token)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            dev = torch.device(self.torch_device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"torch_device {self.torch_device!r}: {e}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"torch_device must be cpu or cuda[:N], got {self.torch_device!r}")
        if dev.type == "cuda" and self.tp > 1:
            raise ConfigError(
                "--torch-device cuda needs --tp 1 (the toy's TP ranks gather over gloo on the host)"
            )
        if self.kv_ballast_bytes_per_token and self.tp > 1:
            raise ConfigError(
                "--kv-ballast-bytes-per-token needs --tp 1 (the ballast is not sharded by heads)"
            )
        try:  # a TP size that does not split the heads fails here
            head_shard(self.toy(), 0, self.tp)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def l3(self) -> str:
        """The decode's L3: ``file`` (``l3_dir``), ``mooncake`` or ``off`` (a prefill's)."""
        if self.role != "decode" or self.no_l3:
            return "off"
        return "mooncake" if self.l3_mooncake else "file"

    @property
    def l3_max_bytes(self) -> int:
        return int(self.l3_max_gb * (1 << 30))

    @property
    def l3_mooncake_segment_bytes(self) -> int:
        return int(self.l3_mooncake_segment_mb) << 20

    @property
    def trusted(self) -> tuple[str, ...]:
        """A decode's trusted bootstrap servers (``--bootstrap``, comma-separated): the only
        ones a request may name (``pdxfer.trusted_bootstrap``)."""
        return parse_hostports(self.bootstrap) if self.role == "decode" else ()

    @property
    def peer_by_instance(self) -> bool:
        """Whether rooms are bound to this decode by its instance name (which all its TP ranks
        share) rather than by its one endpoint id."""
        return self.tp > 1

    @property
    def token_granular(self) -> bool:
        """Host landing: the pool is token-granular (page size 1) with the same capacity,
        and accepts a prefill of any page size (``page_remap``)."""
        return self.kv_landing == "host"

    @property
    def pool_page_size(self) -> int:
        return 1 if self.token_granular else self.page_size

    @property
    def pool_pages(self) -> int:
        return self.pages * self.page_size if self.token_granular else self.pages

    def toy(self) -> ToyConfig:
        from .model import ToyConfig

        return ToyConfig(
            seed=self.seed, page_size=self.pool_page_size, max_seq_len=self.max_seq_len
        )


def default_l3_dir() -> str:
    """Where a decode keeps L3 files unless told (``$XDG_CACHE_HOME/pdxfer/l3``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdxfer", "l3")


def config_from_args(a: argparse.Namespace, role: str) -> WorkerConfig:
    dec = role == "decode"
    instance = a.instance
    if dec and instance == "default" and (a.tp > 1 or a.dp > 1):
        # rooms bind to a TP decode by its instance name: make it this decode's own
        instance = f"decode-{secrets.token_hex(4)}"
    return WorkerConfig(
        role=role,
        host=a.host,
        advertise=a.advertise,
        port=a.port,
        bootstrap=a.bootstrap,
        instance=instance,
        tp=a.tp,
        dp=a.dp if dec else 1,
        pages=a.pages,
        aux_slots=a.aux_slots,
        seed=a.seed,
        page_size=a.page_size,
        max_seq_len=a.max_seq_len,
        chunk_size=a.chunk_size,
        l2_pages=a.l2_pages,
        no_l3=a.no_l3 if dec else True,
        l3_dir=(a.l3_dir or default_l3_dir()) if dec else "",
        l3_max_gb=a.l3_max_gb if dec else 0.0,
        l3_mooncake=a.l3_mooncake if dec else "",
        l3_mooncake_metadata=a.l3_mooncake_metadata if dec else "",
        l3_mooncake_segment_mb=a.l3_mooncake_segment_mb if dec else 0,
        kv_landing=a.kv_landing if dec else "device",
        transport=a.transport,
        device=a.device,
        torch_device=a.torch_device,
        integrity=a.integrity if dec else _DEFAULT["integrity"],
        integrity_retry=a.integrity_retry if dec else _DEFAULT["integrity_retry"],
        bootstrap_timeout_s=a.bootstrap_timeout,
        transfer_timeout_s=a.transfer_timeout,
        heartbeat_s=a.heartbeat,
        threads=a.threads,
        max_waiting=a.max_waiting,
        admission_timeout_s=a.admission_timeout,
        min_step_s=a.min_step_s if dec else 0.0,
        kv_ballast_bytes_per_token=a.kv_ballast_bytes_per_token,
        kv_events=a.kv_events,
        kv_events_mute=a.kv_events_mute,
    )
