"""SGLang's own PrefillBootstrapQueue, built from a real CPU MHATokenToKVPool and real
MetadataBuffers with a scheduler stand-in, fills KVArgs itself and builds pdxfer's manager
through get_kv_class (run in .venv-sglang). Prints one JSON line. Usage: PORT GLOO_PORT."""

from __future__ import annotations

import sys
import types
from unittest.mock import MagicMock

import sgl_common as C
import torch
import torch.distributed as dist


def main(port: int, gloo_port: int) -> None:
    sa = C.publish("prefill", port)
    cls = C.classes()
    srv = cls["bootstrap_server"]("127.0.0.1", port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=0,
                            world_size=1)
    g = dist.new_group([0], backend="gloo")
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import (
        MetadataBuffers,
        ReqToMetadataIdxAllocator,
        TransferBackend,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=256, page_size=4, dtype=torch.float16, head_num=2, head_dim=8,
                            layer_num=2, device="cpu", enable_memory_saver=False)
    mb = MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32,
                         max_sampling_mask_tokens=0)
    runner = types.SimpleNamespace(effective_logical_max_total_num_tokens=256,
                                   kv_cache_dtype_str="float16")
    sched = types.SimpleNamespace(
        tp_worker=types.SimpleNamespace(model_runner=runner, is_hybrid_swa=False),
        kv_shard_widening=1, token_to_kv_pool_allocator=types.SimpleNamespace(page_size=4),
        rust_server=None, server_args=sa, attn_cp_cpu_group=g, attn_tp_cpu_group=g,
        model_config=types.SimpleNamespace(num_hidden_layers=2,
                                           get_total_num_kv_heads=lambda: 2,
                                           hf_text_config=types.SimpleNamespace()))
    q = PrefillBootstrapQueue(pool, None, ReqToMetadataIdxAllocator(8), mb, 0, port, 256,
                              sched, MagicMock(), TransferBackend("pdxfer"))
    m = q.kv_manager
    kv = m.pools[0]
    C.emit({"manager": type(m).__name__, "pools": [p.name for p in m.pools],
            "kv": {"buffers": len(kv.buffers), "page_size": kv.page_size,
                   "heads": [kv.sharding.total_heads, kv.sharding.rank_heads],
                   "item_bytes": kv.item_bytes},
            "instance": m.endpoint.registration().instance})
    m.close()
    srv.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
