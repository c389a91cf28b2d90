"""The connector's scheduler side: decides, per request, what the workers move.

Prefill (``kv_producer``): a request's room is expected from its arrival and opened when
vLLM schedules it, so a decode that asks early is attached; each step hands the sender what
the step computed (``send_by``: per layer, per step's full blocks, or the whole request at
its end); a finished request keeps its blocks until every worker reports its send over.
A hybrid model (``groups.py``) streams by layer (``send_by: layer``: full groups, and the
window's blocks no step frees) and sends the rest (Mamba state) at the request's end; with
another ``send_by`` it sends every group once, at the end.

Decode (``kv_consumer``): a request carrying a prefill's answer loads every prompt token
vLLM's prefix cache does not hold, asynchronously; the workers decide what comes from L2/L3
and what crosses the network. A request is loaded at most once: after a failed load vLLM
recomputes (or fails) it per ``kv_load_failure_policy``. Failure rules:
docs/failure-semantics.md; the protocol: ``params.py``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from . import params as P
from .config import ConnectorConfig
from .groups import LOCAL, Group, backoff, prefill_backoff, streams, tiered
from .metadata import (
    AbortOrder,
    ExpectOrder,
    LayerOrder,
    LoadOrder,
    OpenOrder,
    PdxferMetadata,
    SendOrder,
    WritebackOrder,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

DONE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
"""A request that ended this way has the KV of every token it computed."""

ANSWER_FIRST_S = 0.0005
"""How long the step after a prefill finished requests lets other threads run first: the
engine core's output thread then sends their answers, which the router waits for, instead
of waiting out this step's Python work for the GIL
(docs/performance-history.md#the-vllm-prefill-leg-stamp-by-stamp-2026-11-26)."""


@dataclass(slots=True)
class Streamed:
    """A prefill request with a room: what its workers were told so far."""

    room: int
    peer: str | None
    num_tokens: int
    """Prompt tokens (the KV the decode gets)."""
    blocks: int = 0
    """Blocks handed to the sender (full ones, or all of them once ``last``; with ``send_by:
    layer``, every block holding a handed token)."""
    tokens: int = 0
    """Tokens handed to the sender (``send_by: layer``)."""
    last: bool = False
    dropped: bool = False
    """Preempted: its room was aborted (a resumed request is not sent again)."""


class PdxferScheduler:
    def __init__(
        self, cfg: ConnectorConfig, block_size: int, groups: tuple[Group, ...] = ()
    ) -> None:
        self.cfg = cfg
        self.groups = groups or (Group(0, "full", block_size, ()),)
        self.block_size = self.groups[0].block_size
        self.hybrid = not streams(self.groups)
        """More than one group, or one that is not full attention: the worker clips every
        group (``groups.py``); what was not streamed goes in one send at the request's end."""
        self.hybrid_layers = self.hybrid and cfg.send_by == "layer"
        """A hybrid model streaming by layer (its state groups still go at the end)."""
        self.backs_off = any(g.kind in ("state", *LOCAL) for g in self.groups)
        """Whether some prompts leave tokens to the decode (``groups.backoff``; the
        prefill's never more than a decode's, ``groups.prefill_backoff``)."""
        self.select: Any = None
        """vLLM's ``select_transfer_block_ids`` (every group's blocks -> the transfer
        groups'), set by the connector where vLLM has groups it does not transfer."""
        self.tiered = tiered(self.groups)
        """The groups decode-side tiers restore and keep (``groups.tiered``)."""
        self.tiers = cfg.l2_pages > 0 and bool(self.tiered)
        self.streams: dict[str, Streamed] = {}
        """Prefill requests by id, from scheduling to ``request_finished``."""
        self._opens: list[OpenOrder] = []
        self._expects: list[ExpectOrder] = []
        self.queued: dict[str, int] = {}
        """Prefill requests with a router-chosen room, from arrival (``on_new_request``) to
        scheduling: their rooms are expected by the workers (withdrawn if they end first)."""
        self._aborts: list[AbortOrder] = []
        self._sends: list[SendOrder] = []
        self._loads: list[LoadOrder] = []
        self._writebacks: list[WritebackOrder] = []
        self._asked: set[str] = set()
        """Decode requests whose load was ordered (never ordered twice)."""
        self._refused: set[str] = set()
        """Decode requests refused for naming an untrusted bootstrap (counted once)."""
        self._interval: dict[str, int] = {}
        """Counters since vLLM last asked (``take_interval``; ``stats.COUNTERS``)."""
        self.pace = cfg.step_pace_s
        """Seconds each step that schedules work is held (``step_pace_s``; 0 in service)."""

    def _decode_ask(self, request: Request) -> P.DecodeAsk | None:
        """The request's load, if it asks for one from a bootstrap this decode trusts. A
        request naming another is served as if it had no pdxfer params: refused before any
        connection, logged and counted (``untrusted_refused``)."""
        ask = P.decode_ask(request.kv_transfer_params)
        if ask is None or ask.bootstrap in self.cfg.trusted:
            return ask
        if request.request_id not in self._refused:
            self._refused.add(request.request_id)
            self._interval["untrusted_refused"] = self._interval.get("untrusted_refused", 0) + 1
            log.warning(
                "request %s names bootstrap %s, which this decode does not trust "
                "(kv_connector_extra_config.bootstrap: %s): served without pdxfer",
                request.request_id,
                ask.bootstrap,
                ", ".join(self.cfg.trusted),
            )
        return None

    def take_interval(self) -> dict[str, int]:
        """The scheduler's counters since the last call (vLLM aggregates them with the
        workers' per-step stats)."""
        out, self._interval = self._interval, {}
        return out

    # -- decode --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.cfg.side != "decode" or request.request_id in self._asked:
            return 0, False
        ask = self._decode_ask(request)
        if ask is None:
            return 0, False
        n = len(request.prompt_token_ids or ())
        count = n - backoff(self.groups, n) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.cfg.side == "prefill":
            self._scheduled(request)
            return
        if num_external_tokens <= 0 or request.request_id in self._asked:
            return
        ask = self._decode_ask(request)
        if ask is None:
            return
        prompt = list(request.prompt_token_ids or ())
        n = len(prompt) - backoff(self.groups, len(prompt))
        every = self._transfer(blocks.get_block_ids())
        self._asked.add(request.request_id)
        self._loads.append(
            LoadOrder(
                req_id=request.request_id,
                room=ask.room,
                bootstrap=ask.bootstrap,
                instance=ask.instance,
                block_ids=tuple(every[0]),
                l1_len=n - num_external_tokens,
                num_tokens=n,
                tokens=tuple(prompt[:n]) if self.tiers else (),
                scope=tier_scope(request),
                early=ask.early,
                groups=tuple(tuple(b) for b in every) if self.hybrid else (),
                dp=ask.dp,
            )
        )

    # -- prefill -------------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """A request arrived (queued, not scheduled yet): a decode dispatched at the same time
        asks for its room at once, and the room opens only at scheduling, which may be long
        after the prefill's ``room_grace_s``. So the workers expect the room now. A request
        without a room of its own has nothing to expect: its room is drawn at scheduling,
        and no decode can know it before the answer."""
        if self.cfg.side != "prefill":
            return
        params = request.kv_transfer_params
        if self.backs_off and isinstance(params, dict) and P.prefill_ask(params) is not None:
            self._back_off(request)
        if not isinstance(params, dict) or params.get("pdxfer_room") is None:
            return
        ask = P.prefill_ask(params)
        if ask is None or not request.prompt_token_ids:
            return
        self.queued[request.request_id] = ask.room
        self._expects.append(ExpectOrder(request.request_id, ask.room, ask.decode))

    def _transfer(self, every: Any) -> tuple[Any, ...]:
        """Every KV cache group's block ids -> the transfer groups' (vLLM may have groups it
        does not transfer, e.g. a draft model's)."""
        if self.select is not None and len(every) != len(self.groups):
            every = self.select(every)
        return tuple(every)

    def _back_off(self, request: Request) -> None:
        """A model with state groups, or a chunk group's prompt ending on a chunk boundary:
        the prefill computes all but the last ``prefill_backoff`` prompt tokens and the decode computes them (a state must not see
        a token twice; ``groups.backoff``)."""
        params = request.kv_transfer_params
        k = prefill_backoff(self.groups, request.num_prompt_tokens)
        if (
            not k
            or not isinstance(params, dict)
            or params.get("_pdxfer_backed_off")
            or request.num_prompt_tokens <= k
            or request.prompt_token_ids is None
        ):
            return
        del request.prompt_token_ids[-k:]
        if request._all_token_ids is not request.prompt_token_ids:
            del request._all_token_ids[-k:]
        request.num_prompt_tokens -= k
        request.max_tokens = 1
        params["_pdxfer_backed_off"] = True

    def _scheduled(self, request: Request) -> None:
        """A request starts running (or resumes after a preemption): open its room."""
        rid = request.request_id
        self.queued.pop(rid, None)  # opening it ends the expectation
        if rid in self.streams:
            return  # resumed: its room was aborted at the preemption
        ask = P.prefill_ask(request.kv_transfer_params)
        n = len(request.prompt_token_ids or ())
        if ask is None or n == 0:
            return
        if ask.dp is not None and ask.dp != self.cfg.dp_rank:
            log.warning(
                "request %s (room %d) was meant for data-parallel rank %d but runs on rank "
                "%d: a decode told to load from rank %d will not find it (is vLLM's "
                "X-data-parallel-rank header reaching the server?)",
                rid,
                ask.room,
                ask.dp,
                self.cfg.dp_rank,
                ask.dp,
            )
        self.streams[rid] = Streamed(
            ask.room, ask.decode, n, last=self.hybrid and not self.hybrid_layers
        )
        self._opens.append(OpenOrder(rid, ask.room, ask.decode))

    def _step_chunks(self, so: SchedulerOutput) -> tuple[list[SendOrder], list[LayerOrder]]:
        """What this step computes of each streamed request: per layer, the tokens it computes
        (``send_by: layer``); else the blocks it fills, or, when it reaches the prompt's end,
        all of them (the partial last one too)."""
        out: list[SendOrder] = []
        lay: list[LayerOrder] = []
        for rid in so.preempted_req_ids or ():
            st = self.streams.get(rid)
            if st is not None and not st.dropped:
                st.dropped = True
                self._aborts.append(AbortOrder(rid, held=False))
        state = getattr(so, "kv_connector_block_state", None)
        if state is None:
            return out, lay  # this vLLM does not say which blocks: whole requests at the end
        before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        bs, mode = self.block_size, self.cfg.send_by
        for rid, k in so.num_scheduled_tokens.items():
            st = self.streams.get(rid)
            if st is None or st.dropped or st.last or rid not in before:
                continue
            end = min(before[rid] + k, st.num_tokens)
            last = end >= st.num_tokens
            ids = state.get_block_ids(rid)
            if self.hybrid_layers:
                o = hybrid_order(rid, st, end, self._transfer(ids) if ids else None, self.groups)
                if o is not None:
                    lay.append(o)
                    st.tokens, st.blocks, st.last = end, -(-end // bs), last
                continue
            if mode == "layer":
                o = layer_order(rid, st, end, ids[0] if ids else None, bs)
                if o is not None:
                    lay.append(o)
                    st.tokens, st.blocks, st.last = end, -(-end // bs), last
                continue
            n_blocks = -(-st.num_tokens // bs) if last else end // bs
            if not last and (n_blocks <= st.blocks or mode == "request"):
                continue
            if ids is None or len(ids[0]) < n_blocks:
                continue  # not ours to read: the end of the request sends it
            out.append(
                SendOrder(
                    rid,
                    st.room,
                    st.peer,
                    tuple(ids[0][:n_blocks]),
                    st.num_tokens if last else n_blocks * bs,
                    last=last,
                )
            )
            st.blocks, st.last = n_blocks, last
        return out, lay

    def _unpad_first_steps(self, so: SchedulerOutput) -> None:
        """A loaded request's first step computes its last prompt token alone; vLLM pads it
        with placeholder drafts (``-1``, for a uniform batch shape), which are verified,
        rejected and counted as drafts. Colocated, the same step is part of the prefill and
        has none. The step is scheduled without them, so the decode's drafts, and its
        acceptance counters, are what colocated vLLM's are (the drafter proposes after the
        step from the draft KV this load brought)."""
        spec = so.scheduled_spec_decode_tokens
        for r in so.scheduled_new_reqs:
            drafts = spec.get(r.req_id)
            if (
                r.req_id not in self._asked
                or not drafts
                or any(t >= 0 for t in drafts)
                or so.num_scheduled_tokens.get(r.req_id) != 1 + len(drafts)
            ):
                continue
            del spec[r.req_id]
            so.num_scheduled_tokens[r.req_id] = 1
            so.total_num_scheduled_tokens -= len(drafts)

    def _count_prompt_steps(self, so: SchedulerOutput) -> None:
        """Count the requests to send whose prompt this step computes part of
        (``prompt_steps``): how vLLM chunked them, which it decides (for MLA on a CPU
        without AMX it does not chunk at all)."""
        before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        n = sum(
            1
            for rid in so.num_scheduled_tokens
            if (st := self.streams.get(rid)) is not None
            and before.get(rid, st.num_tokens) < st.num_tokens
        )
        if n:
            self._interval["prompt_steps"] = self._interval.get("prompt_steps", 0) + n

    # -- both ----------------------------------------------------------------------------------
    def build_connector_meta(self, so: SchedulerOutput | None = None) -> PdxferMetadata:
        if (
            so is not None
            and self.cfg.side == "decode"
            and getattr(so, "scheduled_spec_decode_tokens", None)
        ):
            self._unpad_first_steps(so)
        if so is not None and self.streams:
            self._count_prompt_steps(so)
        chunks, lay = self._step_chunks(so) if so is not None and self.streams else ([], [])
        meta = PdxferMetadata(
            self._sends,
            self._loads,
            self._writebacks,
            self._opens,
            chunks,
            self._aborts,
            self._expects,
            lay,
            idle=so is not None and not so.total_num_scheduled_tokens,
        )
        self._sends, self._loads, self._writebacks = [], [], []
        self._opens, self._aborts, self._expects = [], [], []
        if meta.sends:
            time.sleep(ANSWER_FIRST_S)  # the answers of the requests to send go out first
        if self.pace and so is not None and so.total_num_scheduled_tokens:
            time.sleep(self.pace)
        return meta

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...] | list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: one list per transfer group (vLLM's ``SupportsHMA`` form), or
        one group's list."""
        flat = bool(block_ids) and not isinstance(block_ids[0], (list, tuple))
        every = self._transfer((list(block_ids),) if flat else block_ids)
        if self.cfg.side == "prefill":
            return self._prefill_finished(request, every)
        return self._decode_finished(request, every)

    def _prefill_finished(
        self, request: Request, every: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        block_ids = list(every[0]) if every else []
        rid = request.request_id
        st = self.streams.pop(rid, None)
        if self.queued.pop(rid, None) is not None:
            # ended while queued: its expected room is withdrawn (a waiting decode fails now)
            self._aborts.append(AbortOrder(rid, held=True))
            return False, None
        if st is None:
            return False, None  # no remote decode asked for (or no prompt)
        n = st.num_tokens
        assert self.cfg.bootstrap is not None  # checked in config for a prefill
        answer = P.prefill_answer(
            st.room, self.cfg.bootstrap, self.cfg.instance, n, self.cfg.dp_rank
        )
        if st.dropped:  # preempted: its room was aborted, a decode that asks is refused
            return False, answer
        need = -(-n // self.block_size)
        short = any(
            len(ids) < -(-n // g.block_size)
            for g, ids in zip(self.groups, every)
            if g.kind != "state"
        )
        if request.status not in DONE or short:
            # aborted before its prefill was done: the room ends; blocks some of which were
            # handed to the sender are kept until no write reads them
            held = st.blocks > 0
            log.info("request %s ended (%s) before its KV could be sent", rid, request.status)
            self._aborts.append(AbortOrder(rid, held=held))
            return held, None
        if self.hybrid:
            self._sends.append(
                SendOrder(
                    rid,
                    st.room,
                    st.peer,
                    tuple(block_ids[:need]),
                    n,
                    groups=tuple(tuple(ids) for ids in every),
                )
            )
        elif not st.last:
            self._sends.append(SendOrder(rid, st.room, st.peer, tuple(block_ids[:need]), n))
        else:
            self._sends.append(SendOrder(rid, st.room, st.peer, (), n))  # already all handed
        return True, answer

    def _decode_finished(
        self, request: Request, every: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._asked.discard(rid)
        self._refused.discard(rid)
        # a request that ended normally holds right KV for every computed token, also after
        # a failed load (vLLM recomputed it); with kv_load_failure_policy 'fail', or when it
        # was aborted while its load ran, it did not end normally
        if not self.tiers or request.status not in DONE:
            return False, None
        n = min(request.num_computed_tokens, len(request.all_token_ids))
        bs = self.tiered[0].block_size
        full = n // bs
        if (
            full == 0
            or any(len(every[g.index]) < full for g in self.tiered if g.index < len(every))
            or len(every) < len(self.groups)
        ):
            return False, None
        tokens = tuple(request.all_token_ids[: full * bs])
        kept = (
            tuple(tuple(every[g.index][:full]) if g in self.tiered else () for g in self.groups)
            if self.hybrid
            else ()
        )
        self._writebacks.append(
            WritebackOrder(rid, tokens, tuple(every[0][:full]), tier_scope(request), groups=kept)
        )
        return True, None


def tier_scope(request: Request) -> str:
    """What L2/L3 page keys are scoped by besides the token ids: the tenant (vLLM's
    ``cache_salt``) and, for a prompt with images, each image's content hash and place. An
    image's tokens are one placeholder id repeated, whatever the image: keyed by ids alone,
    a prompt's pages would restore the KV of another image shown with the same text."""
    salt = request.cache_salt or ""
    mm = getattr(request, "mm_features", None)
    if not mm:
        return salt
    h = hashlib.sha256()
    for f in mm:
        pos = f.mm_position
        h.update(f"{f.modality}|{f.identifier}|{pos.offset}|{pos.length}\n".encode())
    return f"{salt}|mm:{h.hexdigest()[:32]}"


def layer_order(
    rid: str, st: Streamed, end: int, block_ids: list[int] | None, bs: int
) -> LayerOrder | None:
    """The tokens ``[st.tokens, end)`` a step computes (with a prefix vLLM had cached, the
    first step's start at 0), in the blocks that hold them; None when there is nothing new or
    the blocks are not known (the end of the request then sends what is left)."""
    if end <= st.tokens or block_ids is None:
        return None
    first, stop = st.tokens // bs, -(-end // bs)
    if len(block_ids) < stop:
        return None
    return LayerOrder(
        rid, st.room, st.peer, tuple(block_ids[first:stop]), st.tokens, end, end >= st.num_tokens
    )


def hybrid_order(
    rid: str, st: Streamed, end: int, every: tuple[Any, ...] | None, groups: tuple[Group, ...]
) -> LayerOrder | None:
    """``layer_order`` for a hybrid model: each group's blocks up to ``end`` (a state group's
    none: its state goes at the request's end); None when there is nothing new or a group's
    blocks are not known."""
    if end <= st.tokens or every is None or len(every) != len(groups):
        return None
    out: list[tuple[int, ...]] = []
    for g, ids in zip(groups, every):
        if g.kind == "state":
            out.append(())
            continue
        stop = -(-end // g.block_size)
        if len(ids) < stop:
            return None
        out.append(tuple(ids[:stop]))
    return LayerOrder(
        rid,
        st.room,
        st.peer,
        (),
        st.tokens,
        end,
        end >= st.num_tokens,
        groups=tuple(out),
        num_tokens=st.num_tokens,
    )
