"""Stamps inside a vLLM server's processes, for ``scripts/trace_vllm_prefill.py`` only.

On a server started with this folder on its PYTHONPATH and ``PDXFER_TRACE_VLLM=<dir>``, a
thread patches, as their modules load, the methods a request passes through (the API
server's completion handler and output processor; the engine core's ``add_request``,
``step``, scheduler and executor calls and output thread; pdxfer's connector calls), each
recording ``perf_counter_ns`` (``CLOCK_MONOTONIC``: one clock for every process of the host)
and the calling thread's CPU time on entry and exit, and appends them to
``<dir>/<pid>.jsonl`` every half second. Without the variable it does nothing. With
``PDXFER_TRACE_NO_PAUSE=1`` as well, the prefill's step after a finish does not yield to the
output thread (``scheduler.ANSWER_FIRST_S`` 0): the A/B of that change.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("PDXFER_TRACE_VLLM", "")
_events: list[tuple] = []

TARGETS = {
    "vllm.entrypoints.openai.completion.serving": [
        ("OpenAIServingCompletion", "create_completion", "api.handler")
    ],
    "vllm.v1.engine.output_processor": [("OutputProcessor", "process_outputs", "api.outputs")],
    "vllm.v1.engine.core": [
        ("EngineCore", "add_request", "core.add_request"),
        ("EngineCore", "step", "core.step"),
    ],
    "vllm.v1.core.sched.scheduler": [
        ("Scheduler", "schedule", "sched.schedule"),
        ("Scheduler", "update_from_output", "sched.update"),
        ("Scheduler", "_connector_finished", "sched.conn_finished"),
    ],
    "vllm.v1.executor.uniproc_executor": [
        ("UniProcExecutor", "execute_model", "exec.model"),
        ("UniProcExecutor", "sample_tokens", "exec.sample"),
    ],
    "pdxfer.integrations.vllm.connector": [
        ("PdxferConnector", "request_finished", "pdx.request_finished"),
        ("PdxferConnector", "build_connector_meta", "pdx.build_meta"),
        ("PdxferConnector", "start_load_kv", "pdx.start_load_kv"),
        ("PdxferConnector", "wait_for_save", "pdx.wait_for_save"),
        ("PdxferConnector", "get_finished", "pdx.get_finished"),
        ("PdxferConnector", "save_kv_layer", "pdx.save_layer"),
    ],
    "pdxfer.integrations.vllm.sender": [
        ("PrefillSender", "send_blocks", "pdx.hand"),
        ("PrefillSender", "_send_layers", "pdx.give"),
        ("PrefillSender", "open", "pdx.open"),
    ],
    "pdxfer.integrations.vllm.stats_file": [("StatsFile", "write", "pdx.write_stats")],
}


def _wrap(fn, name):
    if getattr(fn, "_pdxfer_traced", False):
        return fn
    if _is_coro(fn):

        @functools.wraps(fn)
        async def traced_async(*a, **kw):
            _events.append((name, "in", time.perf_counter_ns(), time.thread_time_ns()))
            try:
                return await fn(*a, **kw)
            finally:
                _events.append((name, "out", time.perf_counter_ns(), time.thread_time_ns()))

        traced_async._pdxfer_traced = True
        return traced_async

    @functools.wraps(fn)
    def traced(*a, **kw):
        _events.append((name, "in", time.perf_counter_ns(), time.thread_time_ns()))
        try:
            return fn(*a, **kw)
        finally:
            _events.append((name, "out", time.perf_counter_ns(), time.thread_time_ns()))

    traced._pdxfer_traced = True
    return traced


def _is_coro(fn):
    import inspect

    return inspect.iscoroutinefunction(fn)


def _settings(mod: str, m) -> None:
    """A/B switches for pdxfer's own settings, applied as their module loads."""
    if mod == "pdxfer.integrations.vllm.scheduler" and os.environ.get("PDXFER_TRACE_NO_PAUSE"):
        m.ANSWER_FIRST_S = 0.0  # the step after a finish no longer yields (the old way)


def _start() -> None:
    threading.Thread(target=_patch_loop, daemon=True, name="pdxfer-trace-hooks").start()


def _patch_loop():
    todo = {**TARGETS, "pdxfer.integrations.vllm.scheduler": []}
    path = os.path.join(_DIR, f"{os.getpid()}.jsonl")
    end = time.monotonic() + 3600
    while time.monotonic() < end:
        for mod in list(todo):
            m = sys.modules.get(mod)
            if m is None:
                continue
            try:
                for cls, meth, name in todo[mod]:
                    c = getattr(m, cls)
                    setattr(c, meth, _wrap(getattr(c, meth), name))
                _settings(mod, m)
                del todo[mod]
            except AttributeError:
                pass  # the module is still loading
        if _events:
            n = len(_events)
            out = _events[:n]
            del _events[:n]
            with open(path, "a") as f:
                for e in out:
                    f.write(json.dumps(e) + "\n")
        time.sleep(0.02 if todo else 0.5)


if _DIR:
    _start()
    os.register_at_fork(after_in_child=_start)  # a forked engine core: its own file and thread
