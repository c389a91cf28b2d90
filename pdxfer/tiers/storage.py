"""L3: the ``StorageBackend`` protocol and ``FileStorage``, the embedded default.

A backend stores opaque objects by key; the tiers store one object per (page, pool), read
into and written from registered host pages. A page counts as a hit only when every pool of
its group is present (draft KV with target KV, every sidecar): ``prefix_hits`` asks for all
of them in one batch and answers with a prefix length.

``FileStorage`` writes ``header | payload | crc32`` to a temp file and renames it into place,
so a reader sees a whole object or none; a file that is short, torn, of another size or with a
wrong checksum is a miss, never bytes handed to a request.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from typing import Protocol

from .keys import pool_key

log = logging.getLogger("pdxfer.tiers.storage")

_MAGIC = b"PDXL3v1\0"
_HEAD = struct.Struct("<8sQ")
_TAIL = struct.Struct("<I")


class StorageBackend(Protocol):
    """What the tiers need from L3. Every call is batched and returns per-key outcomes."""

    def register(self, addr: int, nbytes: int) -> None:
        """Host memory that ``get_into`` / ``put_from`` will use (a no-op for files)."""
        ...

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
                 ) -> list[bool]:
        """Read each object into ``addr``; True only when exactly ``size`` good bytes came."""
        ...

    def put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
                 ) -> list[bool]:
        """Store (overwrite) each object; False is a miss to log (full, unreachable)."""
        ...

    def close(self) -> None: ...


def prefix_hits(backend: StorageBackend, page_keys: Sequence[str], pools: Sequence[str]) -> int:
    """How many leading pages have every pool's object in ``backend`` (one batched call)."""
    if not page_keys:
        return 0
    keys = [pool_key(k, p) for k in page_keys for p in pools]
    have = backend.exists(keys)
    n = len(pools)
    for i in range(len(page_keys)):
        if not all(have[i * n:(i + 1) * n]):
            return i
    return len(page_keys)


def _buf(addr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_uint8 * size).from_address(addr)).cast("B")


class FileStorage:
    """Objects as files under ``root`` (two-level fan-out by key prefix)."""

    def __init__(self, root: str, max_bytes: int | None = None) -> None:
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes
        os.makedirs(self.root, exist_ok=True)
        self.misses = 0
        self.put_failures = 0

    def path(self, key: str) -> str:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"invalid storage key {key!r}")
        return os.path.join(self.root, key[:2], key)

    def register(self, addr: int, nbytes: int) -> None:
        return None

    def _size_ok(self, path: str) -> bool:
        try:
            with open(path, "rb") as f:
                head = f.read(_HEAD.size)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            return False
        if len(head) != _HEAD.size:
            return False
        magic, n = _HEAD.unpack(head)
        return magic == _MAGIC and size == _HEAD.size + n + _TAIL.size

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self._size_ok(self.path(k)) for k in keys]

    def get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
                 ) -> list[bool]:
        return [self._get(k, a, s) for k, a, s in zip(keys, addrs, sizes)]

    def _get(self, key: str, addr: int, size: int) -> bool:
        try:
            with open(self.path(key), "rb") as f:
                head = f.read(_HEAD.size)
                if len(head) != _HEAD.size:
                    return self._miss(key, "short header")
                magic, n = _HEAD.unpack(head)
                if magic != _MAGIC or n != size:
                    return self._miss(key, f"header says {n} bytes, want {size}")
                dst = _buf(addr, size)
                got = f.readinto(dst)
                tail = f.read(_TAIL.size + 1)
        except FileNotFoundError:
            return self._miss(key, "absent")
        except OSError as e:
            return self._miss(key, str(e))
        if got != size or len(tail) != _TAIL.size:
            return self._miss(key, f"torn: {got} of {size} bytes")
        if _TAIL.unpack(tail)[0] != zlib.crc32(dst):
            return self._miss(key, "checksum mismatch")
        return True

    def _miss(self, key: str, why: str) -> bool:
        self.misses += 1
        log.info("L3 file %s is a miss: %s", key, why)
        return False

    def put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
                 ) -> list[bool]:
        return [self._put(k, a, s) for k, a, s in zip(keys, addrs, sizes)]

    def used_bytes(self) -> int:
        total = 0
        for d, _, files in os.walk(self.root):
            total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
        return total

    def _put(self, key: str, addr: int, size: int) -> bool:
        path = self.path(key)
        if self.max_bytes is not None and self.used_bytes() + size > self.max_bytes:
            self.put_failures += 1
            log.info("L3 folder %s is full: %s not stored", self.root, key)
            return False
        src = _buf(addr, size)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEAD.pack(_MAGIC, size))
                f.write(src)
                f.write(_TAIL.pack(zlib.crc32(src)))
            os.replace(tmp, path)
        except OSError as e:
            self.put_failures += 1
            log.warning("L3 put of %s failed (a miss later): %s", key, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        return True

    def close(self) -> None:
        return None
