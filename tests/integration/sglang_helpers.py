"""Drive SGLang-side processes in SGLang's own environment (``.venv-sglang``, made by
``scripts/setup_sglang.sh``).

Importing SGLang costs a process ~15 s, so a test module starts its processes once
(``SglangProc``, serving ``tests/sglang_env/sgl_server.py``) and runs every scenario through
them; each test still gets a process of its own where it must (registration is checked as
the first command of a fresh process, a prefill meant to be killed is its own process).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PY = ROOT / ".venv-sglang" / "bin" / "python"
SCRIPTS = ROOT / "tests" / "sglang_env"


def sglang_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "SGLANG_HOST_IP": "127.0.0.1",  # else SGLang may probe a route off this machine
            "SGLANG_PLUGINS": "pdxfer",
            "PYTHONWARNINGS": "ignore",  # SGLang warns at import that it has no GPU kernels
            "MC_LOG_LEVEL": "ERROR",
            # the scripts, then this tree's pdxfer (a script's own folder comes first on sys.path,
            # so without ROOT the environment's installed pdxfer would be tested instead)
            "PYTHONPATH": os.pathsep.join((str(SCRIPTS), str(ROOT))),
        }
    )
    env.update(extra)
    return env


def need_env() -> None:
    assert PY.exists(), (
        f"{PY} is missing: run `bash scripts/setup_sglang.sh` (scripts/test.sh does)"
    )


class SglangError(AssertionError):
    """A command failed in the SGLang-side process (with its traceback and stderr tail)."""


class SglangProc:
    """One SGLang-side process serving commands (``module.function`` in tests/sglang_env)."""

    def __init__(self, name: str, **env: str) -> None:
        need_env()
        self.name = name
        self._err = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(PY), str(SCRIPTS / "sgl_server.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=sglang_env(**env),
        )
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._pending = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(b"")

    def stderr_tail(self, n: int = 6000) -> str:
        self._err.flush()
        self._err.seek(0, os.SEEK_END)
        size = self._err.tell()
        self._err.seek(max(0, size - n))
        return self._err.read().decode(errors="replace")

    def submit(self, cmd: str, **args: Any) -> None:
        """Send a command without waiting (answers come back in order: ``result()``)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, "args": args}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise SglangError(f"{self.name} is gone ({e}); stderr:\n{self.stderr_tail()}") from None
        self._pending += 1

    def result(self, wait_s: float = 120.0) -> Any:
        try:
            line = self._lines.get(timeout=wait_s)
        except queue.Empty:
            if self.proc.poll() is None:  # where it is stuck: every thread's stack
                os.kill(self.proc.pid, signal.SIGUSR1)
                time.sleep(1.0)
            raise SglangError(
                f"{self.name}: no answer within {wait_s} s; stderr:\n{self.stderr_tail(20000)}"
            ) from None
        if not line:
            self._lines.put(b"")
            raise SglangError(
                f"{self.name} exited ({self.proc.poll()}); stderr:\n{self.stderr_tail()}"
            )
        self._pending -= 1
        reply = json.loads(line)
        if not reply["ok"]:
            raise SglangError(
                f"{self.name}: {reply['error']}\n{reply['traceback']}\n"
                f"stderr:\n{self.stderr_tail()}"
            )
        return reply["value"]

    def call(self, cmd: str, wait_s: float = 120.0, **args: Any) -> Any:
        self.submit(cmd, **args)
        return self.result(wait_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self, wait_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                while self._pending:
                    self.result(wait_s)
                self.call("sgl_server.exit", wait_s=wait_s)
                self.proc.wait(timeout=wait_s)
            except (SglangError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        if os.environ.get("PDXFER_SGLANG_SHOW_STDERR"):
            print(f"--- {self.name} stderr ---\n{self.stderr_tail(1 << 20)}")
        self._err.close()
