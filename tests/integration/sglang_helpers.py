"""Run SGLang-side checks in SGLang's own environment (``.venv-sglang``, made by
``scripts/setup_sglang.sh``): each check is its own process, because SGLang's
``load_plugins()`` runs once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PY = ROOT / ".venv-sglang" / "bin" / "python"
SCRIPTS = ROOT / "tests" / "sglang_env"


def sglang_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "SGLANG_HOST_IP": "127.0.0.1",  # else SGLang may probe a route off this machine
        "SGLANG_PLUGINS": "pdxfer",
        "PYTHONWARNINGS": "ignore",  # SGLang warns at import that it has no GPU kernels
        "MC_LOG_LEVEL": "ERROR",
        "PYTHONPATH": str(SCRIPTS),
    })
    env.update(extra)
    return env


def need_env() -> None:
    assert PY.exists(), (f"{PY} is missing: run `bash scripts/setup_sglang.sh` "
                         "(scripts/test.sh does)")


def spawn(script: str, *args: str, **env: str) -> subprocess.Popen[str]:
    need_env()
    return subprocess.Popen([str(PY), str(SCRIPTS / script), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=sglang_env(**env))


def result(proc: subprocess.Popen[str], timeout: float = 120.0) -> Any:
    """The JSON object a check printed last; its stderr when it failed."""
    try:
        out, err = proc.communicate(timeout=timeout)  # closes stdin: a waiting side exits
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} timed out; stderr:\n{err[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{proc.args} exited {proc.returncode}; stderr:\n{err[-6000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"{proc.args} printed no result; stderr:\n{err[-6000:]}"
    if os.environ.get("PDXFER_SGLANG_SHOW_STDERR"):
        sys.stderr.write(err)
    return json.loads(lines[-1])


def run(script: str, *args: str, timeout: float = 120.0, **env: str) -> Any:
    return result(spawn(script, *args, **env), timeout)
