"""``--torch-device``: where a toy worker computes and keeps its KV pools.

The CPU stays the default and unchanged; a device name reaches the worker's config from the
command line; a name torch cannot place, or a GPU with TP > 1 (the toy's ranks gather over
gloo on the host), is refused at configuration with a ``ConfigError`` (as every config
refuses), before any process starts. What runs on a
GPU is in ``tests/gpu/test_toy_cuda.py`` and ``scripts/gpu_check.sh``'s stream step.
"""

from __future__ import annotations

import pytest

from pdxfer import ConfigError
from pdxfer.cli import build_parser
from pdxfer.serving.toy.model import ToyConfig, ToyModel
from pdxfer.serving.toy.worker import WorkerConfig, config_from_args

BOOT = ["--bootstrap", "127.0.0.1:8998"]


def test_the_cpu_is_the_default_and_a_device_name_reaches_the_config() -> None:
    for role in ("prefill", "decode"):
        a = build_parser().parse_args([role, *BOOT])
        assert config_from_args(a, role).torch_device == "cpu"
        a = build_parser().parse_args([role, *BOOT, "--torch-device", "cuda:1"])
        assert config_from_args(a, role).torch_device == "cuda:1"
    m = ToyModel(ToyConfig())
    assert m.device.type == "cpu" and m.new_kv_pool(2).tensors[0].device.type == "cpu"


@pytest.mark.parametrize("bad", ["", "gpu", "cuda:x", "meta"])
def test_a_device_torch_cannot_compute_on_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="torch_device"):
        WorkerConfig(role="decode", bootstrap="127.0.0.1:8998", torch_device=bad)


def test_a_gpu_worker_needs_tp_1() -> None:
    with pytest.raises(ConfigError, match="--tp 1"):
        WorkerConfig(role="decode", bootstrap="127.0.0.1:8998", torch_device="cuda:0", tp=2)
    WorkerConfig(role="decode", bootstrap="127.0.0.1:8998", torch_device="cuda", tp=1)
    with pytest.raises(ValueError, match="TP > 1"):
        ToyModel(ToyConfig(), tp_rank=0, tp_size=2, gather=lambda x: x, device="cuda:0")


def test_a_decode_admitting_longer_than_its_prefill_waits_is_warned_about(caplog) -> None:
    """A request waiting for the decode's pages longer than the prefill waits for the
    decode's ask fails at the prefill (a 502) before the decode's own 503: said at start."""
    caplog.set_level("WARNING", logger="pdxfer.serving.toy.config")
    WorkerConfig(role="decode", bootstrap="127.0.0.1:8998", bootstrap_timeout_s=30.0)
    assert not caplog.records  # the defaults keep the order (20 s under 30 s)
    WorkerConfig(role="decode", bootstrap="127.0.0.1:8998", bootstrap_timeout_s=10.0)
    assert "not under --bootstrap-timeout 10.0 s" in caplog.text
