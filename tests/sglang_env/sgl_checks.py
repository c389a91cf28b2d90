"""Commands for sgl_server.py that set a process up.

``registration`` (send it first to a fresh process): load SGLang's plugins the way a server
does, then ask SGLang's own ``get_kv_class`` and argument parser about ``pdxfer``.
``warm``: import what the scenarios use, so processes pay SGLang's import side by side at
start instead of one after another inside the first tests."""

from __future__ import annotations

import argparse
import sys


def registration(state: dict) -> dict:
    fresh = "sglang.srt.plugins" not in sys.modules
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation import decode, prefill, utils
    from sglang.srt.disaggregation.common.conn import (
        CommonKVBootstrapServer,
        CommonKVManager,
        CommonKVReceiver,
        CommonKVSender,
    )
    from sglang.srt.server_args import ServerArgs

    tb = utils.TransferBackend("pdxfer")
    classes = {ct.value: utils.get_kv_class(tb, ct) for ct in utils.KVClassType}
    bases = {
        "manager": CommonKVManager,
        "sender": CommonKVSender,
        "receiver": CommonKVReceiver,
        "bootstrap_server": CommonKVBootstrapServer,
    }
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--model-path",
            "dummy",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-transfer-backend",
            "pdxfer",
        ]
    )
    return {
        "fresh_process": fresh,
        "classes": {k: f"{c.__module__}.{c.__qualname__}" for k, c in classes.items()},
        "subclass": {k: issubclass(classes[k], b) for k, b in bases.items()},
        "parsed": ns.disaggregation_transfer_backend,
        "queues_see_it": [m.TransferBackend("pdxfer").value for m in (prefill, decode)],
        "fake": utils.get_kv_class(
            utils.TransferBackend("fake"), utils.KVClassType.MANAGER
        ).__name__,
        "members": sorted(m.value for m in utils.TransferBackend),
    }


def warm(state: dict) -> str:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.disaggregation.decode  # noqa: F401
    import sglang.srt.disaggregation.prefill  # noqa: F401
    import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401

    import pdxfer.integrations.sglang.conn  # noqa: F401

    return "warm"
