"""The connector's scheduler side: decides, per request, what the workers move.

Prefill (``kv_producer``): a request with ``do_remote_decode`` keeps its blocks when it
finishes (``request_finished`` returns True and the room's answer); the next step's metadata
tells the workers to send them. vLLM frees them when every worker reported the request in
``finished_sending``.

Decode (``kv_consumer``): a request carrying a prefill's answer loads every prompt token
that vLLM's own prefix cache does not hold, asynchronously (``get_num_new_matched_tokens``);
vLLM recomputes the last prompt token itself to sample the first output token. Which part
of the load comes from the decode's L2/L3 and which crosses the network is the worker's
business: the tiers live where the memory is (one cache per rank), and the scheduler only
promises the whole remote prefix. With tiers, a finished request's blocks are held one more
step while the workers write them back to L2.

A request is loaded at most once: after a failed load vLLM recomputes (or fails) it, per
``kv_load_failure_policy``, and it is never asked for again.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from . import params as P
from .config import ConnectorConfig
from .metadata import LoadOrder, PdxferMetadata, SendOrder, WritebackOrder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("pdxfer.integrations.vllm")

DONE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
"""A request that ended this way has the KV of every token it computed."""

ANSWER_FIRST_S = 0.0005
"""How long the step after a prefill finished requests lets other threads run first. Their
answers (``kv_transfer_params``) are then being encoded and sent by the engine core's output
thread, and the router waits for them; the step exists only because the prefill holds the
blocks for the send, and without a pause its Python work (scheduling, the send orders) kept
the GIL from the output thread for its whole length (``docs/performance.md``, the prefill
leg: ~13 ms more from the engine to the API server than colocated, on a loaded host)."""


class PdxferScheduler:
    def __init__(self, cfg: ConnectorConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.tiers = cfg.l2_pages > 0
        self._sends: list[SendOrder] = []
        self._loads: list[LoadOrder] = []
        self._writebacks: list[WritebackOrder] = []
        self._asked: set[str] = set()
        """Decode requests whose load was ordered (never ordered twice)."""

    # -- decode --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if self.cfg.side != "decode" or request.request_id in self._asked:
            return 0, False
        ask = P.decode_ask(request.kv_transfer_params)
        if ask is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self.cfg.side != "decode" or num_external_tokens <= 0 \
                or request.request_id in self._asked:
            return
        ask = P.decode_ask(request.kv_transfer_params)
        if ask is None:
            return
        prompt = list(request.prompt_token_ids or ())
        n = len(prompt)
        (block_ids, *_) = blocks.get_block_ids()
        self._asked.add(request.request_id)
        self._loads.append(LoadOrder(
            req_id=request.request_id, room=ask.room, bootstrap=ask.bootstrap,
            instance=ask.instance, block_ids=tuple(block_ids), l1_len=n - num_external_tokens,
            num_tokens=n, tokens=tuple(prompt) if self.tiers else (),
            scope=request.cache_salt or ""))

    # -- both ----------------------------------------------------------------------------------
    def build_connector_meta(self) -> PdxferMetadata:
        meta = PdxferMetadata(self._sends, self._loads, self._writebacks)
        self._sends, self._loads, self._writebacks = [], [], []
        if meta.sends:
            time.sleep(ANSWER_FIRST_S)  # the answers of the requests to send go out first
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self.cfg.side == "prefill":
            return self._prefill_finished(request, block_ids)
        return self._decode_finished(request, block_ids)

    def _prefill_finished(self, request: Request, block_ids: list[int]
                          ) -> tuple[bool, dict[str, Any] | None]:
        ask = P.prefill_ask(request.kv_transfer_params)
        if ask is None:
            return False, None
        n = len(request.prompt_token_ids or ())
        need = -(-n // self.block_size)
        if request.status not in DONE or n == 0 or len(block_ids) < need:
            # aborted before its prefill was done: nothing to send, the blocks go back now
            log.info("request %s ended (%s) before its KV could be sent", request.request_id,
                     request.status)
            return False, None
        self._sends.append(SendOrder(request.request_id, ask.room, ask.decode,
                                     tuple(block_ids[:need]), n))
        assert self.cfg.bootstrap is not None  # checked in config for a prefill
        return True, P.prefill_answer(ask.room, self.cfg.bootstrap, self.cfg.instance, n)

    def _decode_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._asked.discard(rid)
        # a request that ended normally holds right KV for every computed token, also after
        # a failed load (vLLM recomputed it); with kv_load_failure_policy 'fail', or when it
        # was aborted while its load ran, it did not end normally
        if not self.tiers or request.status not in DONE:
            return False, None
        n = min(request.num_computed_tokens, len(request.all_token_ids))
        full = n // self.block_size
        if full == 0 or len(block_ids) < full:
            return False, None
        tokens = tuple(request.all_token_ids[:full * self.block_size])
        self._writebacks.append(WritebackOrder(rid, tokens, tuple(block_ids[:full]),
                                               request.cache_salt or ""))
        return True, None
