"""The folders show the layers: arrows run only downward and no import goes in a circle.

Walks pdxfer's sources with ``ast`` (nothing is imported), so a forbidden arrow fails here
before it can turn into an import-order bug or a wheel that drags the test harness along.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "pdxfer"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in ROOT.rglob("*.py")}


def _extensions() -> set[str]:
    """Native modules built from ``*.c`` sources (named, never walked)."""
    return {_module(p) for p in ROOT.rglob("*.c")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules ``name`` imports (a ``from pkg import x`` counts as ``pkg.x`` when that is a
    module, else as ``pkg``)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "pdxfer"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "pdxfer":
                continue
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
            out |= subs or {mod}
            if len(subs) < len(node.names):
                out.add(mod)
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | _extensions()
    return {n: _imports(n, p, known) & set(mods) for n, p in mods.items()}


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


ENGINES = frozenset({"sglang", "vllm"})
"""Inference engines' top-level packages: only ``pdxfer/integrations/`` may import them."""

PUBLIC = ("pdxfer", "pdxfer.tiers")
"""What a user of pdxfer (``serving``, ``integrations``) may import from it."""

SERVER_API = (
    "pdxfer.config",
    "pdxfer.metrics",
    "pdxfer.netaddr",
    "pdxfer.setting",
    "pdxfer.trust",
)
"""What ``serving`` adds to ``PUBLIC``: signed HTTP and protected mode (``trust``), metrics
text, addresses and the settings machinery its flags are generated from. Engines serve no
HTTP of pdxfer's."""

FORBIDDEN = {
    "plan": {
        "endpoint",
        "transport",
        "tiers",
        "serving",
        "agents",
        "wire",
        "bootstrap",
        "metrics",
        "trust",
        "faults",
        "cli",
        "integrations",
    },
    "transport": {"endpoint", "plan", "tiers", "serving", "agents", "cli", "integrations"},
    "endpoint": {"tiers", "serving", "agents", "cli", "integrations"},
    "tiers": {"serving", "agents", "cli", "integrations"},
    "serving": {"agents", "cli", "integrations"},
    "integrations": {"agents", "cli", "serving"},
}


def test_arrows_run_only_downward() -> None:
    bad = []
    for mod, deps in _graph().items():
        for dep in deps:
            if _layer(dep) in FORBIDDEN.get(_layer(mod), set()):
                bad.append(f"{mod} -> {dep}")
    assert not bad, "forbidden imports:\n" + "\n".join(sorted(bad))


def test_only_cli_imports_the_agents() -> None:
    """The agents (``pdxfer transfer-demo``'s processes) are no part of the library."""
    bad = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        for d in deps
        if _layer(d) == "agents" and _layer(m) not in ("agents", "cli")
    ]
    assert not bad, bad


def _top_imports(path: Path) -> set[str]:
    """Top-level packages ``path`` imports absolutely (``import x.y``/``from x.y import z``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_wheel_never_imports_the_checkout() -> None:
    """``tests`` (the harness) and ``benchmarks`` are not in the wheel: the library, the
    demos included, must run without them (``pdxfer bench`` imports ``benchmarks`` by name)."""
    bad = [
        f"{_module(p)} imports {sorted(_top_imports(p) & {'tests', 'benchmarks'})}"
        for p in ROOT.rglob("*.py")
        if _top_imports(p) & {"tests", "benchmarks"}
    ]
    assert not bad, bad


def test_serving_uses_only_the_public_api() -> None:
    """``serving`` is a user of pdxfer like any engine, plus the server helpers."""
    bad = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        if _layer(m) == "serving"
        for d in deps
        if _layer(d) != "serving" and d not in PUBLIC + SERVER_API
    ]
    assert not bad, bad


def test_integrations_use_only_the_public_api() -> None:
    """An engine integration is a user of pdxfer like ``serving``: the modules in ``PUBLIC``
    and, from ``pdxfer`` itself, only the names in its ``__all__``."""
    bad = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        if _layer(m) == "integrations"
        for d in deps
        if _layer(d) != "integrations" and d not in PUBLIC
    ]
    assert not bad, bad
    taken = {n for p in (ROOT / "integrations").rglob("*.py") for n in _names_from_pdxfer(p)}
    assert "Endpoint" in taken  # the walk sees the integrations' imports at all
    assert taken <= _public_names(), sorted(taken - _public_names())


def _public_names() -> set[str]:
    """``pdxfer.__all__``, read from the source."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError("pdxfer/__init__.py has no __all__")


def _names_from_pdxfer(path: Path) -> set[str]:
    """The names ``path`` takes from the package itself (``from pdxfer import X``), submodules
    (``from pdxfer import wire``) left out."""
    subs = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    return {
        a.name
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and node.module == "pdxfer" and not node.level
        for a in node.names
        if a.name not in subs
    }


USERS = ("pdxfer", "tests", "scripts", "examples", "benchmarks")
"""Where code that imports pdxfer lives. The test harness, tests, scripts and benchmarks may
import any internal submodule (``from pdxfer.faults import Faults``); only the layers above
hold the library itself to its arrows."""


def test_names_taken_from_the_package_itself_are_public() -> None:
    """``from pdxfer import X`` means X is public: internals are reached through their
    submodule, so ``__all__`` never widens for the harness's sake."""
    public = _public_names()
    bad = [
        f"{p.relative_to(ROOT.parent)}: {sorted(_names_from_pdxfer(p) - public)}"
        for top in USERS
        for p in (ROOT.parent / top).rglob("*.py")
        if _names_from_pdxfer(p) - public
    ]
    assert not bad, bad


def _engine_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out & ENGINES


def test_only_integrations_import_an_engine() -> None:
    bad = [
        f"{_module(p)} imports {sorted(_engine_imports(p))}"
        for p in ROOT.rglob("*.py")
        if _engine_imports(p) and _layer(_module(p)) != "integrations"
    ]
    assert not bad, bad
    # the walk sees engine imports at all (else this test could not fail)
    assert _engine_imports(ROOT / "integrations" / "vllm" / "connector.py") == {"vllm"}


def test_only_the_router_imports_numba() -> None:
    """numba is the ``router`` extra (the KV index's compiled loops): the library, the
    engines' connectors and the toy workers run without it."""
    router = ROOT / "serving" / "router"
    bad = [
        _module(p)
        for p in ROOT.rglob("*.py")
        if {"numba", "llvmlite"} & _top_imports(p) and p != router / "jit.py"
    ]
    assert not bad, f"numba imported outside serving/router/jit.py: {bad}"
    assert {"numba", "llvmlite"} <= _top_imports(router / "jit.py")  # the walk sees it


def test_no_import_circles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # a package's __init__ re-exporting its own submodules is not a circle
    real = [
        c
        for c in cycles
        if not all(
            c[i + 1].startswith(c[i] + ".") or c[i].startswith(c[i + 1] + ".")
            for i in range(len(c) - 1)
        )
    ]
    assert not real, "import circles:\n" + "\n".join(" -> ".join(c) for c in real)


def test_the_walk_sees_the_package() -> None:
    g = _graph()
    assert "pdxfer.endpoint.sender" in g and "pdxfer.plan.paged" in g["pdxfer.plan.heads"]


def test_no_test_module_imports_another() -> None:
    """What tests share lives in ``tests/harness/`` or an integration ``*helpers.py``: a test
    module imported by another runs its module-level set-up twice and hides its helpers."""
    checkout = ROOT.parent
    bad = []
    for folder in ("tests", "benchmarks", "scripts", "examples"):
        for p in (checkout / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                names: list[str] = []
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n.rpartition(".")[2].startswith("test_") for n in names):
                    bad.append(f"{p.relative_to(checkout)}:{node.lineno}")
    assert not bad, bad
