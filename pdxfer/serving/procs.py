"""Start and stop serving processes (``python -m pdxfer.cli ...``) for the demo and tests.

A child prints ``PDXFER_READY <url>`` on stdout once it serves; we wait for that line with a
deadline, keep draining stdout so the child never blocks on a full pipe, and stop children by
pid (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import ServingError
from .http import READY


class ProcessStartError(ServingError):
    """A serving process exited or stayed silent instead of reporting ready."""

    kind = "process_start"


class Proc:
    """One serving process; ``url`` is what it reported ready on."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        *,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        quiet: bool = True,
        wait: bool = True,
        prefix: Sequence[str] = (),
        log: str | os.PathLike[str] | None = None,
    ) -> None:
        """``prefix``: a command that runs the process elsewhere and execs it (``ip netns
        exec NS``: on another host), so ``pid`` is still the process's own. ``log``: its
        stderr (its logging) appended to this file, whatever ``quiet`` says."""
        self.name, self.args = name, list(args)
        self.log = Path(log) if log is not None else None
        full_env = {**os.environ, **(env or {})}
        full_env.setdefault("MC_LOG_LEVEL", "ERROR")
        with contextlib.ExitStack() as files:
            err: Any = subprocess.DEVNULL if quiet else None
            if self.log is not None:
                err = files.enter_context(open(self.log, "a"))
            self.popen = subprocess.Popen(
                [*prefix, sys.executable, "-m", "pdxfer.cli", *self.args],
                stdout=subprocess.PIPE,
                stderr=err,
                env=full_env,
                text=True,
            )
        self.timeout = timeout
        lines: queue.Queue[str | None] = queue.Queue()
        self._lines = lines

        def drain() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=drain, daemon=True, name=f"drain-{name}").start()
        self.url = ""
        if wait:
            self.wait_ready()

    def wait_ready(self) -> Proc:
        """Block until the child printed its ready line (so starts can overlap)."""
        while not self.url:
            try:
                line = self._lines.get(timeout=self.timeout)
            except queue.Empty:
                self.stop()
                raise ProcessStartError(
                    f"{self.name} did not report ready in {self.timeout} s"
                ) from None
            if line is None:
                rc = self.popen.wait()
                raise ProcessStartError(
                    f"{self.name} exited with {rc} before it was ready "
                    f"(args: {' '.join(self.args)})"
                )
            if line.startswith(READY):
                self.url = line.split()[1]
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash case (no deregistration, no goodbye)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, grace: float = 5.0) -> None:
        if not self.alive():
            return
        os.kill(self.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()


def stop_all(procs: Sequence[Proc]) -> None:
    for p in reversed(list(procs)):
        try:
            p.stop()
        except Exception:  # keep stopping the others
            pass
