"""The OpenAI-compatible front door: pairs a prefill and a decode worker per request.

Engine-agnostic: it drives workers through a ``Backend`` (``backends.py``) and never imports
an engine. Names are imported lazily (PEP 562) so that ``pdxfer --help`` can read
``settings.py`` without paying for the app.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Router", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".app", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
