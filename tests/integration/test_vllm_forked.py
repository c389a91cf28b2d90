"""A vLLM server started from the preloaded process (``pdxfer.serving.vllm.forked``) runs with
the environment it was given: forked where vLLM's import read none of the variables that
differ from the fork server's, the plain command where one of them does. A forked server's
engine core is a fork of it in turn. Either way what it execs inherits that environment, it
serves the same answers, and it is stopped by pid."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from pdxfer.netaddr import NETNS_DIR
from pdxfer.serving.vllm.local_model import build_model
from pdxfer.serving.vllm.servers import VllmServer, start_all
from tests.harness.hosts import Network
from tests.integration.vllm_helpers import complete, process_tree

pytestmark = pytest.mark.engine


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def _engine_core(log: str) -> int:
    found = re.search(r"\(EngineCore pid=(\d+)\)", log)
    assert found, log[-600:]
    return int(found[1])


def test_a_server_is_forked_only_where_the_import_saw_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDXFER_VLLM_PRELOAD", "1")
    model = build_model(tmp_path / "model", "small")
    # FORKED_PROBE: a variable vLLM's import never reads; VLLM_LOGGING_LEVEL: one it does
    servers = [VllmServer("forked", model, tmp_path, env={"FORKED_PROBE": "forked"})]
    try:
        # the fork server is up: a variable that changed since, seen by no import but in
        # walks of the whole environment (``preload.SCANS``); pytest changes this one in
        # each phase of each test
        now = os.environ["PYTEST_CURRENT_TEST"]
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{now} later")
        # and a thread count a native library reads at load, which the fork applies itself
        later = {"FORKED_PROBE": "later", "OMP_NUM_THREADS": "1"}
        servers.append(VllmServer("later", model, tmp_path, env=later))
        plain = VllmServer(
            "plain", model, tmp_path, env={"FORKED_PROBE": "plain", "VLLM_LOGGING_LEVEL": "INFO"}
        )
        servers.append(plain)
        start_all(servers)
        forked = servers[0]
        for s in servers[:2]:
            assert "-m pdxfer.serving.vllm.forked" in _cmdline(s.pid), s.log.read_text()[-600:]
        assert "-m vllm.entrypoints.openai.api_server" in _cmdline(plain.pid)
        for s in servers:
            # its engine core: a fork of a forked server (the same command line; vLLM's retitle
            # leaves it be), a fresh interpreter under the plain one
            kids = [p for p in process_tree(s.pid) if p != s.pid]
            core = _engine_core(s.log.read_text(errors="replace"))
            assert core in kids, (s.name, core, kids)
            assert (_cmdline(core) == _cmdline(s.pid)) == (s is not plain), _cmdline(core)
            # what it execs inherits its environment (multiprocessing's resource tracker)
            spawned = [p for p in kids if _cmdline(p).startswith(f"{sys.executable} -B -c")]
            assert spawned, f"{s.name}: no spawned Python process under pid {s.pid}"
            assert all(f"FORKED_PROBE={s.name}".encode() in _environ(p) for p in spawned)
        # the level vLLM's import configured logging with is each server's own
        assert " INFO " in plain.log.read_text(errors="replace")
        assert " INFO " not in forked.log.read_text(errors="replace")
        answers = [complete(s.url, "The forked server answers", max_tokens=6) for s in servers]
        assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 6
    finally:
        for s in servers:
            s.stop()
    for s in servers:  # ended, and reaped: its pid no longer names a process
        assert s.popen is not None and s.popen.poll() is not None
        assert not os.path.exists(f"/proc/{s.pid}")


def test_a_server_run_by_ip_netns_exec_forks_into_that_namespace_and_serves_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDXFER_VLLM_PRELOAD", "1")
    model = build_model(tmp_path / "model", "small")
    with Network(["h"]) as net:
        host = net["h"]
        s = VllmServer(
            "in-ns", model, tmp_path, addr=host.addr, prefix=host.prefix, enter=host.enter
        )
        try:
            start_all([s])
            assert "-m pdxfer.serving.vllm.forked" in _cmdline(s.pid), s.log.read_text()[-600:]
            ns = os.stat(f"{NETNS_DIR}/{host.ns}").st_ino
            core = _engine_core(s.log.read_text(errors="replace"))
            for pid in (s.pid, core):  # the server and its engine core live on the host
                assert os.stat(f"/proc/{pid}/ns/net").st_ino == ns, pid
            with host.enter():
                assert len(complete(s.url, "A server on its own host", max_tokens=4)) == 4
        finally:
            s.stop()
