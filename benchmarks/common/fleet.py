"""The processes a benchmark starts: bootstrap servers and agents, each closed when it ends.

Agents start in parallel (each is a spawned process that imports torch: seconds apiece) and
close in reverse order by pid, also when the benchmark fails half-way.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.bootstrap import BootstrapServer

BENCH_STATE = "benchmarks.common.bench_agent:BenchState"
"""The agent state with the benchmarks' commands (timing, raw writes, CPU time)."""


class Fleet(contextlib.AbstractContextManager["Fleet"]):
    """Bootstrap servers and agents started for one benchmark."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def bootstrap(self) -> BootstrapServer:
        srv = BootstrapServer("127.0.0.1", port=0).start()
        self._stack.callback(srv.stop)
        return srv

    def agent(self, role: str, config: dict[str, Any], geoms: list[PoolGeom], **kw: Any) -> Agent:
        a = Agent(role, config, geoms, **kw)
        self._stack.callback(a.close)
        return a

    def agents(
        self, specs: list[tuple[str, dict[str, Any], list[PoolGeom]]], **kw: Any
    ) -> list[Agent]:
        """One agent per ``(role, config, geoms)``, started together; ``kw`` for each."""
        with ThreadPoolExecutor(max(1, len(specs))) as ex:
            futs = [ex.submit(Agent, role, cfg, g, **kw) for role, cfg, g in specs]
        for f in futs:  # every one that started is closed, even if another failed
            if f.exception() is None:
                self._stack.callback(f.result().close)
        for f in futs:
            if (e := f.exception()) is not None:
                raise e
        return [f.result() for f in futs]

    def close(self) -> None:
        self._stack.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BENCH_STATE", "Fleet"]
