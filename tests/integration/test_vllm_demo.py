"""``pdxfer demo --engine vllm`` as a user runs it: real ``vllm serve`` prefill, decode and
colocated reference behind pdxfer's router, which dispatches both sides at once
(concurrent dispatch, and still PASS). The demo checks every output
against the colocated reference itself; this test holds it to its verdict, to the dispatch
the router reported for every request, and to the layers the prefill streamed.

A reduced batch without the decode restart keeps it short (the L3 restore after a restart
is tested in ``test_vllm_pd.py``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

N = 5


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run the demo; past ``timeout`` interrupt it (SIGINT: its ``finally`` stops the vLLM
    servers it started, which live in sessions of their own), then kill it."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        raise AssertionError(f"the demo ran past {timeout} s:\n{out[-4000:]}") from None
    return proc.returncode, out


def test_the_vllm_demo_dispatches_both_sides_at_once_and_passes() -> None:
    rc, out = _run(
        [
            sys.executable,
            "-m",
            "pdxfer.cli",
            "demo",
            "--engine",
            "vllm",
            "--requests",
            str(N),
            "--no-restart",
        ],
        timeout=780,
    )
    assert rc == 0, out[-4000:]
    assert out.rstrip().endswith("PASS"), out[-4000:]
    assert f"{N}/{N} outputs identical to colocated vLLM" in out, out[-4000:]
    assert f"dispatch: concurrent for {N}/{N} requests" in out, out[-4000:]
    hand_offs = re.search(
        r"KV streamed layer by layer from the prefill: (\d+) layer "
        r"hand-offs .* for (\d+) requests",
        out,
    )
    assert hand_offs is not None, out[-4000:]
    # every request's KV was handed to the sender, at least once each. How many hand-offs
    # went layer by layer depends on a race the demo does not control: the decode asks at
    # dispatch, and a step computed before that ask reaches the prefill hands its layers over
    # in one piece after the forward (CI saw all 5 asks land after the forward). The
    # layer-by-layer rule itself is held deterministically by test_vllm_layers ("early").
    assert int(hand_offs.group(2)) >= N, out[-4000:]
    assert int(hand_offs.group(1)) >= N, out[-4000:]
