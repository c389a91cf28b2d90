"""The examples a user copies run as they are: the engine API pair moves identical bytes, the
OpenAI client is served through a toy cluster's router, the one-host vLLM scripts serve the
colocated reference's tokens through the router, and the monitoring configs parse and name
only metrics the processes really serve."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdxfer.serving.toy.cluster import Cluster

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_engine_api_example_moves_identical_bytes() -> None:
    r = run([str(EXAMPLES / "engine_api.py")])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert re.search(
        r"OK: 100 tokens of KV in 4 layers, [1-9]\d* bytes moved, identical", r.stdout
    ), r.stdout


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster() as c:
        yield c


def test_openai_client_example_is_served_through_the_router(cluster: Cluster) -> None:
    assert cluster.router is not None
    r = run(
        [
            str(EXAMPLES / "openai_client.py"),
            "--base-url",
            f"{cluster.router.url}/v1",
            "--max-tokens",
            "8",
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "completion: " in r.stdout and "usage: " in r.stdout
    assert re.search(r"'bytes': [1-9]", r.stdout), r.stdout  # KV crossed from prefill
    assert "stream usage: 8 tokens, finish: length" in r.stdout, r.stdout


def _served_names(cluster: Cluster) -> set[str]:
    assert cluster.router is not None and cluster.bootstrap is not None
    urls = [
        cluster.router.url,
        f"http://{cluster.bootstrap.address}",
        *(p.url for p in (cluster.prefill, cluster.decode) if p is not None),
    ]
    text = "".join(urllib.request.urlopen(f"{u}/metrics", timeout=30).read().decode() for u in urls)
    return set(re.findall(r"^# TYPE (\S+)", text, re.M))


def test_monitoring_configs_parse_and_name_only_served_metrics(cluster: Cluster) -> None:
    prom = yaml.safe_load((EXAMPLES / "monitoring" / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in prom["scrape_configs"]}
    assert {"pdxfer-router", "pdxfer-bootstrap", "pdxfer-workers", "vllm"} <= jobs
    assert all(j["static_configs"][0]["targets"] for j in prom["scrape_configs"])
    dash = json.loads((EXAMPLES / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    # every pdxfer_* name a panel asks for is one a running cluster serves (a family's TYPE
    # line names it without _total/_bucket)
    cluster.complete(
        {"model": "pdxfer-toy", "prompt": "hello " * 20, "max_tokens": 2, "temperature": 0}
    )
    served = _served_names(cluster)
    asked = {
        re.sub(r"_(total|bucket|sum|count)$", "", n)
        for e in exprs
        for n in re.findall(r"(?<![:\w])pdxfer_[a-z0-9_]+", e)
    }
    families = {re.sub(r"_total$", "", n) for n in served}
    assert asked and not asked - families, f"not served: {sorted(asked - families)}"
    # the vLLM connector's names are the ones its stats module defines
    from pdxfer.integrations.vllm.stats import COUNTERS, SERIES

    vllm = {
        re.sub(r"_(total|bucket)$", "", n).removeprefix("vllm:pdxfer_")
        for e in exprs
        for n in re.findall(r"vllm:pdxfer_[a-z0-9_]+", e)
    }
    assert vllm and not vllm - set(COUNTERS) - set(SERIES), vllm - set(COUNTERS) - set(SERIES)


def test_launch_scripts_are_valid_bash() -> None:
    scripts = sorted(EXAMPLES.rglob("*.sh"))
    assert len(scripts) >= 4
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert r.returncode == 0, f"{s}: {r.stderr}"


# -- the one-host vLLM scripts, on the small local model ------------------------------------


def _start_one_host(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    from pdxfer.netaddr import free_port
    from pdxfer.serving.vllm.servers import QUIET_ENV

    ports = {
        k: free_port() for k in ("ROUTER_PORT", "PREFILL_PORT", "DECODE_PORT", "BOOTSTRAP_PORT")
    }
    env = {
        **ENV,
        **QUIET_ENV,
        **{k: str(v) for k, v in ports.items()},
        "MODEL": str(model),
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "VLLM_ARGS": "--enforce-eager --dtype float32 --kv-cache-memory-bytes 268435456 "
        "--served-model-name llama --uvicorn-log-level warning --seed 0",
    }
    out = open(log, "wb")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen(
        ["bash", str(EXAMPLES / "vllm_pd" / "one_host.sh")],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out.close()
    return proc, ports


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """The script's own process group (its pid): SIGTERM lets its trap stop the servers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.mark.timeout(1800)  # two vLLM servers start on a shared CPU machine
def test_vllm_one_host_scripts_serve_the_colocated_tokens(tmp_path: Path) -> None:
    from pdxfer.serving.vllm.local_model import build_model
    from tests.integration.vllm_helpers import complete

    model = build_model(tmp_path / "llama")
    log = tmp_path / "one_host.log"
    proc, ports = _start_one_host(model, log)
    try:
        end = time.monotonic() + 1500
        # the script's own line (the bootstrap's "PDXFER_READY ..." comes long before it)
        while not re.search(r"^READY http", log.read_text(errors="replace"), re.M):
            assert proc.poll() is None, f"one_host.sh exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < end, f"not ready:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        router = f"http://127.0.0.1:{ports['ROUTER_PORT']}"
        decode = f"http://127.0.0.1:{ports['DECODE_PORT']}"
        r = run([str(EXAMPLES / "openai_client.py"), "--base-url", f"{router}/v1"], 300)
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        prompt = (
            "The quick brown fox jumps over the lazy dog while the cat watches "
            "from the warm windowsill of the old farmhouse"
        ) * 3
        served = complete(router, prompt)
        # the decode alone, asked without pdxfer's params, computes the prompt itself: the
        # colocated reference, in the same server
        assert served == complete(decode, prompt)
    finally:
        _stop_group(proc)
    assert proc.returncode is not None
