"""``scripts/gpu_check.sh --cpu``: the GPU check's every step, on host memory, to its end.

The GPU check runs on a borrowed machine for a few minutes at a time: a step that breaks
there costs the whole loan. Here the same script, the same steps and the same driver run
with the pools on ``cpu`` and the transports already installed (no ``.whl/``, no network), so
the check stays runnable; this test reads the JSON it wrote and wants every step, and every
check inside the transfer steps, passed; the raw probe's every path byte-exact, with its
figures and pdxfer's comparison keys present and numeric (never a speed: this is no GPU), the
packed bulk paths byte-exact; the stream step's toy workers (``--torch-device cpu`` here)
streaming by layer through the router with every output equal to the colocated toy's, its
TTFT keys present. A second run with a budget too small for the steps ends inside it and
still writes what it measured; it runs beside the first (its length is its budget's, not the
CPU's), started by a module fixture.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_stream import label  # noqa: E402

pytestmark = pytest.mark.engine


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the script's python: this one (its dependencies and transports are installed)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


BUDGET_S = 25


@dataclass(frozen=True)
class BudgetRun:
    """``gpu_check.sh --cpu --transport tcp --budget 25`` under way in ``out``."""

    popen: subprocess.Popen[str]
    out: Path

    def wait(self, timeout: float) -> tuple[int, str]:
        """Its exit status and its log (its stdout if it wrote no log)."""
        stdout, _ = self.popen.communicate(timeout=timeout)
        log = self.out / "log"
        return self.popen.returncode, log.read_text() if log.exists() else stdout


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BudgetRun]:
    """The short-budget run, started as soon as either test asks for it: it ends at its
    budget however busy the CPU is, so it runs beside the full run rather than after it."""
    out = tmp_path_factory.mktemp("gpu_check_budget")
    p = subprocess.Popen(
        [
            "bash",
            str(ROOT / "scripts" / "gpu_check.sh"),
            str(out),
            "--cpu",
            "--transport",
            "tcp",
            "--budget",
            str(BUDGET_S),
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield BudgetRun(p, out)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # its own session: the script and its steps
            p.communicate()


@pytest.mark.timeout(3600)
def test_the_gpu_check_runs_every_step_to_its_end_on_host_memory(
    tmp_path: Path, budget_run: BudgetRun
) -> None:
    del budget_run  # started first, so that it runs beside this run (the next test reads it)
    env = _env()
    # limits x6: they only bound a hang, and this 2-core machine runs the suite beside other
    # work (at a load of 40-60 a transfer step took 4 to 8 minutes here)
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "--cpu", "--scale", "6"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3500,
    )
    log = (tmp_path / "log").read_text() if (tmp_path / "log").exists() else p.stdout
    assert (tmp_path / "gpu_check.json").exists(), log[-4000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {k.rsplit(".", 1)[0] for k in r if k.endswith(".passed")}
    assert steps == {
        "wheels",
        "probe",
        "pytest_gpu",
        "transfers.tcp",
        "transfers.nixl",
        "bulk",
        "stream",
    }, r
    assert r["complete"] is True and r["total_s"] <= r["budget_s"] + 30
    failed = sorted(k for k, v in r.items() if k.endswith((".passed", ".ok")) and v is not True)
    assert not failed and r["all_passed"] and p.returncode == 0, (failed, log[-4000:])
    for t in ("tcp", "nixl"):
        for check in ("pages", "landing_host", "hetero", "integrity", "l2_restore"):
            assert r[f"transfers.{t}.{check}.ok"] is True
        assert r[f"transfers.{t}.pages.requests"] == 8
        assert r[f"transfers.{t}.pages.bytes_wrong"] == 0
        for mode in ("sampled", "full"):
            assert r[f"transfers.{t}.integrity.{mode}.corrupt.caught"] == 3
        assert r[f"transfers.{t}.l2_restore.l2_pages"] == 18
        assert r[f"bulk.gb_per_s.{t}"] > 0
    assert r["bulk.gb_per_s.torch_d2d"] > 0 and r["bulk.gb_per_s.torch_pinned_h2d"] > 0
    assert r["mode"] == "cpu" and r["device"] == "cpu"
    # the raw probe: every path it runs here moved its bytes word for word
    assert r["probe.words_wrong"] == 0 and r["probe.errors"] == [], r
    raw = {k for k in r if k.startswith("probe.") and k.endswith(".gb_per_s")}
    want = {
        f"probe.nixl.t{t}.{d}.gb_per_s" for t in (1, 2, 4, 8) for d in ("d32k", "d512k", "dbuf")
    }
    want |= {
        "probe.nixl.t1.d32k_batch4096.gb_per_s",
        "probe.nixl.t1.d32k_per_call.gb_per_s",
        "probe.mooncake.tcp.d32k.gb_per_s",
        "probe.mooncake.tcp.dbuf.gb_per_s",
        "probe.ipc.staged.d32k.gb_per_s",
        "probe.ipc.direct.d32k.gb_per_s",
        "probe.best_raw.gb_per_s",
    }
    assert want <= raw, want - raw
    for k in want:
        assert isinstance(r[k], float) and r[k] > 0, k
        if k != "probe.best_raw.gb_per_s":
            assert r[k.replace(".gb_per_s", ".words_wrong")] == 0, k
    assert r["probe.bytes"] == r["bulk.bytes"]  # the same shape as pdxfer's bulk
    assert r["probe.mooncake.nvlink_intra.skipped"].startswith("cpu")
    assert r["probe.mooncake.tcp.installed"] == "tcp"  # read from the engine's own log
    assert isinstance(r["probe.nixl.ucx_proto.transports"], list)
    assert r["probe.nixl.ucx_proto.cuda_ipc"] is False  # host memory: cma, never cuda_ipc
    # pdxfer's best against the best raw path and the device copy (docs/performance.md's keys)
    assert r["bulk.skipped.nvlink"].startswith("cpu")
    assert r["bulk.skipped.nvlink_pack"].startswith("cpu")
    paths = ("tcp", "nixl", "tcp_pack", "nixl_pack")
    for k in ("tcp_pack", "nixl_pack"):  # packed: gathered, one large write, scattered
        assert isinstance(r[f"bulk.gb_per_s.{k}"], float) and r[f"bulk.gb_per_s.{k}"] > 0
        assert r[f"bulk.bytes_wrong.{k}"] == 0
    assert r["bulk.gb_per_s.pdxfer_best"] == max(r[f"bulk.gb_per_s.{k}"] for k in paths)
    assert r["bulk.pdxfer_best_path"] in paths
    assert r["bulk.best_raw.gb_per_s"] == r["probe.best_raw.gb_per_s"] > 0
    ratio = r["bulk.gb_per_s.pdxfer_best"] / r["probe.best_raw.gb_per_s"]
    assert abs(r["bulk.pdxfer_ratio_vs_best_raw"] - ratio) < 1e-3
    assert r["bulk.pdxfer_fraction_of_d2d"] > 0
    for k in paths:
        assert isinstance(r[f"bulk.ratio_vs_raw.{k}"], float)
    # the stream step: PD through the router, layer by layer, against the colocated toy
    assert r["stream.torch_device"] == "cpu" and r["stream.transport"] == "nixl"
    assert r["stream.errors"] == [] and r["stream.mismatches"] == 0
    assert r["stream.outputs_compared"] == 3  # the warm-up and one prompt per size
    assert r["stream.sizes"] == [128, 512]
    for n in (128, 512):
        k = label(n)
        assert r[f"stream.tokens_{k}"] == n and r[f"stream.rounds_{k}"] == 1
        assert r[f"stream.pd_layer_sends_{k}"] >= 4 * n // 64  # each layer of each chunk
        for key in ("ttft_ms_pd", "ttft_ms_colocated", "ttft_ratio_vs_colocated", "pd_prefill_ms"):
            assert isinstance(r[f"stream.{key}_{k}"], float) and r[f"stream.{key}_{k}"] > 0
    assert (label(2048), label(8192)) == ("2k", "8k")  # the keys the GPU run reports
    for name in steps:
        assert isinstance(r[f"{name}.step_s"], float) and r[f"{name}.limit_s"] > 0


@pytest.mark.timeout(300)
def test_the_gpu_check_ends_inside_its_budget_and_keeps_what_it_measured(
    budget_run: BudgetRun,
) -> None:
    """A device is lent for one bounded command: a run whose budget runs out bounds the step
    in flight by what is left, skips the rest, and still writes its JSON."""
    rc, log = budget_run.wait(timeout=280)
    assert rc != 0, log[-4000:]
    r = json.loads((budget_run.out / "gpu_check.json").read_text())
    assert r["complete"] is True and r["all_passed"] is False, r
    assert r["total_s"] < BUDGET_S + 20, r  # the budget, the kill grace, the folds
    assert r["wheels.passed"] is True, log[-4000:]
    cut = [
        s
        for s in ("probe", "pytest_gpu", "transfers.tcp", "bulk", "stream")
        if r[f"{s}.rc"] in (124, 125)
    ]
    assert cut and r[f"{cut[-1]}.rc"] == 125, r  # the last steps never started
    for s in ("probe", "pytest_gpu", "transfers.tcp", "bulk", "stream"):
        assert r[f"{s}.limit_s"] <= BUDGET_S, r
