"""pdxfer's KV connector for vLLM (``PdxferConnector``).

Reading order: ``params`` (the ``kv_transfer_params`` protocol) -> ``config`` (the extra
config) -> ``layout`` (vLLM's cache tensors as a pool) -> ``groups`` and ``state`` (a hybrid
model's KV cache groups; how a state splits over TP) -> ``metadata`` (scheduler -> worker
orders) -> ``scheduler`` -> ``rank`` (a worker rank's pools and endpoint) -> ``decode_tiers`` -> ``counters`` -> ``sender`` (the
prefill half) -> ``loader`` (the decode half) -> ``stats_file`` -> ``worker`` (the step over
both halves) -> ``stats`` (its figures in vLLM's log and ``/metrics``) -> ``connector`` (the
facade vLLM instantiates).

Importing this package is cheap: the connector (and vLLM) load when vLLM asks for
``PdxferConnector``. ``register`` is the ``vllm.general_plugins`` entry point: with pdxfer
installed, ``"kv_connector": "PdxferConnector"`` works without ``kv_connector_module_path``.
"""

from __future__ import annotations

from typing import Any

NAME = "PdxferConnector"


def register() -> None:
    """Register ``PdxferConnector`` with vLLM's connector factory by name (lazily: nothing
    is imported until a configuration names it). Safe to call more than once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, __name__, NAME)
    except ValueError:  # already registered (plugins load in several processes and paths)
        pass


def __getattr__(name: str) -> Any:
    if name == NAME:
        from .connector import PdxferConnector

        return PdxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NAME", "register"]
