"""Suite-wide settings. ``unit/`` starts no process and no Mooncake engine; ``integration/``
moves real bytes between processes over Mooncake TCP, ZMQ and HTTP on loopback."""

from __future__ import annotations

import os

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's glog noise; real errors still show
# vLLM servers fork from one process that imported vLLM (pdxfer.serving.vllm.forked; what it
# saves: docs/testing.md); PDXFER_VLLM_PRELOAD=0 starts each fresh
os.environ.setdefault("PDXFER_VLLM_PRELOAD", "1")
