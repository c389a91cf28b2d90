"""L3: the ``StorageBackend`` protocol and ``FileStorage``, the embedded default.

A backend stores opaque objects by key, one per (page, pool); a page is a hit only when every
pool of its group is present (``prefix_hits`` answers with a prefix length). ``FileStorage``
writes ``header | payload | tag`` to a temp file and renames it into place, so a reader sees
a whole object or none. The tag (``Sealer``: BLAKE3, keyed from the shared secret when there
is one) binds the payload to its key and to the page's integrity digest, which thus follows
the page from its first write-back to every restore; a short, torn, misplaced or forged file
is a miss, never bytes handed to a request. Reads go straight into the L2 page in large
``preadv`` chunks, each hashed while in cache, so a byte crosses memory once for the read and
once for the tag (why BLAKE3:
docs/performance-history.md#what-each-transfer-lead-bought-measured-alone). Files are
opened relative to their folder's descriptor, never through a symlink. Object format v4;
other formats are misses, rewritten by the next write-back.
"""

from __future__ import annotations

import ctypes
import hmac
import logging
import os
import secrets
import stat
import struct
import threading
from collections.abc import Sequence
from typing import Protocol

import blake3

from ..trust import load_secret
from .keys import pool_key

log = logging.getLogger(__name__)

_MAGIC = b"PDXL3v4\0"
_HEAD = struct.Struct("<8sQq")
TAG_BYTES = 32
NO_DIGEST = -1
"""The digest of an object stored without one (the tiers' checks are off)."""


class Sealer:
    """Binds an object's bytes to its key (which names the page and the pool) and digest."""

    CONTEXT = "pdxfer 2026-11 L3 object tag v4"
    """BLAKE3 key derivation context: the tag key is derived from the secret, never it."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self._key = (
            None
            if secret is None
            else blake3.blake3(secret, derive_key_context=self.CONTEXT).digest()
        )

    def hasher(self, key: str, digest: int = NO_DIGEST) -> blake3.blake3:
        """A hash over the object's header fields; ``update`` it with the payload."""
        k = key.encode()
        h = blake3.blake3() if self._key is None else blake3.blake3(key=self._key)
        h.update(
            b"pdxfer-l3-v4|"
            + len(k).to_bytes(4, "little")
            + k
            + digest.to_bytes(8, "little", signed=True)
        )
        return h

    def tag(self, key: str, payload: memoryview | bytes, digest: int = NO_DIGEST) -> bytes:
        h = self.hasher(key, digest)
        h.update(payload)
        return h.digest(TAG_BYTES)

    @staticmethod
    def same(tag: bytes, want: bytes) -> bool:
        return len(tag) == TAG_BYTES and hmac.compare_digest(tag, want)

    def check(
        self, key: str, payload: memoryview | bytes, tag: bytes, digest: int = NO_DIGEST
    ) -> bool:
        return self.same(tag, self.tag(key, payload, digest))


class StorageBackend(Protocol):
    """What the tiers need from L3. Every call is batched and returns per-key outcomes."""

    def register(self, addr: int, nbytes: int) -> None:
        """Host memory that ``get_into`` / ``put_from`` will use (a no-op for files)."""
        ...

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get_into(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        digests: list[int] | None = None,
    ) -> list[bool]:
        """Read each object into ``addr``; True only when exactly ``size`` good bytes came.
        ``digests`` (a list as long as ``keys``) gets the digest each good object was stored
        with (sealed with it), ``NO_DIGEST`` for the rest."""
        ...

    def put_from(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        digests: Sequence[int] | None = None,
    ) -> list[bool]:
        """Store (overwrite) each object, sealed with its page digest (``NO_DIGEST`` when
        ``digests`` is None); False is a miss to log (full, unreachable)."""
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
        if not all(have[i * n : (i + 1) * n]):
            return i
    return len(page_keys)


def _buf(addr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_uint8 * size).from_address(addr)).cast("B")


READ_CHUNK = 1 << 20
"""Bytes per read of an L3 payload: large sequential reads, each small enough to be hashed
from cache right after it landed."""

_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class FileStorage:
    """Objects as files under ``root`` (two-level fan-out by key prefix)."""

    def __init__(
        self, root: str, max_bytes: int | None = None, secret: str | bytes | None = None
    ) -> None:
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes
        self.sealer = Sealer(load_secret(secret))
        os.makedirs(self.root, exist_ok=True)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"L3 root {self.root} is not a directory")
        self.misses = 0
        self.put_failures = 0
        self.refused = 0
        self._lock = threading.Lock()
        self._used = self._walk_size()  # once; then kept up to date by puts

    def path(self, key: str) -> str:
        self._check_key(key)
        return os.path.join(self.root, key[:2], key)

    @staticmethod
    def _check_key(key: str) -> None:
        if not key or "/" in key or "\0" in key or key.startswith(".") or len(key) > 200:
            raise ValueError(f"invalid storage key {key!r}")

    def _dir(self, key: str, create: bool) -> int | None:
        """A descriptor of the key's fan-out folder, opened without following a symlink;
        None when it does not exist (or is not a real folder: refused and counted)."""
        self._check_key(key)
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
        try:
            name = key[:2]
            if create:
                try:
                    os.mkdir(name, 0o700, dir_fd=root)
                except FileExistsError:
                    pass
            try:
                return os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=root)
            except FileNotFoundError:
                return None
            except OSError:  # a symlink or a file planted in place of the folder
                self.refused += 1
                log.warning("L3 folder %s/%s is not a real directory: refused", self.root, name)
                return None
        finally:
            os.close(root)

    def _walk_size(self) -> int:
        total = 0
        for d, _, files in os.walk(self.root):
            for f in files:
                try:
                    total += os.lstat(os.path.join(d, f)).st_size
                except OSError:
                    pass
        return total

    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def register(self, addr: int, nbytes: int) -> None:
        return None

    def _open(self, key: str) -> int | None:
        d = self._dir(key, create=False)
        if d is None:
            return None
        try:
            return os.open(key, os.O_RDONLY | _NOFOLLOW, dir_fd=d)
        except OSError:
            return None
        finally:
            os.close(d)

    def _size_ok(self, key: str) -> bool:
        fd = self._open(key)
        if fd is None:
            return False
        try:
            head = os.pread(fd, _HEAD.size, 0)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if len(head) != _HEAD.size:
            return False
        magic, n, _ = _HEAD.unpack(head)
        return magic == _MAGIC and size == _HEAD.size + n + TAG_BYTES

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self._size_ok(k) for k in keys]

    def get_into(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        digests: list[int] | None = None,
    ) -> list[bool]:
        out = []
        for i, (k, a, s) in enumerate(zip(keys, addrs, sizes)):
            d = self._get(k, a, s)
            out.append(d is not None)
            if digests is not None:
                digests[i] = NO_DIGEST if d is None else d
        return out

    def _get(self, key: str, addr: int, size: int) -> int | None:
        """The object's sealed digest once its bytes are in ``addr``; None for a miss. The
        payload is read in ``READ_CHUNK`` pieces straight into ``addr``, each hashed while
        it is still in cache."""
        fd = self._open(key)
        if fd is None:
            self._miss(key, "absent")
            return None
        try:
            head = os.pread(fd, _HEAD.size, 0)
            if len(head) != _HEAD.size:
                self._miss(key, "short header")
                return None
            magic, n, digest = _HEAD.unpack(head)
            if magic != _MAGIC or n != size:
                self._miss(key, f"header says {n} bytes, want {size}")
                return None
            dst = _buf(addr, size)
            h = self.sealer.hasher(key, digest)
            got = 0
            while got < size:
                part = dst[got : got + READ_CHUNK]
                k = os.preadv(fd, [part], _HEAD.size + got)
                if k <= 0:
                    break
                h.update(part[:k])
                got += k
            tag = os.pread(fd, TAG_BYTES + 1, _HEAD.size + size)
        except OSError as e:
            self._miss(key, str(e))
            return None
        finally:
            os.close(fd)
        if got != size or len(tag) != TAG_BYTES:
            self._miss(key, f"torn: {got} of {size} bytes")
            return None
        if not self.sealer.same(tag, h.digest(TAG_BYTES)):
            self._miss(key, "tag mismatch (corrupt, another key's object, or forged)")
            return None
        return digest

    def _miss(self, key: str, why: str) -> None:
        self.misses += 1
        log.info("L3 file %s is a miss: %s", key, why)

    def put_from(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        digests: Sequence[int] | None = None,
    ) -> list[bool]:
        ds = digests if digests is not None else [NO_DIGEST] * len(keys)
        return [self._put(k, a, s, d) for k, a, s, d in zip(keys, addrs, sizes, ds)]

    def _put(self, key: str, addr: int, size: int, digest: int = NO_DIGEST) -> bool:
        need = _HEAD.size + size + TAG_BYTES
        with self._lock:
            if self.max_bytes is not None and self._used + need > self.max_bytes:
                self.put_failures += 1
                log.info("L3 folder %s is full: %s not stored", self.root, key)
                return False
        d = self._dir(key, create=True)
        if d is None:
            self.put_failures += 1
            return False
        tmp = f".tmp-{secrets.token_hex(8)}"
        src = _buf(addr, size)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=d)
            with os.fdopen(fd, "wb") as f:
                f.write(_HEAD.pack(_MAGIC, size, digest))
                f.write(src)
                f.write(self.sealer.tag(key, src, digest))
            try:
                old = os.stat(key, dir_fd=d, follow_symlinks=False).st_size
            except FileNotFoundError:
                old = 0
            os.replace(tmp, key, src_dir_fd=d, dst_dir_fd=d)
        except OSError as e:
            self.put_failures += 1
            log.warning("L3 put of %s failed (a miss later): %s", key, e)
            try:
                os.unlink(tmp, dir_fd=d)
            except OSError:
                pass
            return False
        finally:
            os.close(d)
        with self._lock:
            self._used += need - old
        return True

    def close(self) -> None:
        return None
