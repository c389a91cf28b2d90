"""Command-line options of the serving subcommands (kept apart so ``--help`` stays cheap).

Every flag is generated from the dataclass field that consumes it (``add_field_args``):
default, type, choices, metavar and help are written once there (``pdxfer.setting``) --
``EndpointConfig``'s for the endpoint settings, ``WorkerConfig``'s for the toy workers',
``RouterSettings``' and ``MediaPolicy``'s for the router's.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdxfer import endpoint_settings
from pdxfer.setting import flag_of, settings_of

from .router.media import MediaPolicy
from .router.settings import RouterSettings
from .toy.config import WorkerConfig

_TYPES = {"int": int, "float": float, "int | None": int, "float | None": float}


def add_field_args(
    ap: argparse.ArgumentParser | Any, cls: type | None, *names: str, **over: Any
) -> None:
    """One flag per named field of ``cls`` (None: ``EndpointConfig`` and its ``Limits``),
    everything about it taken from the field; ``over`` replaces what differs by command
    (e.g. ``required``)."""
    known = endpoint_settings() if cls is None else settings_of(cls)
    for name in names:
        s = known[name]
        kw: dict[str, Any] = {"help": s.help.replace("``", "").replace("%", "%%")}
        if s.kind == "bool":
            kw["action"] = "store_false" if s.default else "store_true"
        elif s.kind.startswith("tuple["):
            kw["action"] = "append"
        else:
            kw["type"] = _TYPES.get(s.kind, str)
        if s.required:
            kw["required"] = True
        else:
            kw["default"] = list(s.default) if kw.get("action") == "append" else s.default
        if s.choices:
            kw["choices"] = list(s.choices)
        if s.metavar:
            kw["metavar"] = s.metavar
        ap.add_argument(*(s.flags or (flag_of(name),)), **(kw | over))


def add_setting_args(ap: argparse.ArgumentParser | Any, *names: str) -> None:
    """One flag per endpoint setting, everything about it taken from its field."""
    add_field_args(ap, None, *names)


def add_worker_args(ap: argparse.ArgumentParser, role: str) -> None:
    add_setting_args(
        ap.add_argument_group(
            "addresses",
            "the HTTP server binds --host too, and prints --advertise in its ready line",
        ),
        "host",
        "advertise",
    )
    add_field_args(ap, WorkerConfig, "port")
    add_field_args(ap, WorkerConfig, "bootstrap", required=role == "prefill")
    add_setting_args(ap, "insecure", "instance", "transport", "device")
    add_field_args(
        ap,
        WorkerConfig,
        "torch_device",
        "pages",
        "aux_slots",
        "seed",
        "page_size",
        "max_seq_len",
        "chunk_size",
        "l2_pages",
        "kv_events",
        "kv_events_mute",
    )
    if role == "decode":
        add_field_args(
            ap,
            WorkerConfig,
            "l3_dir",
            "l3_max_gb",
            "l3_mooncake",
            "l3_mooncake_metadata",
            "l3_mooncake_segment_mb",
            "no_l3",
            "kv_landing",
        )
        add_setting_args(ap, "integrity", "integrity_retry")
    add_field_args(ap, WorkerConfig, "kv_ballast_bytes_per_token", "tp")
    if role == "decode":
        add_field_args(ap, WorkerConfig, "dp", "min_step_s")
    add_field_args(ap, WorkerConfig, "threads")
    add_setting_args(ap, "bootstrap_timeout_s", "transfer_timeout_s", "heartbeat_s")
    add_field_args(ap, WorkerConfig, "max_waiting", "admission_timeout_s")


def add_insecure_arg(ap: argparse.ArgumentParser) -> None:
    add_setting_args(ap, "insecure")


def add_router_args(ap: argparse.ArgumentParser) -> None:
    add_field_args(ap, RouterSettings, "host", "advertise", "port")
    add_insecure_arg(ap)
    add_field_args(
        ap,
        RouterSettings,
        "prefill",
        "decode",
        "engine",
        "tokenizer",
        "page_size",
        "dispatch",
        "policy",
        "kv_events",
        "kv_load_weight",
        "kv_stale_misses",
        "kv_stale_window_s",
        "kv_stale_tolerance_blocks",
        "kv_stale_deadline_s",
        "kv_index_blocks",
        "prefill_queue_tokens",
        "max_held",
    )
    add_field_args(ap, MediaPolicy, "max_image_bytes", "max_image_pixels", "allow_remote")
    add_field_args(ap, RouterSettings, "expose_cache_stats", "timeout_s")
