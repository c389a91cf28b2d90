"""The benchmarks' NixlConnector runs need vLLM's ``import nixl`` to find the ``nixl-cu12``
wheel through the shim folder they put on the server's PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.common.vllm_bench import NIXL_SHIM


def test_the_nixl_shim_the_benchmarks_name_lets_vllm_import_nixl() -> None:
    env = {**os.environ, "PYTHONPATH": f"{NIXL_SHIM}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(
        [sys.executable, "-c", "import nixl._api, nixl; print(nixl.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(NIXL_SHIM) in r.stdout
