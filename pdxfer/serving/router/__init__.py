"""The OpenAI-compatible front door: pairs a prefill and a decode worker per request.

Engine-agnostic: it drives workers through a ``Backend`` (``backends.py``) and never imports
an engine.
"""

from .app import Router, run

__all__ = ["Router", "run"]
