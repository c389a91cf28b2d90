"""vLLM's real ``Scheduler`` (its ``Request``, block manager and ``kv_load_failure_policy``
handling) and a worker-side ``PdxferConnector`` per side, without a model: an ``Engine`` steps
them through the call sequence vLLM's model runner uses, over pdxfer's in-memory transport,
and its fake forward writes a pattern of (layer, head, token, position) into the slots it
"computes", so the decode's blocks can be checked against the prefill's byte for byte.
Shared by the connector's unit tests (``tests/unit/test_vllm_connector.py``,
``test_vllm_streaming.py``, ``test_vllm_layers.py``), which take its ``model`` and
``server`` fixtures by importing them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from pdxfer import BootstrapServer  # noqa: E402
from pdxfer.integrations.vllm.connector import PdxferConnector  # noqa: E402
from pdxfer.integrations.vllm.metadata import PdxferMetadata  # noqa: E402
from pdxfer.serving.vllm.local_model import SHAPES, build_model  # noqa: E402
from pdxfer.transport import MemoryFabric, MemoryTransport  # noqa: E402

BS = 32
NUM_BLOCKS = 48
S = SHAPES["small"]
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(S.layers)]
SAMPLED = 5  # the fake model always samples this token


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama"), "small")


@pytest.fixture(scope="module")
def server() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0).start()
    yield s
    s.stop()


class Engine:
    """One vLLM instance without a model: the real scheduler, one worker-side connector,
    real KV tensors (vLLM's CPU layout: all layers in one allocation, each layer
    ``[blocks, kv_heads, block_size, 2 * head_size]``)."""

    def __init__(
        self,
        model: Path,
        role: str,
        extra: dict[str, Any],
        fabric: MemoryFabric,
        prefix_caching: bool = True,
        policy: str = "recompute",
        batched: int = 4096,
        dp: tuple[int, int] | None = None,
    ) -> None:
        """``dp``: (rank, size), one engine core of ``vllm serve --data-parallel-size``."""
        vc = VllmConfig(
            model_config=ModelConfig(
                model=str(model), dtype="bfloat16", seed=0, served_model_name="m"
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=batched,
                max_model_len=4096,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
            kv_transfer_config=KVTransferConfig(
                kv_connector="PdxferConnector",
                kv_connector_module_path="pdxfer.integrations.vllm",
                kv_role=role,
                kv_connector_extra_config=extra,
                kv_load_failure_policy=policy,
            ),
            parallel_config=ParallelConfig(data_parallel_size=dp[1] if dp else 1),
        )
        if dp is not None:  # as vLLM's engine core process sets up a dense model's DP rank
            vc.parallel_config.data_parallel_index = dp[0]
            vc.parallel_config.reconfigure_for_independent_dp_rank()
        vc.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(
            block_size=BS, num_kv_heads=S.kv_heads, head_size=S.head_size, dtype=torch.bfloat16
        )
        kcc = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
        )
        self.vc = vc
        self.sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BS,
        )
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BS, hash_fn)
        self.conn = PdxferConnector(vc, KVConnectorRole.WORKER, kcc)
        assert self.conn.worker is not None
        self.conn.worker.transport = MemoryTransport(fabric)
        self.kv = torch.zeros(
            S.layers, NUM_BLOCKS, S.kv_heads, BS, 2 * S.head_size, dtype=torch.bfloat16
        )
        self.conn.register_kv_caches({n: self.kv[i] for i, n in enumerate(LAYERS)})
        self.outputs: dict[str, list[int]] = {}
        self.kv_stats: list[dict[str, Any]] = []
        """The connector's figures as vLLM's scheduler hands them to its loggers."""
        self.computed: dict[str, list[tuple[int, int]]] = {}
        """Per request, the (first, count) position ranges the fake forward computed."""

    @property
    def ep(self) -> Any:
        return self.conn.worker.ep  # type: ignore[union-attr]

    def add(
        self, rid: str, tokens: list[int], max_tokens: int, params: dict[str, Any] | None
    ) -> Request:
        sp = SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        r = Request(rid, tokens, sp, None, block_hasher=self.hasher)
        self.sched.add_request(r)
        return r

    def step(self) -> None:
        so = self.sched.schedule()
        assert isinstance(so.kv_connector_metadata, PdxferMetadata)
        c = self.conn
        c.bind_connector_metadata(so.kv_connector_metadata)
        self._forward(so.num_scheduled_tokens)
        c.start_load_kv(None)  # type: ignore[arg-type]  # after the forward, as vLLM does
        c.wait_for_save()
        res = c.get_transfer_results(so.finished_req_ids)
        errors = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = self.sched.requests[rid]
            done = r.num_computed_tokens >= r.num_tokens  # the chunk reached the end
            sampled.append([SAMPLED] if done else [])
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                invalid_block_ids=errors,
                kv_connector_stats=c.get_kv_connector_stats(),
            ),
        )
        for eco in self.sched.update_from_output(so, out).values():
            st = eco.scheduler_stats
            if st is not None and st.kv_connector_stats:
                self.kv_stats.append(st.kv_connector_stats)
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o

    finished: dict[str, Any]

    def _forward(self, scheduled: dict[str, int]) -> None:
        """Write the KV of the tokens this step computes (a pattern, not a model)."""
        for rid, n in scheduled.items():
            r = self.sched.requests[rid]
            first = r.num_computed_tokens - n
            (blocks,) = self.sched.kv_cache_manager.get_block_ids(rid)
            self.computed.setdefault(rid, []).append((first, n))
            for pos in range(first, first + n):
                self.kv[:, blocks[pos // BS], :, pos % BS, :] = pattern(r.all_token_ids[pos], pos)

    def blocks(self, rid: str) -> list[int]:
        return self.sched.kv_cache_manager.get_block_ids(rid)[0]

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()


def pattern(token: int, pos: int) -> torch.Tensor:
    """[layers, heads, 2 * head_size] small integers (exact in bf16), unique enough that a
    block from the wrong place, layer or head shows."""
    lay = torch.arange(S.layers).view(-1, 1, 1) * 37
    head = torch.arange(S.kv_heads).view(1, -1, 1) * 11
    col = torch.arange(2 * S.head_size).view(1, 1, -1)
    return ((lay + head + col + token * 7 + pos * 3) % 251).to(torch.bfloat16)


def expected(tokens: list[int], n: int) -> torch.Tensor:
    return torch.stack([pattern(tokens[p], p) for p in range(n)])  # [n, L, H, C]


def held(e: Engine, rid: str, n: int) -> torch.Tensor:
    blocks = e.blocks(rid)
    return torch.stack([e.kv[:, blocks[p // BS], :, p % BS, :] for p in range(n)])


def run_until(engines: list[Engine], done: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "the engines did not get there in time"
        for e in engines:
            e.step()
        time.sleep(0.002)


@dataclass
class Pair:
    p: Engine
    d: Engine
    server: BootstrapServer


def make_pair(
    model: Path,
    server: BootstrapServer,
    *,
    decode_extra: dict[str, Any] | None = None,
    prefix_caching: bool = True,
    policy: str = "recompute",
    name: str = "a",
    timeouts: float = 10.0,
    batched: int = 4096,
    prefill_extra: dict[str, Any] | None = None,
) -> Pair:
    fabric = MemoryFabric()
    dl = {"bootstrap_timeout_s": timeouts, "transfer_timeout_s": timeouts}
    p = Engine(
        model,
        "kv_producer",
        {"bootstrap": server.address, "instance": f"p-{name}", **dl, **(prefill_extra or {})},
        fabric,
        batched=batched,
    )
    d = Engine(
        model,
        "kv_consumer",
        {"bootstrap": server.address, "instance": f"d-{name}", **dl, **(decode_extra or {})},
        fabric,
        prefix_caching=prefix_caching,
        policy=policy,
    )
    for e in (p, d):
        e.finished = {}
    return Pair(p, d, server)


def prefill_then_decode(
    pair: Pair, rid: str, tokens: list[int], room: int, max_tokens: int = 3
) -> dict[str, Any]:
    """vLLM's proxy protocol through the two schedulers: the prefill with max_tokens=1 and
    do_remote_decode, then the decode with the params the prefill returned."""
    p, d = pair.p, pair.d
    p.add(
        rid,
        tokens,
        1,
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "pdxfer_room": room,
            "pdxfer_decode": d.conn.cfg.instance,
        },
    )
    run_until([p], lambda: rid in p.finished)
    params = p.finished[rid].kv_transfer_params
    assert params["pdxfer_room"] == room and params["do_remote_prefill"] is True
    d.add(rid + "-d", tokens, max_tokens, params)
    return params


def prefill_params(room: int | None, decode: str) -> dict[str, Any]:
    p: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "pdxfer_decode": decode,
    }
    if room is not None:
        p["pdxfer_room"] = room
    return p


def early_params(pair: Pair, room: int) -> dict[str, Any]:
    """What a front door gives the decode at dispatch (``VllmBackend.early_params``)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pdxfer_room": room,
        "pdxfer_bootstrap": pair.server.address,
        "pdxfer_instance": pair.p.conn.cfg.instance,
    }


def orders(e: Engine) -> list[PdxferMetadata]:
    """Step ``e`` once and return the metadata its scheduler built (kept for inspection)."""
    seen: list[PdxferMetadata] = []
    build = e.sched.connector.build_connector_meta  # type: ignore[union-attr]

    def spy(so: Any) -> Any:
        meta = build(so)
        seen.append(meta)
        return meta

    e.sched.connector.build_connector_meta = spy  # type: ignore[union-attr,method-assign]
    try:
        e.step()
    finally:
        e.sched.connector.build_connector_meta = build  # type: ignore[union-attr,method-assign]
    return seen
