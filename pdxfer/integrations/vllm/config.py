"""The connector's settings: ``kv_connector_extra_config`` parsed and validated in one place.

Every key is listed in ``FIELDS`` with its type; an unknown key, a wrong type or a value out of
range is a ``ConfigError`` that names the key, raised when vLLM builds the connector (at
start-up, not at the first request).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from pdxfer import ConfigError, EndpointConfig, parse_hostport, parse_hostports, require_trusted

ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
TRANSPORTS = ("auto", "tcp", "rdma", "nixl", "nvlink")
INTEGRITY = ("off", "sampled", "full")
L3_KINDS = ("off", "file", "mooncake")
SEND_BY = ("request", "step", "layer")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """One vLLM instance's pdxfer settings (``kv_connector_extra_config``).

    - ``bootstrap``: ``host:port`` of the pdxfer bootstrap server. A prefill registers there
      and names it in its responses. A decode (required) trusts these bootstrap servers
      only (one, or several separated by commas): a request whose ``pdxfer_bootstrap`` names
      any other is served as if it had no pdxfer params (logged, counted in
      ``vllm:pdxfer_untrusted_refused``), so a client never chooses where KV comes from.
    - ``instance``: this instance's name. A decode's name is what a router puts in
      ``pdxfer_decode`` so the prefill binds the room to it; a prefill's name is how its
      ranks register. Default ``vllm-prefill`` / ``vllm-decode`` (set it when several
      instances share a bootstrap server).
    - ``host``: the address peers reach this instance's ranks at (default 127.0.0.1).
    - ``transport`` (``auto``, ``tcp``, ``rdma``, ``nixl``) and ``device`` (the RDMA NIC):
      ``auto`` (default) picks at pairing the fastest transport both sides run (NIXL on one
      host, Mooncake TCP across hosts); an explicit one must be the same on both sides.
    - ``secret_file``: a file holding the shared secret (>= 16 bytes): every control frame
      and bootstrap request is authenticated (``PDXFER_SECRET``/``PDXFER_SECRET_FILE`` in
      the environment do the same). Without a secret, every pdxfer listener serves loopback
      peers only and a non-loopback ``host`` is refused at start, unless ``insecure`` (true;
      or ``PDXFER_INSECURE=1``) opts in to serving other hosts unauthenticated.
    - ``integrity``: how the decode checks what arrived (``sampled``, ``full``, ``off``);
      ``integrity_retry`` asks the prefill once more on a mismatch.
    - ``l2_pages`` (decode): host pages (vLLM blocks) of decode-side prefix cache; 0 is off.
      ``l3``: ``off``, ``file`` (``l3_dir``, ``l3_max_gb``) or ``mooncake``
      (``l3_mooncake`` master ``host:port``, ``l3_mooncake_metadata`` URL,
      ``l3_mooncake_segment_mb``).
    - ``model_id``: the served model's identity (name and revision). It salts every L2/L3
      key and is checked when a prefill and a decode pair, so two models never share KV.
      Default: the served model name and ``--revision``.
    - deadlines in seconds: ``bootstrap_timeout_s`` (a prefill waits this long for the
      decode's request after its prefill finished), ``transfer_timeout_s``,
      ``abort_timeout_s``, ``heartbeat_s``; ``room_grace_s`` (prefill): how long a decode's
      request for a room this prefill has not received is held (a request vLLM has queued
      is expected: its decode waits up to ``bootstrap_timeout_s``).
    - ``send_by`` (prefill): when computed KV goes to the sender. ``layer`` (default): as
      each attention layer of a step finishes (``save_kv_layer``), that layer's blocks for
      the tokens the step computed (a block the step fills in part is written for those
      tokens and completed by the next step where the cache's blocks are addressable by
      token, as on a GPU; vLLM's CPU backend packs each block per ISA, so there a block goes
      once it is complete); a hand-off, the forward never waits on the
      network, and a decode that already asked receives layer 0 while the step computes the
      later layers. ``step``: after each step, the full blocks it computed. ``request``: all
      of a request's KV once its prompt is computed. A decode that asks late gets what was
      handed over at once, the rest as it comes. Layer by layer is the default because it
      starts each byte's transfer earliest at the same bytes moved (the ideal time to first
      token is the prefill plus one layer's transfer) and costs the forward only the hand-off;
      ``step`` is the fallback where ``save_kv_layer`` is not called (a layer it misses is
      handed over after the step all the same).
    - ``send_per_step`` (prefill, the older form of ``send_by``): true is ``step``, false is
      ``request``; refused together with ``send_by``.
    - ``stats_file``: a JSON file each worker rewrites with its counters (bytes sent and
      received, restored pages, failures) whenever a request's KV moved (``.tpN`` is
      appended per rank when TP > 1).
    """

    role: str
    bootstrap: str | None = None
    instance: str = ""
    host: str = "127.0.0.1"
    transport: str = "auto"
    device: str = ""
    secret_file: str | None = None
    insecure: bool = False
    integrity: str = "sampled"
    integrity_retry: bool = False
    l2_pages: int = 0
    l3: str = "off"
    l3_dir: str = ""
    l3_max_gb: float = 0.0
    l3_mooncake: str = ""
    l3_mooncake_metadata: str = ""
    l3_mooncake_segment_mb: int = 64
    model_id: str = ""
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 60.0
    abort_timeout_s: float = 5.0
    heartbeat_s: float = 0.5
    room_grace_s: float = 5.0
    stats_file: str = ""
    send_by: str = "layer"
    send_per_step: bool | None = None

    @property
    def trusted(self) -> tuple[str, ...]:
        """A decode's trusted bootstrap servers (``bootstrap``, comma-separated)."""
        return parse_hostports(self.bootstrap) if self.side == "decode" else ()

    @property
    def side(self) -> str:
        """pdxfer's word for the role: ``prefill`` or ``decode``."""
        return ROLES[self.role]

    def endpoint_config(self, tp_rank: int, tp_size: int, fingerprint: str) -> EndpointConfig:
        secret = None
        if self.secret_file:
            try:
                with open(self.secret_file, "rb") as f:
                    secret = f.read().strip().decode()
            except OSError as e:
                raise ConfigError(f"kv_connector_extra_config.secret_file: {e}") from None
        return EndpointConfig(
            role=self.side,  # type: ignore[arg-type]
            bootstrap=self.bootstrap if self.side == "prefill" else None,
            trusted_bootstraps=self.trusted, insecure=self.insecure,
            instance=self.instance, host=self.host, tp_rank=tp_rank, tp_size=tp_size,
            transport=self.transport, device=self.device,
            bootstrap_timeout_s=self.bootstrap_timeout_s,
            transfer_timeout_s=self.transfer_timeout_s, abort_timeout_s=self.abort_timeout_s,
            heartbeat_s=self.heartbeat_s, room_grace_s=self.room_grace_s, integrity=self.integrity,  # type: ignore[arg-type]
            integrity_retry=self.integrity_retry, model_id=fingerprint, secret=secret)


KEYS = {f.name: f.type for f in fields(ConnectorConfig) if f.name != "role"}


def _typed(key: str, value: Any, kind: str) -> Any:
    ok = {"str": isinstance(value, str), "str | None": value is None or isinstance(value, str),
          "bool": isinstance(value, bool),
          "bool | None": value is None or isinstance(value, bool),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]
    if not ok:
        raise ConfigError(f"kv_connector_extra_config.{key} must be {kind}, got "
                          f"{type(value).__name__} {value!r}")
    return float(value) if kind == "float" else value


def parse(kv_role: str | None, extra: dict[str, Any] | None, model_name: str = "",
          revision: str | None = None) -> ConnectorConfig:
    """``kv_transfer_config`` -> ``ConnectorConfig``, or a ``ConfigError`` naming the key."""
    if kv_role not in ROLES:
        raise ConfigError(f"PdxferConnector needs kv_role 'kv_producer' (prefill) or "
                          f"'kv_consumer' (decode), got {kv_role!r}")
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: "
                          f"{sorted(KEYS)}")
    vals = {k: _typed(k, v, str(KEYS[k])) for k, v in extra.items()}
    if vals.get("send_per_step") is not None:
        if "send_by" in vals:
            raise ConfigError("kv_connector_extra_config: send_per_step is the older form of "
                              "send_by; set send_by only")
        vals["send_by"] = "step" if vals["send_per_step"] else "request"
    side = ROLES[kv_role]
    vals.setdefault("instance", f"vllm-{side}")
    if not vals.get("model_id"):
        vals["model_id"] = f"{model_name}@{revision or 'local'}"
    cfg = ConnectorConfig(role=kv_role, **vals)
    _check(cfg)
    return cfg


def _check(c: ConnectorConfig) -> None:
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"kv_connector_extra_config.{key}: {why}")

    if c.side == "prefill" and not c.bootstrap:
        raise bad("bootstrap", "a prefill (kv_producer) needs the pdxfer bootstrap server's "
                  "host:port")
    if not c.instance or len(c.instance) > 128:
        raise bad("instance", "must be 1-128 characters")
    if c.transport not in TRANSPORTS:
        raise bad("transport", f"one of {TRANSPORTS}, got {c.transport!r}")
    if c.integrity not in INTEGRITY:
        raise bad("integrity", f"one of {INTEGRITY}, got {c.integrity!r}")
    if c.send_by not in SEND_BY:
        raise bad("send_by", f"one of {SEND_BY}, got {c.send_by!r}")
    if c.l3 not in L3_KINDS:
        raise bad("l3", f"one of {L3_KINDS}, got {c.l3!r}")
    if c.l2_pages < 0:
        raise bad("l2_pages", "must be >= 0")
    if c.side == "prefill" and (c.l2_pages or c.l3 != "off"):
        raise bad("l2_pages", "decode-side prefix reuse is for kv_consumer instances (a "
                  "prefill reuses prefixes through vLLM's own prefix cache)")
    if c.l3 != "off" and not c.l2_pages:
        raise bad("l3", "L3 stages through L2: set l2_pages > 0")
    if c.l3 == "file" and not c.l3_dir:
        raise bad("l3_dir", "l3 'file' needs a folder")
    if c.l3 == "mooncake" and not (c.l3_mooncake and c.l3_mooncake_metadata):
        raise bad("l3_mooncake", "l3 'mooncake' needs l3_mooncake (master host:port) and "
                  "l3_mooncake_metadata (URL)")
    if c.l3_max_gb < 0 or c.l3_mooncake_segment_mb < 0:
        raise bad("l3_max_gb", "sizes must be >= 0")
    for key in ("bootstrap_timeout_s", "transfer_timeout_s", "abort_timeout_s", "heartbeat_s",
                "room_grace_s"):
        if getattr(c, key) <= 0:
            raise bad(key, "must be > 0")
    if c.secret_file and not os.path.isfile(c.secret_file):
        raise bad("secret_file", f"no such file: {c.secret_file!r}")
    if c.side == "prefill":
        parse_hostport(c.bootstrap, "kv_connector_extra_config.bootstrap")
    else:
        require_trusted(c.bootstrap, "kv_connector_extra_config.bootstrap on the decode (the "
                        "bootstrap servers of the prefills it may load from)")

