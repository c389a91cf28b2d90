"""The connector's settings: ``kv_connector_extra_config`` parsed and validated in one place.

The keys are ``ConnectorConfig``'s own fields and ``ENDPOINT_KEYS``, endpoint settings whose
default and help live on pdxfer's ``EndpointConfig`` (``pdxfer.endpoint_settings``): each is
written once. An unknown key, a wrong type or a value out of range is a ``ConfigError`` that
names the key, raised when vLLM builds the connector (at start-up, not at the first request).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pdxfer import (
    ConfigError,
    EndpointConfig,
    endpoint_settings,
    parse_hostport,
    parse_hostports,
    require_trusted,
)

ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
L3_KINDS = ("off", "file", "mooncake")
SEND_BY = ("request", "step", "layer")
ENDPOINT_KEYS = (
    "host",
    "transport",
    "device",
    "insecure",
    "integrity",
    "integrity_retry",
    "bootstrap_timeout_s",
    "transfer_timeout_s",
    "abort_timeout_s",
    "heartbeat_s",
    "room_grace_s",
)
"""Keys that set the endpoint's field of the same name (its default and help)."""
ENDPOINT = {k: endpoint_settings()[k] for k in ENDPOINT_KEYS}


def _key(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """One vLLM instance's pdxfer settings: the connector's own keys (each field's help), and
    the endpoint keys the user set (``endpoint``; ``get`` falls back to their defaults)."""

    role: str
    """vLLM's ``kv_role``: ``kv_producer`` (prefill) or ``kv_consumer`` (decode)."""
    bootstrap: str | None = _key(
        None,
        "``host:port`` of the pdxfer bootstrap server: a prefill registers there and "
        "names it in its responses. A decode (required) trusts these bootstrap servers only "
        "(one, or several separated by commas): a request whose ``pdxfer_bootstrap`` names "
        "any other is served as if it had no pdxfer params (logged, counted in "
        "``vllm:pdxfer_untrusted_refused``), so a client never chooses where KV comes from",
    )
    instance: str = _key(
        "",
        "this instance's name: a decode's is what a router puts in ``pdxfer_decode`` so "
        "the prefill binds the room to it; a prefill's is how its ranks register. Default "
        "``vllm-prefill`` / ``vllm-decode`` (set it when several instances share a bootstrap "
        "server)",
    )
    secret_file: str | None = _key(
        None,
        "a file holding the shared secret (>= 16 bytes): every control frame and "
        "bootstrap request is authenticated (``PDXFER_SECRET``/``PDXFER_SECRET_FILE`` do the "
        "same). Without a secret every pdxfer listener serves loopback peers only, unless "
        "``insecure``",
    )
    l2_pages: int = _key(
        0, "(decode) host pages (vLLM blocks) of decode-side prefix cache (0: off)"
    )
    l3: str = _key(
        "off",
        "(decode) storage tier under L2: ``off``, ``file`` (``l3_dir``, "
        "``l3_max_gb``) or ``mooncake`` (``l3_mooncake``...)",
    )
    l3_dir: str = _key("", "``l3='file'``: the folder (one subfolder per TP rank)")
    l3_max_gb: float = _key(0.0, "``l3='file'``: size bound of the folder (0: none)")
    l3_mooncake: str = _key("", "``l3='mooncake'``: the Mooncake Store master's ``host:port``")
    l3_mooncake_metadata: str = _key("", "``l3='mooncake'``: the store's metadata URL")
    l3_mooncake_segment_mb: int = _key(
        256, "``l3='mooncake'``: store memory this decode contributes (0: none)"
    )
    model_id: str = _key(
        "",
        "the served model's identity (name and revision): it salts every L2/L3 key and is "
        "checked when a prefill and a decode pair, so two models never share KV. Default: "
        "the served model name and ``--revision``",
    )
    stats_file: str = _key(
        "",
        "a JSON file each worker rewrites with its counters (bytes sent and received, "
        "restored pages, failures) whenever a request's KV moved (``.dpN`` appended per "
        "data-parallel rank when DP > 1, then ``.tpN`` per TP rank when TP > 1)",
    )
    send_by: str = _key(
        "layer",
        "(prefill) when computed KV goes to the sender: ``layer``, as each attention "
        "layer of a step finishes (``save_kv_layer``; the forward only hands over, and a "
        "decode that already asked receives layer 0 while later layers compute); ``step``, "
        "after each step, the full blocks it computed (the fallback where ``save_kv_layer`` "
        "is not called); ``request``, all of a request's KV once its prompt is computed "
        "(docs/vllm.md)",
    )
    step_pace_s: float = _key(
        0.0,
        "seconds each engine step that schedules work is held (an emulated slower "
        "model: a request of N tokens then takes at least N times this; tests that must "
        "outlast a client use it); 0: off",
    )
    endpoint: Mapping[str, Any] = field(default_factory=dict)
    """The ``ENDPOINT_KEYS`` the user set (the rest keep ``EndpointConfig``'s defaults)."""
    dp_rank: int = 0
    """This engine core's data-parallel rank (not a key: the connector reads it from vLLM,
    ``connector.data_parallel``); each rank is an endpoint of its own at the bootstrap."""
    dp_size: int = 1
    """The instance's data-parallel size (not a key, as ``dp_rank``)."""

    @property
    def trusted(self) -> tuple[str, ...]:
        """A decode's trusted bootstrap servers (``bootstrap``, comma-separated)."""
        return parse_hostports(self.bootstrap) if self.side == "decode" else ()

    @property
    def side(self) -> str:
        """pdxfer's word for the role: ``prefill`` or ``decode``."""
        return ROLES[self.role]

    def get(self, key: str) -> Any:
        """An endpoint key's value: the user's, else the endpoint's default."""
        return self.endpoint.get(key, ENDPOINT[key].default)

    def endpoint_config(self, tp_rank: int, tp_size: int, fingerprint: str) -> EndpointConfig:
        secret = None
        if self.secret_file:
            try:
                with open(self.secret_file, "rb") as f:
                    secret = f.read().strip().decode()
            except OSError as e:
                raise ConfigError(f"kv_connector_extra_config.secret_file: {e}") from None
        return EndpointConfig.from_flat(
            role=self.side,
            bootstrap=self.bootstrap if self.side == "prefill" else None,
            trusted_bootstraps=self.trusted,
            instance=self.instance,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            model_id=fingerprint,
            secret=secret,
            **self.endpoint,
        )


OWN = {f.name: f for f in fields(ConnectorConfig) if "help" in f.metadata}
KEYS = {**{k: str(f.type) for k, f in OWN.items()}, **{k: s.kind for k, s in ENDPOINT.items()}}
"""Every key, with its type."""


def default(key: str) -> Any:
    """What a key is when the user does not set it."""
    return OWN[key].default if key in OWN else ENDPOINT[key].default


def help_of(key: str) -> str:
    return OWN[key].metadata["help"] if key in OWN else ENDPOINT[key].help


def _typed(key: str, value: Any, kind: str) -> Any:
    ok = {
        "str": isinstance(value, str),
        "str | None": value is None or isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
    }[kind]
    if not ok:
        raise ConfigError(
            f"kv_connector_extra_config.{key} must be {kind}, got {type(value).__name__} {value!r}"
        )
    return float(value) if kind == "float" else value


def parse(
    kv_role: str | None,
    extra: dict[str, Any] | None,
    model_name: str = "",
    revision: str | None = None,
) -> ConnectorConfig:
    """``kv_transfer_config`` -> ``ConnectorConfig``, or a ``ConfigError`` naming the key."""
    if kv_role not in ROLES:
        raise ConfigError(
            f"PdxferConnector needs kv_role 'kv_producer' (prefill) or "
            f"'kv_consumer' (decode), got {kv_role!r}"
        )
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(KEYS)}"
        )
    vals = {k: _typed(k, v, KEYS[k]) for k, v in extra.items()}
    endpoint = {k: vals.pop(k) for k in ENDPOINT_KEYS if k in vals}
    side = ROLES[kv_role]
    vals.setdefault("instance", f"vllm-{side}")
    if not vals.get("model_id"):
        vals["model_id"] = f"{model_name}@{revision or 'local'}"
    cfg = ConnectorConfig(role=kv_role, endpoint=endpoint, **vals)
    _check(cfg)
    return cfg


def _check(c: ConnectorConfig) -> None:
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"kv_connector_extra_config.{key}: {why}")

    if c.side == "prefill" and not c.bootstrap:
        raise bad(
            "bootstrap", "a prefill (kv_producer) needs the pdxfer bootstrap server's host:port"
        )
    if not c.instance or len(c.instance) > 128:
        raise bad("instance", "must be 1-128 characters")
    for key, s in ENDPOINT.items():
        if s.choices and c.get(key) not in s.choices:
            raise bad(key, f"one of {s.choices}, got {c.get(key)!r}")
        if s.kind == "float" and c.get(key) <= 0:
            raise bad(key, "must be > 0")
    if c.send_by not in SEND_BY:
        raise bad("send_by", f"one of {SEND_BY}, got {c.send_by!r}")
    if c.l3 not in L3_KINDS:
        raise bad("l3", f"one of {L3_KINDS}, got {c.l3!r}")
    if c.l2_pages < 0:
        raise bad("l2_pages", "must be >= 0")
    if c.side == "prefill" and (c.l2_pages or c.l3 != "off"):
        raise bad(
            "l2_pages",
            "decode-side prefix reuse is for kv_consumer instances (a "
            "prefill reuses prefixes through vLLM's own prefix cache)",
        )
    if c.l3 != "off" and not c.l2_pages:
        raise bad("l3", "L3 stages through L2: set l2_pages > 0")
    if c.l3 == "file" and not c.l3_dir:
        raise bad("l3_dir", "l3 'file' needs a folder")
    if c.l3 == "mooncake" and not (c.l3_mooncake and c.l3_mooncake_metadata):
        raise bad(
            "l3_mooncake",
            "l3 'mooncake' needs l3_mooncake (master host:port) and l3_mooncake_metadata (URL)",
        )
    if c.l3_max_gb < 0 or c.l3_mooncake_segment_mb < 0:
        raise bad("l3_max_gb", "sizes must be >= 0")
    if c.step_pace_s < 0:
        raise bad("step_pace_s", "must be >= 0")
    if c.secret_file and not os.path.isfile(c.secret_file):
        raise bad("secret_file", f"no such file: {c.secret_file!r}")
    if c.side == "prefill":
        parse_hostport(c.bootstrap, "kv_connector_extra_config.bootstrap")
    else:
        require_trusted(
            c.bootstrap,
            "kv_connector_extra_config.bootstrap on the decode (the "
            "bootstrap servers of the prefills it may load from)",
        )
