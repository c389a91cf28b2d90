"""Start ``vllm serve`` by forking a process that imported vLLM once, not a fresh interpreter.

Importing vLLM's OpenAI server costs as much CPU as the rest of a small server's start, and a
test run starts dozens (figures: docs/testing.md). With
``PDXFER_VLLM_PRELOAD=1`` (the test suite sets it) ``servers.VllmServer`` starts each server
as a child of one fork server: ``python -m pdxfer.serving.vllm.forked``, which imported
``pdxfer.integrations.vllm.preload`` (vLLM's server module) with the environment every server
gets, then forks on request. The child takes its own session, log, working directory,
environment and arguments and runs the module as ``python -m`` would; the engine cores vLLM
starts are forks of it in turn (``_fork_engine_processes``). The fork server reports each
child's pid and exit status on its stdout; a server is stopped by pid like any other.

A fork is only the plain command where the import cannot have seen a difference: a child whose
environment differs from the fork server's in a variable the import read or wrote
(recorded), or in one that native libraries read when they load (``NATIVE``), execs the plain
command line instead, in the same process; so does anything but ``python -m`` that module
(run directly or by ``ip netns exec NAME``: the fork joins that network namespace).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib
import json
import os
import queue
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import IO, Any

from ...netaddr import enter_netns

ENV = "PDXFER_VLLM_PRELOAD"
"""``1``: ``VllmServer`` forks each server from the preloaded process (off by default)."""

PRELOAD = "pdxfer.integrations.vllm.preload"
NATIVE = ("OMP_", "KMP_", "GOMP_", "OPENBLAS_", "MKL_", "LD_", "PYTHON", "MALLOC_")
"""Variables read when a native library loads, or by the interpreter as it starts: a
difference in any of them means the plain command."""


def _omp_threads(value: str) -> None:
    import torch  # the OpenMP runtime vLLM's kernels run on is torch's

    torch.set_num_threads(int(value))


APPLIED: dict[str, Callable[[str], None]] = {"OMP_NUM_THREADS": _omp_threads}
"""Native variables a forked child applies itself, as a fresh process would have at load
(the OpenMP thread count: several-rank servers run one thread a rank); only a positive
count, and only where the import did not read it."""

FORK_TIMEOUT_S = 300.0
"""How long a start waits for the fork server's answer (its first is after vLLM's import)."""


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


class ForkServer:
    """The client's end: one ``python -m pdxfer.serving.vllm.forked`` and a thread reading
    its answers (``{"pid": N}`` per request, in order; ``{"exit": N, "code": C}``)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self._lock = threading.Lock()
        self._pids: queue.Queue[int | None] = queue.Queue()
        self._codes: dict[int, int] = {}
        self._changed = threading.Condition()
        self.gone = False
        threading.Thread(target=self._read, daemon=True, name="vllm-fork-server").start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "pid" in msg:
                self._pids.put(int(msg["pid"]))
            else:
                with self._changed:
                    self._codes[int(msg["exit"])] = int(msg["code"])
                    self._changed.notify_all()
        with self._changed:
            self.gone = True
            self._changed.notify_all()
        self._pids.put(None)

    def fork(self, argv: Sequence[str], env: dict[str, str], log: str) -> int:
        req = {"argv": list(argv), "env": env, "log": log, "cwd": os.getcwd()}
        with self._lock:
            if self.gone or self.popen.stdin is None:
                raise RuntimeError("the vLLM fork server has exited")
            self.popen.stdin.write(json.dumps(req) + "\n")
            self.popen.stdin.flush()
            pid = self._pids.get(timeout=FORK_TIMEOUT_S)
        if pid is None:
            raise RuntimeError("the vLLM fork server exited before it forked")
        return pid

    def code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code (negative: the signal), waiting up to ``timeout``."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or self.gone, timeout)
            if pid in self._codes:
                return self._codes[pid]
        if self.gone:  # no one reports it any more: alive while its pid is
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -1
        return None


_server: ForkServer | None = None
_server_lock = threading.Lock()


class ForkedProcess:
    """A forked server as ``servers.Server`` uses a ``subprocess.Popen``: ``pid``, ``poll``,
    ``wait`` (raising ``subprocess.TimeoutExpired``), ``returncode``."""

    def __init__(self, server: ForkServer, pid: int, argv: Sequence[str]) -> None:
        self._server, self.pid, self.args = server, pid, list(argv)

    @property
    def returncode(self) -> int | None:
        return self._server.code(self.pid, 0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.code(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


def start(
    argv: Sequence[str], env: dict[str, str], log: str, base: dict[str, str]
) -> ForkedProcess:
    """Fork ``argv`` (its own session, output appended to ``log``) from this process's fork
    server, started on first use (and again if it died) with ``base`` as its environment."""
    global _server
    with _server_lock:
        if _server is None or _server.gone:
            _server = ForkServer(base)
        server = _server
    return ForkedProcess(server, server.fork(argv, env, log), argv)


# The fork server's side.


def _serve() -> None:
    """Import vLLM, then fork a child per request line on stdin; report pids and exits on
    stdout, which nothing else writes to (what the import prints goes to stderr)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    importlib.import_module(PRELOAD)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is for the client, which ends us
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                _reap(out)
                continue
            data = os.read(key.fd, 1 << 16)
            if not data:
                return  # the client is gone; the children live on in their sessions
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    sel.close()
                    for fd in (wake_r, wake_w, out.fileno()):
                        os.close(fd)
                    _child(req["argv"], req["env"], req["log"], req["cwd"])
                _say(out, {"pid": pid})


def _reap(out: IO[str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(out, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _say(out: IO[str], msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def _child(argv: list[str], env: dict[str, str], log: str, cwd: str) -> None:
    """In the forked child: never returns."""
    code: Any = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(cwd)
        pre: Any = sys.modules[PRELOAD]
        module: str = pre.MODULE
        differ = _differing(pre, env)
        ns, cmd = netns_split(argv)
        if cmd[:3] != [sys.executable, "-m", module] or differ:
            if differ:  # say why this one is not forked, for whoever wonders at its speed
                print(f"pdxfer: not forked, vLLM's import read {sorted(differ)}", flush=True)
            os.execvpe(argv[0], argv, env)
        if ns is not None:  # as ``ip netns exec`` would (its /sys and /etc/netns binds aside)
            enter_netns(ns)
        # what the import set, as it would have in a fresh process (its inputs agree)
        made = {k: os.environ[k] for k in pre.WRITTEN if k in os.environ}
        os.environ.clear()
        os.environ.update({**env, **made})
        for name, apply in APPLIED.items():
            if env.get(name) != pre.BEFORE.get(name):
                apply(env[name])
        faulthandler.enable()
        _fork_engine_processes()
        sys.argv = [module, *cmd[3:]]
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
        atexit._run_exitfuncs()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))


NETNS_EXEC = ["ip", "netns", "exec"]


def netns_split(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``ip netns exec NAME CMD...``: ``(NAME, CMD...)``; any other command: ``(None, argv)``."""
    argv = list(argv)
    if argv[:3] == NETNS_EXEC and len(argv) > 4:
        return argv[3], argv[4:]
    return None, argv


def _fork_engine_processes() -> None:
    """Start the processes vLLM spawns from this server (engine cores, the DP coordinator, TP
    workers) as forks: vLLM's CPU platform asks for ``spawn``, and a spawned interpreter
    imports vLLM again (most of an engine core's start), which this process already holds.
    vLLM forks them this way by default on GPUs. A fork's own children fork too only where a
    spawn would give them nothing more (``_forks_carry``); otherwise they are spawned."""
    from multiprocessing import context, popen_fork

    spawn = context.SpawnProcess.__dict__["_Popen"]  # the staticmethod itself

    def in_child() -> None:
        if not _forks_carry():
            context.SpawnProcess._Popen = spawn  # type: ignore[method-assign]

    def fork(process_obj: Any) -> Any:
        return popen_fork.Popen(process_obj)

    context.SpawnProcess._Popen = staticmethod(fork)  # type: ignore[method-assign]
    os.register_at_fork(after_in_child=in_child)
    print("pdxfer: forked; vLLM's engine processes fork from this one", flush=True)


def _forks_carry() -> bool:
    """Whether a process forked from a vLLM engine process starts as a spawned one would:
    vLLM sets a spawned worker's OpenMP binding up through its environment, which a fork
    does not read, unless binding is off (``nobind``); and an engine process that may have
    run OpenMP code with a pool of threads leaves a fork a pool it cannot use."""
    import torch

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    return bind == "nobind" and torch.get_num_threads() == 1


def _differing(pre: Any, env: dict[str, str]) -> set[str]:
    """The variables a fresh import would have seen differently than the fork server's did
    (every difference, after an unknown walk of the environment)."""
    before: dict[str, str] = pre.BEFORE
    keys = {*env, *before}
    if not pre.EVERYTHING:
        prefixes = (*NATIVE, *pre.SCANNED)
        native = {k for k in keys if k.startswith(prefixes) and not _applies(k, env)}
        keys = pre.READ | pre.WRITTEN | native
    return {k for k in keys if env.get(k) != before.get(k)}


def _applies(name: str, env: dict[str, str]) -> bool:
    value = env.get(name, "")
    return name in APPLIED and value.isdigit() and int(value) > 0


if __name__ == "__main__":
    _serve()
