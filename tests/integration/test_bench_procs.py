"""What scripts/bench_vllm.py relies on to be fair and never hang: a server that never
answers ready ends the start-up with an error naming it, within its deadline; and the idle CPU
of a process tree is measured from /proc (a spinning tree costs cores, a sleeping one none)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdxfer.testing.proccpu import busy_cores, host_busy_cores, tree_pids
from pdxfer.testing.vllm_procs import Server, ServerNotReady, free_port, start_one_by_one

HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

SILENT = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(64)
held = []
while True:  # accepts every connection and never answers a byte
    c, _ = s.accept(); held.append(c)
"""


def server(name: str, code: str, tmp: Path) -> Server:
    port = free_port()
    return Server(name, [sys.executable, "-c", code, str(port)], tmp, port=port)


def test_a_server_never_ready_ends_the_start_up_naming_it_and_stops_the_others(
        tmp_path: Path) -> None:
    made: list[Server] = []

    def make(name: str, code: str) -> Server:
        made.append(server(name, code, tmp_path))
        return made[-1]

    t0 = time.monotonic()
    # 10 s: time enough for the healthy one to start on a loaded host
    with pytest.raises(ServerNotReady, match="'mute_prefill'.*not ready within 10 s"):
        start_one_by_one([lambda: make("ok_decode", HEALTHY),
                          lambda: make("mute_prefill", SILENT),
                          lambda: make("never_built", HEALTHY)], timeout=10.0)
    assert time.monotonic() - t0 < 2 * 10.0 + 30.0  # bounded: no hang on the silent one
    assert [s.name for s in made] == ["ok_decode", "mute_prefill"]  # the third never started
    for s in made:  # every process started is gone, killed by pid
        assert s.popen is not None and s.popen.poll() is not None


def test_a_server_that_exits_during_start_up_is_named_with_its_log(tmp_path: Path) -> None:
    bad = server("crashing", "import sys; print('boom: no device'); sys.exit(3)", tmp_path)
    with pytest.raises(ServerNotReady, match=r"(?s)'crashing' exited \(3\).*boom: no device"):
        start_one_by_one([lambda: bad], timeout=60.0)


def test_idle_cpu_of_a_spinning_tree_is_cores_and_of_a_sleeping_tree_nothing() -> None:
    # each parent's work happens in a grandchild, so the measure must follow the tree
    spin = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"
    nap = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(600)'])"
    procs = [subprocess.Popen([sys.executable, "-c", c], start_new_session=True)
             for c in (spin, nap)]
    try:
        end = time.monotonic() + 60
        while any(len(tree_pids([p.pid])) < 2 for p in procs):  # both grandchildren started
            assert time.monotonic() < end, "the grandchildren did not start"
            time.sleep(0.1)
        spinning = busy_cores([procs[0].pid], 2.0)
        sleeping = busy_cores([procs[1].pid], 2.0)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    # a clock tick is 10 ms: the sleeper shows at most one in 2 s; the spinner, even with
    # a share of a few percent of a core on a loaded host, many
    assert sleeping <= 0.01
    assert spinning >= 0.03



def test_the_hosts_busy_cores_count_a_spinner_and_never_exceed_the_cores() -> None:
    # whatever else runs, a host with a spinner on it is busy at least that spinner's share
    # (a whole core when the host is otherwise idle, all of them when it is loaded)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.5)
        busy = host_busy_cores(2.0)
    finally:
        os.killpg(spin.pid, signal.SIGKILL)
        spin.wait(30)
    assert 0.5 <= busy <= (os.cpu_count() or 1) + 0.01


ROOT = Path(__file__).resolve().parents[2]


def test_bench_vllm_ends_with_an_error_naming_a_server_not_ready_by_its_deadline(
        tmp_path: Path) -> None:
    # a real vLLM server cannot answer /health within 2 s (its imports alone take longer)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_vllm.py"),
                        "--variants", "colocated", "--rounds", "1", "--startup-timeout", "2",
                        "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "server 'colocated_r0_colocated'" in r.stderr
    assert "not ready within 2 s" in r.stderr
    assert not (tmp_path / "out.json").exists()
    assert time.monotonic() - t0 < 600


def test_a_server_that_did_not_start_is_explained_by_the_frame_that_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    bench = importlib.import_module("bench_vllm")
    log = tmp_path / "p.log"
    pre = "(EngineCore pid=1) ERROR 11-26 01:58:48 [core.py:1510] "
    log.write_text("\n".join([
        "(APIServer pid=1) WARNING 11-26 [x.py:1] limit: `OSError: [Errno 24] Too many files`",
        pre + 'File "/v/site-packages/vllm/distributed/mooncake_connector.py", line 1186, in '
              "__init__",
        pre + "    self.device_id = torch.accelerator.current_device_index()",
        pre + 'File "/v/site-packages/torch/accelerator/__init__.py", line 140, in current',
        pre + "    return torch._C._accelerator_getDeviceIndex()",
        pre + "RuntimeError: Cannot access accelerator device when none is available.",
        "RuntimeError: Engine core initialization failed. See root cause above."]))
    assert bench.root_cause(log) == (
        "mooncake_connector.py:1186 in __init__: self.device_id = "
        "torch.accelerator.current_device_index(): RuntimeError: Cannot access accelerator "
        "device when none is available.")


def test_the_headline_ratios_read_the_variant_a_user_gets_with_no_transport_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` on one host runs NIXL where it is installed (as it is in this project's
    environment): the benchmark's default-transport ratios must read ``pdxfer_nixl``, not
    Mooncake TCP's variant (they did, in the first fair run)."""
    import importlib

    from pdxfer.transport.auto import pick

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    bench = importlib.import_module("bench_vllm")
    assert bench.default_transport() == "auto"
    assert importlib.util.find_spec("nixl_cu12") is not None  # the cpu extra installs it
    assert pick(["tcp", "nixl"], ["tcp", "nixl"], same_host=True) == "nixl"
    assert bench.default_variant() == "pdxfer_nixl"
