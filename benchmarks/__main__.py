"""``python -m benchmarks``: the benchmarks and what each measures."""

import importlib

from benchmarks import NAMES

for name in NAMES:
    doc = (importlib.import_module(f"benchmarks.{name}").__doc__ or "").strip()
    print(f"{name:12} {doc}")
print("\npython -m benchmarks.NAME [--quick] [--json PATH] [--describe]  (or: pdxfer bench NAME)")
