"""``--disaggregation-transfer-backend pdxfer``: the entry point SGLang's plugin loader calls.

``pyproject.toml`` names ``register`` in the ``sglang.srt.plugins`` group; SGLang's
``load_plugins()`` (once per process, before the schedulers build their queues) calls it, then
applies the hooks it registered. Through SGLang's own interfaces it adds ``pdxfer`` to the
backend choices, replaces the ``TransferBackend`` Enum (which cannot grow in place) with one
that has ``PDXFER`` too (SGLang's hook registry rebinds every importer), and wraps
``get_kv_class`` so ``TransferBackend("pdxfer")`` resolves to pdxfer's classes. pdxfer's
classes load only when SGLang asks for one: a process using another backend pays nothing.
"""

from __future__ import annotations

import enum
from typing import Any

NAME = "pdxfer"


def transfer_backend_enum(base: type[enum.Enum]) -> type[enum.Enum]:
    """SGLang's ``TransferBackend`` members plus ``PDXFER`` (``base`` when it has it)."""
    members = {m.name: m.value for m in base}
    if NAME in members.values():
        return base
    members["PDXFER"] = NAME
    new = enum.Enum(base.__name__, members)  # type: ignore[misc]  # mypy wants a literal name
    new.__module__ = base.__module__
    new.__qualname__ = base.__qualname__
    return new


def kv_class(class_type: Any) -> Any:
    """pdxfer's class for one of SGLang's ``KVClassType``s."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from .conn import PdxferKVBootstrapServer, PdxferKVManager, PdxferKVReceiver, PdxferKVSender

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: PdxferKVManager,
        KVClassType.SENDER: PdxferKVSender,
        KVClassType.RECEIVER: PdxferKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: PdxferKVBootstrapServer,
    }[class_type]


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) == NAME:
        return kv_class(class_type)
    return original(transfer_backend, class_type)


def register() -> None:
    """Called by SGLang's ``load_plugins()``."""
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_disagg_transfer_backend_choices

    add_disagg_transfer_backend_choices([NAME])
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.TransferBackend",
        transfer_backend_enum(utils.TransferBackend),
        HookType.REPLACE,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND
    )
