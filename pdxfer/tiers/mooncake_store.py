"""L3 on Mooncake Store: a fleet-wide tier served by ``mooncake_master`` and store clients.

Writes use ``batch_upsert_from`` because a plain put keeps an existing value (insert if
absent): a rewritten page must overwrite. ``setup()`` against a dead master blocks for about
90 s, so the master's port is probed first and setup runs under our own deadline. A failed
put (the store is full: -200) is a logged miss, never an error for the request.

``MooncakeMaster`` starts and stops a master process (loopback only, by pid) for tests,
benchmarks and single-node deployments.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..netaddr import free_port
from ..trust import load_secret
from .errors import StorageError
from .storage import NO_DIGEST, TAG_BYTES, Sealer, _buf

log = logging.getLogger(__name__)

MiB = 1 << 20


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """A ``mooncake_master`` with its HTTP metadata server, on free loopback ports."""

    def __init__(
        self, host: str = "127.0.0.1", start_timeout: float = 30.0, log_path: str | None = None
    ) -> None:
        import mooncake

        binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        if not os.path.exists(binary):
            raise StorageError(f"mooncake_master not found at {binary}")
        self.host = host
        self.rpc_port, self.http_port, self.metrics_port = (free_port(host) for _ in range(3))
        args = [
            binary,
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={self.metrics_port}",
            f"--metrics_host={host}",
            "--default_kv_lease_ttl=200",
            "--client_ttl=10",
            "--logtostderr=1",
        ]
        self._log = open(log_path or os.devnull, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=self._log, start_new_session=True
        )
        end = time.monotonic() + start_timeout
        while not (port_open(host, self.rpc_port) and port_open(host, self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise StorageError(f"mooncake_master did not come up on {host}:{self.rpc_port}")
            time.sleep(0.05)

    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tag_key(key: str) -> str:
    return f"{key}.tag"


def _codes(rc: Any, n: int) -> list[int]:
    """Per-key result codes of a batch call (some bindings answer one code for all)."""
    if isinstance(rc, (list, tuple)):
        return [int(r) for r in rc]
    return [int(rc)] * n


class MooncakeStoreStorage:
    """A store client; this process also contributes ``segment_bytes`` of store memory."""

    def __init__(
        self,
        master_addr: str,
        metadata_url: str,
        *,
        host: str = "127.0.0.1",
        segment_bytes: int = 256 * MiB,
        local_buffer_bytes: int = 16 * MiB,
        setup_timeout_s: float = 30.0,
        secret: str | bytes | None = None,
    ) -> None:
        # every object's page digest and tag (``Sealer``) are stored beside it as
        # ``<key>.tag`` (8 + 32 bytes): a client without the secret that upserts a key
        # cannot supply KV (or a digest) that passes the check
        self.sealer = Sealer(load_secret(secret))
        from mooncake.store import MooncakeDistributedStore

        mhost, _, mport = master_addr.rpartition(":")
        if not port_open(mhost, int(mport), timeout=min(2.0, setup_timeout_s)):
            raise StorageError(f"Mooncake master {master_addr} is not reachable")
        self.store: Any = MooncakeDistributedStore()
        result: list[Any] = []

        def setup() -> None:
            try:
                result.append(
                    self.store.setup(
                        host,
                        metadata_url,
                        segment_bytes,
                        local_buffer_bytes,
                        "tcp",
                        "",
                        master_addr,
                    )
                )
            except Exception as e:  # noqa: BLE001 - reported below
                result.append(e)

        t = threading.Thread(target=setup, name="pdxfer-mooncake-setup", daemon=True)
        t.start()
        t.join(setup_timeout_s)
        if t.is_alive():
            raise StorageError(
                f"Mooncake Store setup with {master_addr} did not finish within {setup_timeout_s} s"
            )
        if result[0] != 0:
            raise StorageError(f"Mooncake Store setup with {master_addr} failed: {result[0]}")
        self.put_failures = 0
        self.misses = 0
        self._registered: list[int] = []

    def register(self, addr: int, nbytes: int) -> None:
        if addr in self._registered:
            return  # a cache switched back to this store: already registered
        rc = self.store.register_buffer(addr, nbytes)
        if rc != 0:
            raise StorageError(f"Mooncake Store register_buffer failed: {rc}")
        self._registered.append(addr)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        both = self.store.batch_is_exist([*keys, *(_tag_key(k) for k in keys)])
        n = len(keys)
        return [both[i] == 1 and both[n + i] == 1 for i in range(n)]

    def get_into(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        digests: list[int] | None = None,
    ) -> list[bool]:
        if not keys:
            return []
        got = self.store.batch_get_into(list(keys), list(addrs), list(sizes))
        ok = [int(g) == int(s) for g, s in zip(got, sizes)]
        tags = self.store.get_batch([_tag_key(k) for k in keys])
        for i, (k, a, s) in enumerate(zip(keys, addrs, sizes)):
            meta = bytes(tags[i] or b"")
            d = int.from_bytes(meta[:8], "little", signed=True) if len(meta) >= 8 else 0
            if ok[i] and not (
                len(meta) == 8 + TAG_BYTES and self.sealer.check(k, _buf(a, s), meta[8:], d)
            ):
                ok[i] = False
                log.info("Mooncake Store object %s: tag mismatch (corrupt or forged)", k)
            if digests is not None:
                digests[i] = d if ok[i] else NO_DIGEST
        bad = ok.count(False)
        if bad:
            self.misses += bad
            log.info(
                "Mooncake Store: %d of %d gets missed (%s)",
                bad,
                len(keys),
                sorted({int(g) for g, o in zip(got, ok) if not o}),
            )
        return ok

    def put_from(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        digests: Sequence[int] | None = None,
    ) -> list[bool]:
        if not keys:
            return []
        ds = digests if digests is not None else [NO_DIGEST] * len(keys)
        rcs = self.store.batch_upsert_from(list(keys), list(addrs), list(sizes))
        ok = [int(r) == 0 for r in rcs]
        stored = [
            (k, d.to_bytes(8, "little", signed=True) + self.sealer.tag(k, _buf(a, s), d))
            for k, a, s, d, o in zip(keys, addrs, sizes, ds, ok)
            if o
        ]
        if stored:
            trc = self.store.upsert_batch([_tag_key(k) for k, _ in stored], [t for _, t in stored])
            failed = {k for (k, _), r in zip(stored, _codes(trc, len(stored))) if r != 0}
            ok = [o and k not in failed for k, o in zip(keys, ok)]
        bad = ok.count(False)
        if bad:
            self.put_failures += bad
            log.warning(
                "Mooncake Store: %d of %d puts failed (%s); those pages are L3 misses",
                bad,
                len(keys),
                sorted({int(r) for r in rcs if int(r) != 0}),
            )
        return ok

    def remove(self, key: str) -> int:
        return int(self.store.remove(key, True))

    def close(self) -> None:
        for a in self._registered:
            self.store.unregister_buffer(a)
        self._registered.clear()
        self.store.close()
