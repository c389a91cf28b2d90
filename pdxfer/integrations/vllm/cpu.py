"""What vLLM's CPU kernels assume of the process, which a decode must grant itself.

Linux lets a process use Intel AMX tiles only after it asks (``arch_prctl`` with
``ARCH_REQ_XCOMP_PERM``). vLLM's AMX attention kernel (bf16, blocks of 32) does not ask: it
relies on an earlier prefill's oneDNN matmuls having asked. A decode whose first step is a
loaded request's one-token step has run no such prefill, and dies with ``SIGILL``
(gpt-oss shapes; NixlConnector's decodes too). See docs/vllm.md, "Model families".
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def hold_amx_tiles() -> bool:
    """Ask for AMX tile permission where the CPU has AMX; False where it has none or the
    kernel refuses (then vLLM's kernel choice, not pdxfer, decides what runs)."""
    cpu = getattr(torch, "cpu", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    init = getattr(cpu, "_init_amx", None)
    if supported is None or init is None or not supported():
        return False
    ok = bool(init())
    if not ok:
        log.warning(
            "pdxfer: the kernel refused AMX tile permission; vLLM's AMX kernels may "
            "fail in a decode whose first step is a loaded request"
        )
    return ok
