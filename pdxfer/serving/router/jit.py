"""numba, which the router's KV index compiles its loops with (``u64map``, ``kv_kernels``,
``prefetch``): the ``router`` extra, not a dependency of the library. Without it, the router
refuses to start with a ``ConfigError`` saying what to install."""

from __future__ import annotations

from pdxfer import ConfigError

try:
    import numba
    import numba.core.cgutils
    import numba.extending
    from llvmlite import ir
except ImportError as e:
    raise ConfigError(
        f"the router's KV index needs numba ({e}): install pdxfer's router extra "
        f"(pip install 'pdxfer[router]')"
    ) from e

__all__ = ["ir", "numba"]
