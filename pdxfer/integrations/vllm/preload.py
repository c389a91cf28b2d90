"""Imported once, in the fork server of ``pdxfer.serving.vllm.forked``: vLLM's OpenAI server
module, with a note of the environment variables its import read or wrote.

A server forked from that process skips the import but keeps what the import made of
the environment, so ``forked`` compares each server's environment with ``BEFORE`` on those
variables (``READ``, ``WRITTEN``, and any whose name starts with one of ``SCANNED``) and runs
the plain command where they differ. A library that walks the whole environment at import is
either known (``SCANS``: what it looks for) or makes every difference count (``EVERYTHING``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

MODULE = "vllm.entrypoints.openai.api_server"

SCANS: dict[str, str | None] = {
    "tqdm.utils": "TQDM_",  # its TQDM_* defaults
    "networkx.utils.backends": "NETWORKX_",  # its NETWORKX_* settings
    "platform": None,  # a copy for a ``file`` subprocess, gone after
    "wsgiref.handlers": None,  # CGI handlers' snapshot; the server is uvicorn
}
"""Modules known to walk the environment at import, and the prefix each looks for."""

BEFORE: dict[str, str] = dict(os.environ)
READ: set[str] = set()
WRITTEN: set[str] = set()
SCANNED: set[str] = set()
EVERYTHING = False


_MACHINERY = ("collections.abc", "_collections_abc", "os", __name__)


def _caller() -> str:
    """The module outside the mapping machinery that is walking the environment."""
    f: Any = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__") in _MACHINERY:
        f = f.f_back
    return str(f.f_globals.get("__name__")) if f is not None else ""


def _name(key: Any) -> str:
    return key.decode() if isinstance(key, bytes) else str(key)  # os.environb shares the class


def _import_recording() -> None:
    cls: Any = type(os.environ)
    get, put, it = cls.__getitem__, cls.__setitem__, cls.__iter__

    def getitem(self: Any, key: Any) -> Any:
        if _caller() not in SCANS:  # a known walk's values are its prefix's (``SCANNED``)
            READ.add(_name(key))
        return get(self, key)

    def setitem(self: Any, key: Any, value: Any) -> None:
        WRITTEN.add(_name(key))
        put(self, key, value)

    def iterate(self: Any) -> Any:
        global EVERYTHING
        who = _caller()
        if who not in SCANS:
            EVERYTHING = True
        elif SCANS[who]:
            SCANNED.add(str(SCANS[who]))
        return it(self)

    cls.__getitem__, cls.__setitem__, cls.__iter__ = getitem, setitem, iterate
    try:
        __import__(MODULE)
    finally:
        cls.__getitem__, cls.__setitem__, cls.__iter__ = get, put, it


_import_recording()
