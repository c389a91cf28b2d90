"""``PdxferConnector``: the class vLLM instantiates; a thin facade.

vLLM builds the connector twice: once with the scheduler role (in the engine core) and once
per worker rank. This facade checks the configuration first, then forwards each call to
``PdxferScheduler`` (``scheduler.py``) or ``PdxferWorker`` (``worker.py``: the rank's step,
over its sender and loader halves), which never import it back.

Load it by module path (no registration needed)::

    --kv-transfer-config '{"kv_connector": "PdxferConnector",
                           "kv_connector_module_path": "pdxfer.integrations.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdxfer import ConfigError

from . import config as C
from . import tiles
from .groups import Group
from .metadata import PdxferMetadata
from .scheduler import PdxferScheduler
from .spec import draft_id
from .state import TensorSplit, splits
from .stats import PdxferPromMetrics, PdxferStats
from .worker import PdxferWorker, RankInfo

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def check_compatible(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> tuple[Group, ...]:
    """What pdxfer cannot serve is refused at start-up, with the reason; else the KV cache
    groups it moves."""
    par = vllm_config.parallel_config
    for name, size in (
        ("pipeline_parallel_size", par.pipeline_parallel_size),
        ("decode_context_parallel_size", getattr(par, "decode_context_parallel_size", 1)),
        ("prefill_context_parallel_size", getattr(par, "prefill_context_parallel_size", 1)),
    ):
        if size != 1:
            raise ConfigError(f"PdxferConnector does not support {name}={size} yet")
    return groups_of(
        kv_cache_config,
        vllm_config.cache_config.block_size,
        par.tensor_parallel_size,
        _n_groups(vllm_config.model_config),
    )


N_GROUPS_KEYS = ("n_groups", "mamba_n_groups", "mamba_ngroups", "ngroups")
"""Where model configs name Mamba2's B/C group count."""


def _n_groups(model_config: Any) -> int | None:
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    for key in N_GROUPS_KEYS:
        v = getattr(hf, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _split(spec: MambaSpec, tp_size: int, n_groups: int | None) -> tuple[TensorSplit, ...]:
    """How ``spec``'s state splits over TP (``state.splits``); empty (and logged) when
    unknown: the state then pairs only with an equal TP size."""
    if spec.tp_replicated:
        return ()
    got = splits(
        spec.mamba_type.name,
        spec.shapes,
        [torch.tensor([], dtype=d).element_size() for d in spec.dtypes],
        conv_ds=is_conv_state_dim_first(),
        tp_size=tp_size,
        n_groups=n_groups,
    )
    if isinstance(got, str):
        log.warning("pdxfer: state moves whole (equal TP sizes only): %s", got)
        return ()
    return got


def groups_of(
    kv_cache_config: KVCacheConfig | None,
    block_size: int,
    tp_size: int = 1,
    n_groups: int | None = None,
) -> tuple[Group, ...]:
    """vLLM's transfer groups as pdxfer ``Group``s (``groups.py``); a kind pdxfer cannot
    move is refused, naming it. ``tp_size``, ``n_groups``: how a state splits over TP."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return (Group(0, "full", block_size, ()),)
    out = []
    for i, g in enumerate(kv_cache_config.transfer_groups):
        spec, layers = g.kv_cache_spec, tuple(g.layer_names)
        if isinstance(spec, SlidingWindowSpec) and not isinstance(spec, MLAAttentionSpec):
            out.append(Group(i, "window", spec.block_size, layers, window=spec.sliding_window))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(Group(i, "chunk", spec.block_size, layers, chunk=spec.attention_chunk_size))
        elif isinstance(spec, FullAttentionSpec) and type(spec) in (
            FullAttentionSpec,
            MLAAttentionSpec,
        ):
            out.append(
                Group(i, "full", spec.block_size, layers, mla=isinstance(spec, MLAAttentionSpec))
            )
        elif isinstance(spec, MambaSpec) and spec.mamba_cache_mode in ("none", "align"):
            out.append(
                Group(
                    i,
                    "state",
                    spec.block_size,
                    layers,
                    spec_blocks=spec.num_speculative_blocks,
                    page_bytes=spec.page_size_bytes,
                    split=_split(spec, tp_size, n_groups),
                    replicated=spec.tp_replicated,
                )
            )
        else:
            what = (
                f"mamba_cache_mode={spec.mamba_cache_mode}"
                if isinstance(spec, MambaSpec)
                else type(spec).__name__
            )
            raise ConfigError(
                f"PdxferConnector cannot move KV cache group {i} "
                f"({what}, layers {', '.join(layers[:3])}...)"
            )
    return tuple(out)


def data_parallel(vllm_config: VllmConfig) -> tuple[int, int]:
    """This engine core's (DP rank, DP size). vLLM runs each DP rank of a dense model as an
    independent engine and resets its ``data_parallel_rank``/``_size`` to 0 and 1 there; the
    rank stays in ``data_parallel_index`` and the size in ``elastic_ep_max_dp_size`` (the DP
    size given at start unless elastic EP is on, which keeps the DP fields as they are). The
    rank is what vLLM's own connectors name a DP rank by (its ports, ``engine_id``)."""
    par = vllm_config.parallel_config
    rank = int(getattr(par, "data_parallel_index", par.data_parallel_rank) or 0)
    size = int(par.data_parallel_size or 1)
    if size == 1 and not getattr(par, "enable_elastic_ep", False):
        size = int(getattr(par, "elastic_ep_max_dp_size", None) or 1)
    if not 0 <= rank < size:
        raise ConfigError(
            f"PdxferConnector: data-parallel rank {rank} is not in [0, {size}) "
            f"(vLLM's data_parallel_index, data_parallel_size)"
        )
    return rank, size


def _tp(vllm_config: VllmConfig) -> tuple[int, int]:
    """This worker's (TP rank, TP size); outside a started worker (no process group yet,
    as in a conformance test) only TP 1 is possible."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    size = vllm_config.parallel_config.tensor_parallel_size
    if size != 1:
        raise ConfigError(f"TP size {size} but vLLM's process groups are not initialized")
    return 0, 1


class PdxferConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that moves KV with pdxfer (see ``pdxfer/integrations/vllm``)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        mc = vllm_config.model_config
        self.groups = check_compatible(vllm_config, kv_cache_config)
        name = mc.served_model_name if mc is not None else ""
        if isinstance(name, list):
            name = name[0] if name else ""
        dp_rank, dp_size = data_parallel(vllm_config)
        self.cfg = replace(
            C.parse(
                ktc.kv_role,
                ktc.kv_connector_extra_config,
                str(name or ""),
                mc.revision if mc is not None else None,
            ),
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
        block_size = vllm_config.cache_config.block_size
        self.scheduler: PdxferScheduler | None = None
        self.worker: PdxferWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = PdxferScheduler(self.cfg, block_size, self.groups)
            if kv_cache_config is not None:
                self.scheduler.select = kv_cache_config.select_transfer_block_ids
        else:
            kv_heads = mc.get_total_num_kv_heads() if mc is not None else 1
            cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
            self.worker = PdxferWorker(
                self.cfg,
                RankInfo(
                    *_tp(vllm_config),
                    block_size,
                    kv_heads,
                    cache_dtype,
                    draft_id(vllm_config.speculative_config),
                ),
                self.groups,
            )
            self.worker.interior = tiles.interior(
                vllm_config.compilation_config.static_forward_context,
                mc.dtype if mc is not None else None,
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Head-major blocks, one layer at a time (``LBHNC``): every block of a layer is one
        span and heads are addressable, so TP sizes may differ between the two sides."""
        mc = vllm_config.model_config
        return None if mc is None or mc.use_mla else "LBHNC"

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, tuple(block_ids))

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def _step(self) -> tuple[PdxferWorker, PdxferMetadata] | None:
        """On a worker, the worker and this step's orders."""
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, PdxferMetadata):
                return self.worker, meta
        return None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if step := self._step():
            worker, meta = step
            worker.run_orders(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # loads are asynchronous (vLLM schedules a request once its KV arrived); the first
        # layer of a step is the last moment before the forward writes blocks vLLM freed
        if step := self._step():
            worker, meta = step
            worker.before_forward(meta)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # send_by "layer": the layer's part of this step's tokens goes to the sender now (a
        # hand-off); a layer never reported here (a CUDA graph replay skips this call) is
        # handed over after the step (wait_for_save)
        if step := self._step():
            worker, meta = step
            if meta.layers:
                worker.save_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        # waits for nothing on the network: a finished request's blocks stay with the sender
        # until get_finished reports it (request_finished returned True), and a preempted
        # one's writes drain before the next forward (before_forward); only device-computed
        # layers not yet handed over are waited for (their kernels' events)
        if step := self._step():
            worker, meta = step
            worker.after_forward(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        sending, recving = self.worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Sends and loads that ended; a hybrid model's failed loads as request ids (vLLM
        refuses block-level load errors when it has several KV cache groups)."""
        assert self.worker is not None
        sending, recving = self.worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=self.worker.failed_loads(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # -- metrics (``stats.py``) ----------------------------------------------------------------
    def get_kv_connector_stats(self) -> PdxferStats | None:
        data = (
            self.worker.take_interval()
            if self.worker is not None
            else self.scheduler.take_interval()
            if self.scheduler is not None
            else None
        )
        return PdxferStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdxferStats:
        return PdxferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PdxferPromMetrics:
        return PdxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
