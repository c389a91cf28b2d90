"""Which build of a transport loads: NIXL installs as ``nixl_cu12`` or, on CUDA 13 machines,
``nixl_cu13``; either must serve, and a machine with neither must be told what to install."""

from __future__ import annotations

import sys
import types

import pytest

from pdxfer.errors import TransportUnavailable
from pdxfer.transport import nixl


def test_nixl_loads_the_cuda13_build_where_the_cuda12_one_is_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # None: importing it raises
    cu13 = types.ModuleType("nixl_cu13")
    monkeypatch.setitem(sys.modules, "nixl_cu13", cu13)
    assert nixl._load() is cu13
    monkeypatch.setitem(sys.modules, "nixl_cu13", None)
    with pytest.raises(TransportUnavailable, match="nixl-cu13"):
        nixl._load()


def test_nixl_prefers_the_cuda12_build_where_both_are_installed(monkeypatch) -> None:
    cu12, cu13 = types.ModuleType("nixl_cu12"), types.ModuleType("nixl_cu13")
    monkeypatch.setitem(sys.modules, "nixl_cu12", cu12)
    monkeypatch.setitem(sys.modules, "nixl_cu13", cu13)
    assert nixl._load() is cu12
