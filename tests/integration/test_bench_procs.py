"""What benchmarks/vllm.py relies on to be fair and never hang: a server that never
answers ready ends the start-up with an error naming it, within its deadline; the idle CPU
of a process tree is measured from /proc (a spinning tree costs cores, a sleeping one none);
and colocated's reference for the prefill leg is the request a pair's prefill is sent."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common.proccpu import busy_cores, host_busy_cores, tree_pids
from benchmarks.common.vllm_bench import stream_request
from benchmarks.common.vllm_proxy import FrontDoor
from pdxfer.netaddr import free_port
from pdxfer.serving.vllm.servers import (
    Server,
    ServerNotReady,
    start_one_by_one,
    start_together,
)
from tests.harness.benchrun import run_bench

pytestmark = pytest.mark.engine

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
    tmp_path: Path,
) -> None:
    made: list[Server] = []

    def make(name: str, code: str) -> Server:
        made.append(server(name, code, tmp_path))
        return made[-1]

    t0 = time.monotonic()
    # 10 s: time enough for the healthy one to start on a loaded host
    with pytest.raises(ServerNotReady, match="'mute_prefill'.*not ready within 10 s") as e:
        start_one_by_one(
            [
                lambda: make("ok_decode", HEALTHY),
                lambda: make("mute_prefill", SILENT),
                lambda: make("never_built", HEALTHY),
            ],
            timeout=10.0,
        )
    assert time.monotonic() - t0 < 2 * 10.0 + 30.0  # bounded: no hang on the silent one
    # the error shows where it hung: the silent server's stack, line by line
    assert 'in accept\n  File "<string>", line 6 in <module>' in str(e.value)
    assert [s.name for s in made] == ["ok_decode", "mute_prefill"]  # the third never started
    for s in made:  # every process started is gone, killed by pid
        assert s.popen is not None and s.popen.poll() is not None


def test_servers_started_together_end_the_start_up_naming_one_never_ready_and_all_stop(
    tmp_path: Path,
) -> None:
    """bench_vllm starts a pdxfer pair together: the same deadline, naming the server that
    missed it, and no process left behind (the healthy one included)."""
    made = [server("ok_decode", HEALTHY, tmp_path), server("mute_prefill", SILENT, tmp_path)]
    with pytest.raises(ServerNotReady, match="'mute_prefill'.*not ready within 10 s"):
        start_together([lambda s=s: s for s in made], timeout=10.0)
    assert all(s.popen is not None and s.popen.poll() is not None for s in made)
    up = start_together(
        [lambda: server("a", HEALTHY, tmp_path), lambda: server("b", HEALTHY, tmp_path)],
        timeout=30.0,
    )
    try:
        assert [s.name for s in up] == ["a", "b"] and all(s.alive() for s in up)
    finally:
        for s in up:
            s.stop()


def test_a_server_that_exits_during_start_up_is_named_with_its_log(tmp_path: Path) -> None:
    bad = server("crashing", "import sys; print('boom: no device'); sys.exit(3)", tmp_path)
    with pytest.raises(ServerNotReady, match=r"(?s)'crashing' exited \(3\).*boom: no device"):
        start_one_by_one([lambda: bad], timeout=60.0)


def test_idle_cpu_of_a_spinning_tree_is_cores_and_of_a_sleeping_tree_nothing() -> None:
    # each parent's work happens in a grandchild, so the measure must follow the tree
    spin = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"
    nap = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(600)'])"
    procs = [
        subprocess.Popen([sys.executable, "-c", c], start_new_session=True) for c in (spin, nap)
    ]
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
    tmp_path: Path,
) -> None:
    # a real vLLM server cannot answer /health within 2 s (its imports alone take longer)
    t0 = time.monotonic()
    r = run_bench(
        "vllm",
        "--variants",
        "colocated",
        "--rounds",
        "1",
        "--startup-timeout",
        "2",
        "--json",
        str(tmp_path / "out.json"),
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "server 'colocated_r0_colocated'" in r.stderr
    assert "not ready within 2 s" in r.stderr
    assert not (tmp_path / "out.json").exists()
    assert time.monotonic() - t0 < 600


def test_a_server_that_did_not_start_is_explained_by_the_frame_that_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    bench = importlib.import_module("benchmarks.vllm")
    log = tmp_path / "p.log"
    pre = "(EngineCore pid=1) ERROR 11-26 01:58:48 [core.py:1510] "
    log.write_text(
        "\n".join(
            [
                "(APIServer pid=1) WARNING 11-26 [x.py:1] limit: `OSError: [Errno 24] Too many files`",
                pre
                + 'File "/v/site-packages/vllm/distributed/mooncake_connector.py", line 1186, in '
                "__init__",
                pre + "    self.device_id = torch.accelerator.current_device_index()",
                pre + 'File "/v/site-packages/torch/accelerator/__init__.py", line 140, in current',
                pre + "    return torch._C._accelerator_getDeviceIndex()",
                pre + "RuntimeError: Cannot access accelerator device when none is available.",
                "RuntimeError: Engine core initialization failed. See root cause above.",
            ]
        )
    )
    assert bench.root_cause(log) == (
        "mooncake_connector.py:1186 in __init__: self.device_id = "
        "torch.accelerator.current_device_index(): RuntimeError: Cannot access accelerator "
        "device when none is available."
    )


def test_the_headline_ratios_read_the_variant_a_user_gets_with_no_transport_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``auto`` on one host runs NIXL where it is installed (as it is in this project's
    environment): the benchmark's default-transport ratios must read ``pdxfer_nixl``, not
    Mooncake TCP's variant (they did, in the first fair run)."""
    import importlib

    from pdxfer.transport.auto import pick

    bench = importlib.import_module("benchmarks.vllm")
    assert bench.default_transport() == "auto"
    assert importlib.util.find_spec("nixl_cu12") is not None  # the cpu extra installs it
    assert pick(["tcp", "nixl"], ["tcp", "nixl"], same_host=True) == "nixl"
    assert bench.default_variant() == "pdxfer_nixl"


class _Completions(http.server.BaseHTTPRequestHandler):
    """An OpenAI completions endpoint that records each body it is sent and answers one
    token: streamed as server-sent events, or as one JSON answer with ``kv_transfer_params``
    (what a vLLM prefill adds)."""

    bodies: list[dict[str, Any]]

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        choice = {
            "index": 0,
            "text": "a",
            "token_ids": [400],
            "logprobs": None,
            "finish_reason": None if body.get("stream") else "length",
        }
        answer = {
            "id": "c",
            "object": "text_completion",
            "created": 0,
            "model": "llama",
            "choices": [choice],
        }
        self.send_response(200)
        if body.get("stream"):
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(f"data: {json.dumps(answer)}\n\ndata: [DONE]\n\n".encode())
            return
        raw = json.dumps({**answer, "kv_transfer_params": {"pdxfer_room": 7}}).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *a: Any) -> None:
        pass


@pytest.fixture
def completions() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    handler = type("Recording", (_Completions,), {"bodies": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler.bodies
    finally:
        srv.shutdown()
        srv.server_close()


def test_colocated_reference_leg_is_the_request_a_pairs_prefill_is_sent(
    completions: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 1 compared a pair's prefill leg (one token, not streamed, read whole) with
    colocated's first streamed chunk of a 24-token request, which also found the previous
    answer in its cache: unlike requests. Colocated's reference is now the prefill's own
    request shape, computing what the prefill computes, sent and timed by the same door."""
    import importlib

    bench = importlib.import_module("benchmarks.vllm")
    url, bodies = completions
    prev = bench.tokens(1, 64)  # the conversation's previous prompt, and its answer
    prompt = prev + [411] * 24 + bench.tokens(2, 32)
    pair = FrontDoor(url, url, "d").start()
    colo = FrontDoor(url, "", connector="colocated").start()
    try:
        stream_request(pair.url, prompt, 24, 30)  # the benchmark's own client
        assert len(bodies) == 2 and len(pair.prefill_seconds) == 1
        leg = bench.reference_leg(colo, prompt, len(prev), 2, 24, 30)
    finally:
        pair.close()
        colo.close()
    to_prefill, _, reference = bodies
    assert colo.prefill_seconds == [leg] and leg > 0  # timed where a pair's leg is
    assert "kv_transfer_params" in to_prefill and "kv_transfer_params" not in reference

    def shape_of(b: dict[str, Any]) -> dict[str, Any]:  # None is what vLLM takes as unset
        return {
            k: v
            for k, v in b.items()
            if v is not None and k not in ("prompt", "kv_transfer_params")
        }

    assert shape_of(reference) == shape_of(to_prefill)
    assert reference["max_tokens"] == 1 and reference["stream"] is False
    # what a prefill holds cached (the previous prompt), then as many tokens to compute as
    # it computes (it never saw the answer, which a colocated server holds): other ones,
    # so the conversation's next turn finds its cache as it left it
    ref_prompt = reference["prompt"]
    assert len(ref_prompt) == len(prompt) and ref_prompt[: len(prev)] == prev
    assert ref_prompt[len(prev)] != prompt[len(prev)]


def test_the_prefill_leg_ratio_reads_colocated_s_leg_of_the_same_request_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    bench = importlib.import_module("benchmarks.vllm")
    colo = bench.Samples(ttft=[0.1, 0.1], prefill=[0.08, 0.08], first_chunk=[0.06, 0.06])
    pdx = bench.Samples(ttft=[0.2, 0.2], prefill=[0.084, 0.084])
    res = bench.summary(
        {("colocated", "alone"): colo, ("pdxfer_nixl", "alone"): pdx},
        [],
        ["colocated", "pdxfer_nixl"],
    )
    assert res["vllm.prefill_leg_p50_ms.colocated"] == pytest.approx(80)
    assert res["vllm.first_chunk_p50_ms.colocated"] == pytest.approx(60)
    assert res["vllm.prefill_leg_p50_ratio_vs_colocated.pdxfer_nixl"] == pytest.approx(1.05)
    assert res["vllm.prefill_leg_p50_ratio_vs_colocated_stream.pdxfer_nixl"] == pytest.approx(1.4)
    assert "vllm.decode_leg_p50_ms.colocated" not in res
    assert res["vllm.requests_ms.colocated"] == [[100, 60, 80]] * 2


STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
open(sys.argv[1], "w").write("up")
while True:
    time.sleep(1)
"""

BENCH = """
import sys, time
from pathlib import Path
from benchmarks.common import runner
from pdxfer.serving.vllm.servers import Server

tmp = Path(sys.argv[1])


def add_cli_args(ap):
    pass


def main(a):
    s = Server("stubborn", [sys.executable, "-c", {code!r}, str(tmp / "up")], tmp, port=1)
    s.start()
    (tmp / "pid").write_text(str(s.pid))
    try:
        time.sleep(600)
    finally:
        s.stop(grace=2.0)
    return {{}}


sys.exit(runner.run(sys.modules[__name__], []))
"""


def test_a_benchmark_terminated_twice_still_stops_its_servers(tmp_path: Path) -> None:
    """``timeout`` and a shell each send SIGTERM: the second must not cut the first's
    cleanup short, or a server that needs SIGKILL outlives the benchmark."""
    code = BENCH.format(code=STUBBORN)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    bench = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env)
    pid = 0
    try:
        end = time.monotonic() + 120
        while not (tmp_path / "up").exists() or not (tmp_path / "pid").exists():
            assert bench.poll() is None and time.monotonic() < end, "the stub did not start"
            time.sleep(0.05)
        pid = int((tmp_path / "pid").read_text())
        bench.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # inside the cleanup's grace period now
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 143
        end = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}"), "the server outlived its benchmark"
    finally:
        bench.kill()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
