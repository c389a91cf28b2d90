"""SGLang's own queues build pdxfer's classes. So far: the prefill's PrefillBootstrapQueue,
from a real CPU MHATokenToKVPool and MetadataBuffers, fills KVArgs itself and builds pdxfer's
manager through get_kv_class, whose pools describe that pool."""

from __future__ import annotations

from .sglang_helpers import run
from .test_sglang_sequence import free_port


def test_prefill_bootstrap_queue_builds_pdxfers_manager_from_real_pools() -> None:
    r = run("check_prefill_queue.py", str(free_port()), str(free_port()))
    assert r["manager"] == "PdxferKVManager"
    assert r["pools"][0] == "kv" and all(p.startswith("aux") for p in r["pools"][1:])
    assert len(r["pools"]) > 1  # every MetadataBuffers row array is a slot pool
    # 2 layers x K and V; page of 4 tokens x 2 heads x 8 dims x fp16
    assert r["kv"] == {"buffers": 4, "page_size": 4, "heads": [2, 2], "item_bytes": 128}
    assert r["instance"] == "sglang"
