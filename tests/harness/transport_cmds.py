"""Agent commands about the transport (run inside a ``harness.Agent`` via ``cmd_ext``)."""

from __future__ import annotations

from typing import Any


def choices(state: Any, ep: str = "main") -> dict[str, Any]:
    """The endpoint's transport and, under ``auto``, what it runs and what it picked per
    peer (``{"name": ..., "runs": [...], "chosen": {peer: kind}}``)."""
    t = state.eps[ep].ep.transport
    inner = getattr(t, "inner", None)
    return {
        "name": t.name,
        "runs": sorted(inner) if inner is not None else [t.name],
        "chosen": t.chosen() if hasattr(t, "chosen") else {},
    }


def nixl_threads(state: Any, ep: str = "main") -> dict[str, Any]:
    """The endpoint's NIXL transport (under ``auto`` too): its UCX threads and the UCX
    backend's parameters as NIXL reports them."""
    t = state.eps[ep].ep.transport
    t = getattr(t, "inner", {}).get("nixl", t)
    return {"threads": t.threads, "ucx": dict(t._agent.get_backend_params("UCX"))}
