"""Stand-ins for triton, torchvision and IPython in the SGLang test environment only.

sglang==0.5.23 imports triton unconditionally (``srt/utils/common.py``) and touches
torchvision and IPython on import paths the disaggregation code shares; none of them runs on
the CPU paths pdxfer's tests drive. ``scripts/setup_sglang.sh`` copies this file into
``.venv-sglang`` with a ``.pth`` line that imports it at interpreter start, so the stubs are in
place before the first ``import sglang``. Never part of the ``pdxfer`` package: next to a real
SGLang install these names must resolve to the real packages.

What the stubs must do (checked with sglang==0.5.23 on a CPU machine):
- CamelCase names are real classes (torch's flop counter calls ``isinstance`` on
  ``triton.runtime.jit.JITFunction``);
- ``triton.runtime.driver`` raises on use, so code that probes the GPU falls back to CPU;
- every module has a ``__version__``;
- ``triton.jit`` / ``triton.autotune`` / ``triton.heuristics`` are decorators (with or without
  arguments) that hand back what they wrap, and ``tl.constexpr`` works as an annotation.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STUBBED = ("triton", "torchvision", "IPython")
VERSIONS = {"triton": "3.5.0", "torchvision": "0.28.0", "IPython": "9.0.0"}


class _Value:
    """Any lowercase attribute: callable (a decorator when handed a function), indexable,
    and made of further values, so module-level code that merely mentions it runs."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return f"<stub {self._name}>"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _attr(self._name, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @triton.jit
        return lambda fn=None, *a, **k: fn  # @triton.autotune(configs=...)

    def __getitem__(self, key: Any) -> _Value:
        return self

    def __bool__(self) -> bool:
        return False


class _Driver:
    """``triton.runtime.driver``: there is no GPU driver here; any use says so."""

    def __getattr__(self, attr: str) -> Any:
        raise RuntimeError("triton stub: no GPU driver in this test environment")


class _Meta(type):
    """Stub classes answer any class attribute (``InterpolationMode.NEAREST_EXACT``)."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _attr(f"{cls.__module__}.{cls.__name__}", attr)


_classes: dict[str, type] = {}


def _attr(owner: str, attr: str) -> Any:
    full = f"{owner}.{attr}"
    if attr == "driver":
        return _Driver()
    if attr[:1].isupper():
        cls = _classes.get(full)
        if cls is None:
            cls = _classes[full] = _Meta(
                attr, (), {"__module__": owner, "__init__": lambda self, *a, **k: None}
            )
        return cls
    return _Value(full)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        sub = f"{self.__name__}.{attr}"
        if sub in sys.modules:
            return sys.modules[sub]
        return _attr(self.__name__, attr)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".", 1)[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _StubModule(spec.name)
        mod.__path__ = []
        mod.__version__ = VERSIONS[spec.name.split(".", 1)[0]]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
