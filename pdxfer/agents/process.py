"""Run endpoints in separate processes and drive them from tests, the demo and benchmarks.

An ``Agent`` is a spawned process holding one or more endpoints with patterned pools; the
driver sends it commands over a pipe. Every call has a timeout, and ``kill()`` / ``close()``
end the process by pid. Nothing here is needed by an engine.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from .patterns import PoolGeom

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """A command failed inside the agent (the message carries the agent's exception)."""


class Agent:
    """A pdxfer endpoint in its own process."""

    def __init__(
        self,
        role: str,
        config: dict[str, Any],
        geoms: list[PoolGeom],
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
        state: str = "pdxfer.agents.commands:AgentState",
        setup: Callable[[], object] | None = None,
    ) -> None:
        """``state`` names the ``module:Class`` whose ``cmd_*`` methods the agent serves (the
        benchmarks add commands in ``benchmarks.common.bench_agent``); ``setup``: a picklable
        callable the agent runs first, before anything opens a socket (a test host's
        ``Host.entry`` moves it into that host's network namespace)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_agent_main,
            args=(child, role, config, geoms, env or {}, state, setup),
            daemon=True,
            name=f"pdxfer-{role}-agent",
        )
        # The child inherits os.environ at spawn, before it imports pdxfer (some settings,
        # like PDXFER_FAULTS, are read at import): set the extra variables around start().
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self.role = role
        if not self._conn.poll(start_timeout):
            self.kill()
            raise AgentError(f"{role} agent did not start within {start_timeout} s")
        status, info = self._conn.recv()
        if status != "ready":
            self.kill()
            raise AgentError(f"{role} agent failed to start: {info}")
        self.info: dict[str, Any] = info

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def call(self, cmd: str, timeout: float = 120.0, **kw: Any) -> Any:
        try:
            self._conn.send((cmd, kw))
        except (BrokenPipeError, OSError) as e:
            raise AgentError(f"{self.role} agent is gone: {e}") from None
        if not self._conn.poll(timeout):
            raise AgentError(f"{self.role} agent: {cmd} did not answer within {timeout} s")
        try:
            status, val = self._conn.recv()
        except EOFError:
            raise AgentError(f"{self.role} agent died during {cmd}") from None
        if status == "err":
            raise AgentError(f"{self.role} agent: {cmd}: {val}")
        return val

    def kill(self) -> None:
        """SIGKILL by pid (a crash, as far as the peer can tell)."""
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(timeout=10)

    def close(self, timeout: float = 20.0) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=timeout)
            except AgentError:
                pass
            self.proc.join(timeout=timeout)
        if self.proc.is_alive():
            self.kill()
        self._conn.close()


def _agent_main(
    conn: Any,
    role: str,
    config: dict[str, Any],
    geoms: list[PoolGeom],
    env: dict[str, str],
    state_cls: str = "pdxfer.agents.commands:AgentState",
    setup: Callable[[], object] | None = None,
) -> None:
    if setup is not None:
        setup()  # before any thread or socket (e.g. entering a host's network namespace)
    os.environ.update(env)
    from ..config import knobs

    logging.basicConfig(
        level=knobs().log_level,
        stream=sys.stderr,
        format=f"[{role} %(process)d] %(levelname)s %(name)s: %(message)s",
    )
    try:
        import importlib

        mod, _, cls = state_cls.partition(":")
        state = getattr(importlib.import_module(mod), cls)()
        info = state.cmd_add_endpoint("main", role, config, geoms)
    except Exception as e:  # noqa: BLE001 - reported to the driver
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", info))
    while True:
        try:
            cmd, kw = conn.recv()
        except (EOFError, OSError):
            break
        if cmd == "exit":
            state.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(state, "cmd_" + cmd)(**kw)))
        except Exception as e:  # noqa: BLE001 - reported to the driver
            log.debug("command %s failed", cmd, exc_info=True)
            conn.send(("err", f"{type(e).__name__}: {e}"))


def wait_until(pred: Any, timeout: float, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


__all__ = ["Agent", "AgentError", "wait_until"]
