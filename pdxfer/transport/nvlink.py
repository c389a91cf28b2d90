"""Mooncake's intra-node NVLink transport (``nvlink_intra``): what pdxfer must know to use it.

* It is in CUDA builds made with ``USE_INTRA_NVLINK`` (``mooncake-transfer-engine-cuda13``
  0.3.13.post1 is), never in the CPU wheel; ``built`` reads the engine library for it.
* The protocol string given to ``initialize`` does not pick it: the engine installs it when
  ``MC_INTRANODE_NVLINK`` is set while it initialises (read there only), so
  ``intranode_env`` sets it around that one call and hides it from every other engine.
* It takes device memory only, and shares each registration as one CUDA IPC handle, which
  the peer maps at the start of the *allocation* holding it, then offsets addresses from the
  registered start: a buffer registered from inside an allocation (a pool carved from
  PyTorch's caching allocator) would land its writes off by that distance. So whole
  allocations are registered, each once (``Allocations``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "MC_INTRANODE_NVLINK"
_ENV_LOCK = threading.Lock()
MARK = b"IntraNodeNvlinkTransport"
"""A class name only a build with the transport carries (its symbols)."""


@functools.cache
def built() -> bool:
    """Whether the installed Mooncake engine has ``nvlink_intra`` (without loading it)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return False
    for d in spec.submodule_search_locations:
        for so in Path(d).glob("engine*.so"):
            with open(so, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(MARK) >= 0:
                    return True
    return False


@contextlib.contextmanager
def intranode_env(on: bool) -> Iterator[None]:
    """``MC_INTRANODE_NVLINK`` set (``on``) or unset for one engine's initialisation, and
    as it was afterwards; engines initialise one at a time meanwhile."""
    with _ENV_LOCK:
        old = os.environ.get(ENV)
        if on:
            os.environ[ENV] = "1"
        else:
            os.environ.pop(ENV, None)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = old


_RANGE_START_ADDR, _RANGE_SIZE = 11, 12
"""``CUpointer_attribute`` values: asked of a pointer, they need no current context (which a
registering thread may lack)."""


def cuda_allocation(addr: int) -> tuple[int, int] | None:
    """``(start, size)`` of the CUDA allocation holding ``addr`` (``cuPointerGetAttribute``),
    or None where the driver cannot say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if cuda.cuInit(0) != 0:
        return None
    for out, attr in ((base, _RANGE_START_ADDR), (size, _RANGE_SIZE)):
        if cuda.cuPointerGetAttribute(ctypes.byref(out), attr, ctypes.c_uint64(addr)) != 0:
            return None
    return base.value, size.value


class Allocations:
    """Which allocation each registered buffer lies in, and how many buffers use each: an
    allocation is registered with the engine when its first buffer is, and released with
    its last. ``lookup`` finds an address's allocation (``cuda_allocation``; None: the
    buffer is taken as an allocation of its own)."""

    def __init__(self, lookup: Callable[[int], tuple[int, int] | None] | None = None) -> None:
        self._lookup = lookup or (lambda a: cuda_allocation(a))
        self._of: dict[int, int] = {}
        self._uses: dict[int, int] = {}

    def add(self, addr: int, nbytes: int) -> tuple[int, int, bool]:
        """``(start, size, first)`` of ``addr``'s allocation; ``first``: register it now."""
        found = self._lookup(addr)
        if found is None or not found[0] <= addr < addr + nbytes <= found[0] + found[1]:
            if found is None:
                log.warning(
                    "nvlink_intra: no allocation found for %#x: registered as is "
                    "(right only if the buffer starts its allocation)",
                    addr,
                )
            found = (addr, nbytes)
        base, size = found
        self._of[addr] = base
        self._uses[base] = self._uses.get(base, 0) + 1
        return base, size, self._uses[base] == 1

    def remove(self, addr: int) -> int | None:
        """Forget ``addr``; the allocation's start when no buffer uses it any more."""
        base = self._of.pop(addr, None)
        if base is None:
            return None
        self._uses[base] -= 1
        if self._uses[base]:
            return None
        del self._uses[base]
        return base
