"""A long-lived SGLang-side test process (run in .venv-sglang), driven over a pipe.

Importing SGLang costs each process ~15 s, so a test module starts its processes once and
runs every scenario through them. The driver (``tests/integration/sglang_helpers.py``) writes
one JSON command a line to stdin: ``{"cmd": "module.function", "args": {...}}``; the function
(in a module of this folder) is called as ``function(state, **args)``, ``state`` a dict that
lives as long as the process. Its JSON result, or the error with its traceback, comes back as
one line on the process's original stdout; everything else the process prints (SGLang,
Mooncake, even C code writing to fd 1) goes to stderr.

Nothing is imported before the first command, so a first command can check what a fresh
process sees (``sgl_checks.registration``: SGLang's ``load_plugins`` runs once per process).
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import traceback
from typing import Any


def main() -> None:
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints, Python's or C's, go to stderr
    sys.stdout = sys.stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks on a timeout
    state: dict[str, Any] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            mod, _, fn = req["cmd"].rpartition(".")
            value = getattr(importlib.import_module(mod), fn)(state, **req.get("args", {}))
            reply = {"ok": True, "value": value}
        except BaseException as e:  # noqa: BLE001 - reported to the driver
            reply = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        results.write(json.dumps(reply) + "\n")
        if req["cmd"] == "sgl_server.exit":
            break
    closers = state.get("closers", [])
    for close in reversed(closers):
        try:
            close()
        except Exception:  # noqa: BLE001 - the process is ending anyway
            traceback.print_exc()
    results.close()
    sys.stderr.flush()
    os._exit(0)  # SGLang and Mooncake leave non-daemon threads behind


def exit(state: dict[str, Any]) -> str:  # noqa: A001 - the command's name
    return "bye"


if __name__ == "__main__":
    main()
