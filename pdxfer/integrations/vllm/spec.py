"""Speculative decoding: which drafter's KV a pair moves, named for the pairing check.

A drafter that keeps KV of its own (a draft model, EAGLE/EAGLE3, MTP) has layers in vLLM's
KV cache beside the target's: the prefill's drafter computes that KV for the prompt and the
decode's drafter reads it on its first step, so both sides must run the same drafter. Its
identity joins the pairing fingerprint (``draft=...``); two sides that differ are refused
when they pair, naming both values. A model-free drafter (n-gram, suffix) needs nothing from
the prefill: ``none``, like no speculative decoding. The number of speculative tokens is
each side's own (the prompt's draft KV does not depend on it).
"""

from __future__ import annotations

import os
from typing import Any

NONE = "none"


def draft_id(spec: Any) -> str:
    """``method:draft`` (and the draft's revision, KV cache dtype and parallel drafting
    where set) of a ``SpeculativeConfig`` whose drafter keeps KV; else ``none``. A local
    draft directory is named by its folder name (the same draft sits at different paths on
    different hosts), a hub model by its id."""
    if spec is None or not spec.uses_draft_kv_cache():
        return NONE
    model = str(spec.model or getattr(spec.draft_model_config, "model", "") or "")
    name = os.path.basename(model.rstrip("/")) if os.path.isdir(model) else model
    out = f"{spec.method}:{name}"
    if spec.revision:
        out += f"@{spec.revision}"
    if spec.kv_cache_dtype:
        out += f":kv={spec.kv_cache_dtype}"
    if spec.parallel_drafting:
        out += ":parallel"
    return out.replace(" ", "_")
