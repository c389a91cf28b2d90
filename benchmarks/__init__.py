"""Benchmarks of pdxfer, outside the library: ``python -m benchmarks.NAME`` or ``pdxfer bench NAME``."""

NAMES = (
    "flood",
    "goodput",
    "hetero",
    "incremental",
    "models",
    "router_scale",
    "router_served",
    "serving",
    "stream",
    "transfer",
    "vllm",
)
"""Every benchmark, a module of this package (``benchmarks/methods/NAME.md``: its method)."""
