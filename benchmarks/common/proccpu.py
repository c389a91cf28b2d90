"""CPU time of process trees, read from /proc (Linux): how many cores a server and its
children burn, for example while idle. A benchmark measures its variants' idle cost with it
(a busy-polling engine takes CPU the other processes on its host then lack)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds user+system) of one live process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    # fields after the name: state ppid ... utime(12th) stime(13th), counting state as 1st
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def tree_pids(roots: Iterable[int]) -> set[int]:
    """The roots and every live descendant (children, grandchildren, ...)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                parent[int(name)] = st[0]
    out = {r for r in roots if r in parent}
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in out and p not in out}
        out |= more
        grew = bool(more)
    return out


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds used so far by each live pid (its own threads; not its reaped children)."""
    out: dict[int, float] = {}
    for p in pids:
        st = _stat(p)
        if st is not None:
            out[p] = st[1]
    return out


class TreeClock:
    """CPU seconds per second used by the trees under ``roots`` since it was made: the
    caller's work happens in between (``busy_cores`` sleeps there). A process that appears
    meanwhile counts from zero; one that exits meanwhile counts until its last sample."""

    def __init__(self, roots: Iterable[int]) -> None:
        self.roots = list(roots)
        self.t0, self.c0 = time.monotonic(), cpu_seconds(tree_pids(self.roots))

    def cores(self) -> float:
        c0 = self.c0
        c1 = cpu_seconds(tree_pids(self.roots) | set(c0))
        dt = time.monotonic() - self.t0
        used = sum(c1.get(p, c0[p]) - c0[p] if p in c0 else c1[p] for p in c0.keys() | c1)
        return used / dt if dt > 0 else 0.0


def busy_cores(roots: Iterable[int], seconds: float) -> float:
    """CPU seconds per second the trees under ``roots`` use over ``seconds`` of wall time
    (1.0 = one core kept busy)."""
    clock = TreeClock(roots)
    time.sleep(seconds)
    return clock.cores()


def _host_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host since boot, from /proc/stat's ``cpu`` line;
    idle and iowait are the not-busy part (steal counts as busy: a core the hypervisor gave
    elsewhere was not ours to use)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def host_busy_cores(seconds: float) -> float:
    """How many of the host's cores were busy, on average, over the next ``seconds``: what a
    benchmark records as its background before a phase, with none of its own processes
    running. The load average cannot say that: it decays over a minute, so the phase that
    just stopped still shows in it."""
    b0, t0 = _host_ticks()
    time.sleep(seconds)
    b1, t1 = _host_ticks()
    cores = os.cpu_count() or 1
    return cores * (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
