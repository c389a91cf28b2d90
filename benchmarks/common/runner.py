"""What every benchmark shares: its command line, its method text, the machine and load it ran
on, and its flat JSON.

A benchmark module has a one-line docstring, ``add_cli_args(ap)``, ``main(a) -> dict`` (flat
dotted keys) and optionally ``passed(res) -> bool`` (its exit status); ``run(module)`` does
the rest. Its method is ``benchmarks/methods/NAME.md`` (``--describe`` prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from pdxfer.serving.vllm.servers import ServerNotReady


class Unavailable(RuntimeError):
    """The benchmark cannot run here (it needs root, say): one line on stderr, exit 2."""


ROOT = Path(__file__).resolve().parents[2]
METHODS = ROOT / "benchmarks" / "methods"


def name_of(mod: ModuleType) -> str:
    """``flood`` for ``benchmarks.flood`` (also when run as ``python -m``)."""
    spec = getattr(mod, "__spec__", None)
    return (spec.name if spec else mod.__name__).rsplit(".", 1)[-1]


def method(name: str) -> str:
    """The benchmark's method: what it runs, what each figure means, what limits it."""
    path = METHODS / f"{name}.md"
    return path.read_text() if path.exists() else f"(no {path.relative_to(ROOT)})\n"


def parser(mod: ModuleType) -> argparse.ArgumentParser:
    name = name_of(mod)
    ap = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=(mod.__doc__ or name).strip().splitlines()[0],
        epilog="--describe prints the method.",
    )
    ap.add_argument("--quick", action="store_true", help="a reduced run (minutes at most)")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--describe", action="store_true", help="print the method and exit")
    mod.add_cli_args(ap)
    return ap


def commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30
        ).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        return f"{head}+dirty" if head and git("status", "--porcelain", "-uno") else head or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def machine() -> str:
    """One line naming the machine: CPU model, cores, memory, kernel."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem = 0.0
    return (
        f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{mem:.0f} GiB, {platform.system()} {platform.release()}"
    )


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def phase_start(window_s: float = 3.0) -> dict[str, Any]:
    """What a phase records as it starts, its servers up and idle: the load averages and the
    host's busy cores over ``window_s`` (the background it runs beside, phases running one
    at a time)."""
    from .proccpu import host_busy_cores

    return {
        "loadavg_before": os.getloadavg(),
        "background_cores_before": round(host_busy_cores(window_s), 3),
    }


def record(name: str, argv: list[str], before: list[float], seconds: float) -> dict[str, Any]:
    """The ``run.*`` keys every benchmark's JSON carries."""
    return {
        "run.benchmark": name,
        "run.argv": " ".join(argv),
        "run.commit": commit(),
        "run.machine": machine(),
        "run.python": platform.python_version(),
        "run.loadavg_before": before,
        "run.loadavg_after": load(),
        "run.seconds": round(seconds, 3),
        "run.date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def emit(res: dict[str, Any], path: Path | None) -> None:
    """The results as JSON on stdout (nothing else goes there), and to ``path`` if given."""
    text = json.dumps(res, indent=1, sort_keys=True, default=float)
    print(text, flush=True)
    if path:
        Path(path).write_text(text + "\n")


def _terminated(*_: Any) -> None:
    """SIGTERM unwinds (servers are stopped by pid); a second one, as ``timeout`` and a
    shell both send, must not cut that cleanup short and orphan them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def run(mod: ModuleType, argv: list[str] | None = None) -> int:
    """Parse, run ``mod.main``, add the run's record, print and write the JSON. Exit status:
    0, 1 if ``mod.passed`` says the results are wrong, 2 if a server did not start or
    the benchmark cannot run here (``Unavailable``)."""
    name = name_of(mod)
    args = sys.argv[1:] if argv is None else list(argv)
    a = parser(mod).parse_args(args)
    if a.describe:
        print(method(name), end="")
        return 0
    signal.signal(signal.SIGTERM, _terminated)
    before, t0 = load(), time.monotonic()
    try:
        res = mod.main(a)
    except (ServerNotReady, Unavailable) as e:
        print(f"[{name}] error: {e}", file=sys.stderr)
        return 2
    res.update(record(name, args, before, time.monotonic() - t0))
    emit(res, a.json)
    passed = getattr(mod, "passed", None)
    return 0 if passed is None or passed(res) else 1


def log(name: str, msg: str) -> None:
    """A progress line on stderr (stdout holds only the JSON)."""
    print(
        f"[{name}] {time.strftime('%H:%M:%S')} {msg} (load {load()[0]})",
        file=sys.stderr,
        flush=True,
    )


__all__ = [
    "Unavailable",
    "emit",
    "load",
    "log",
    "machine",
    "method",
    "name_of",
    "parser",
    "phase_start",
    "record",
    "run",
]
