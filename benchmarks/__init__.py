"""Benchmarks of pdxfer, outside the library: ``python -m benchmarks.NAME`` or ``pdxfer bench NAME``."""
