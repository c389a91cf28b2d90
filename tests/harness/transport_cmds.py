"""Agent commands about the transport and what it landed (run inside a
``pdxfer.agents.process.Agent`` via ``cmd_ext``)."""

from __future__ import annotations

from typing import Any

from pdxfer.agents import patterns as pat


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


def layers_landed(
    state: Any,
    room: int,
    dst: dict[str, Any],
    num_tokens: int,
    layers: int,
    ep: str = "main",
) -> bool:
    """Whether every token of ``room`` is in place in the buffers of layers ``[0, layers)``
    of each paged pool (``cmd_ext``: a partial-layer stream, checked part way)."""
    e = state.eps[ep]
    for name, spec in e.specs.items():
        pages = e.anchor_pages(name, dst) if spec.kind == "paged" else None
        if pages is None:
            continue
        keep = [i for i, b in enumerate(spec.buffers) if b.layer_id < layers]
        sub = spec.with_(buffers=tuple(spec.buffers[i] for i in keep))
        bad, _ = pat.check_tokens(
            sub, [e.tensors[name][i] for i in keep], room, pages, 0, 0, num_tokens
        )
        if bad:
            return False
    return True
