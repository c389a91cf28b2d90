"""Moved to ``pdxfer.trust``; this name stays only until ``serving/router/app.py`` imports
``load_secret`` from there (then delete this file and ``pdxfer.auth`` in test_layers.py)."""

from .trust import load_secret

__all__ = ["load_secret"]
