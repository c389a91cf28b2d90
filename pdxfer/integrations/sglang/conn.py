"""SGLang's four transfer-backend roles on pdxfer: manager, sender, receiver, bootstrap server.

Each class subclasses SGLang's own ``CommonKV*`` class, so every attribute SGLang's queues
use keeps SGLang's meaning; what moves the bytes and says when they arrived is pdxfer (one
``Endpoint`` per rank, a ``KVSender``/``KVReceiver`` per request). SGLang's bootstrap server
stays in front (the router's address, ``/route`` for SGLang's schedulers); pdxfer's
``BootstrapServer`` runs behind it in the same process, announced at ``GET /pdxfer`` with the
prefill's KV head geometry. ``KVPoll`` is pdxfer's state: a decode reports ``Failed`` only
once no write can land in its pages, so SGLang may free them at once, and
``failure_exception()`` raises SGLang's ``KVTransferError`` chained to pdxfer's typed error.
SGLang's prefill sends only pages past ``decode_prefix_len``; pdxfer counts from token 0, so
the prefix goes as pages never read. SGLang's SWA pool moves in a second room per request
(``window.py``). A decode whose ``KVArgs`` name host buffers gets a second endpoint over them
(``send_metadata(destination=HOST)``). Guide: docs/sglang.md.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Literal

import numpy as np
from aiohttp import web
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.utils.network import NetworkAddress

from pdxfer import (
    BootstrapError,
    BootstrapServer,
    ConfigError,
    Endpoint,
    EndpointConfig,
    KVReceiver,
    KVSender,
    Limits,
    PdxferError,
    trusted_bootstrap,
    trusted_from_env,
)
from pdxfer import KVPoll as PdxPoll

from .pools import KV, SWA, Heads, aux_slots, pools_of, state_slots, swa_state
from .window import UNREAD, mismatch, start_page, swa_pages, window_room

log = logging.getLogger(__name__)

INSTANCE = "sglang"
"""One SGLang bootstrap server fronts one prefill instance, so one pdxfer instance name."""
DISCOVERY = "/pdxfer"


def describe(err: BaseException | None) -> str:
    """A failure reason that names pdxfer's typed error (SGLang shows it to the client)."""
    if err is None:
        return "pdxfer: transfer failed"
    kind = getattr(err, "kind", "")
    return f"pdxfer {type(err).__name__}" + (f" ({kind})" if kind else "") + f": {err}"


# -- bootstrap ------------------------------------------------------------------------------


class PdxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server with pdxfer's behind it (see the module docstring)."""

    def __init__(self, host: str, port: int) -> None:
        self.pdxfer = BootstrapServer(host, 0).start()
        self.geometry: dict[str, Any] | None = None
        try:
            super().__init__(host, port)
        except BaseException:
            self.pdxfer.stop()
            raise

    def _setup_routes(self) -> None:
        super()._setup_routes()
        self.app.router.add_get(DISCOVERY, self._h_discover)
        self.app.router.add_put(DISCOVERY, self._h_geometry)

    async def _h_discover(self, request: web.Request) -> web.Response:
        return web.json_response({"port": self.pdxfer.port, "geometry": self.geometry})

    async def _h_geometry(self, request: web.Request) -> web.Response:
        """A prefill rank publishes its KV geometry (bytes per token, heads); every rank of
        one instance must agree."""
        try:
            g = _geometry(json.loads(await request.read() or b"null"))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        if self.geometry is not None and self.geometry != g:
            return web.json_response(
                {"error": f"geometry {g} differs from {self.geometry}"}, status=409
            )
        self.geometry = g
        return web.json_response({"ok": True})

    def close(self) -> None:
        super().close()
        self.pdxfer.stop()


def _geometry(body: Any) -> dict[str, Any]:
    """A published geometry, checked: small non-negative integers only."""
    if not isinstance(body, dict) or set(body) != {"token_bytes", "total_heads", "head_bytes"}:
        raise ValueError("geometry must have token_bytes, total_heads, head_bytes")
    for k, v in body.items():
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 1 << 32:
            raise ValueError(f"geometry {k} must be an integer in [0, 2^32]")
    return dict(body)


def _http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def discover(bootstrap_addr: str, tries: int = 1, delay: float = 0.5) -> dict[str, Any]:
    """pdxfer's bootstrap behind SGLang's at ``bootstrap_addr`` (``host:port``): its address
    and the prefill's published geometry."""
    url = f"http://{bootstrap_addr}{DISCOVERY}"
    for attempt in range(tries):
        try:
            body = _http("GET", url)
            port = int(body["port"])
            host = NetworkAddress.parse(bootstrap_addr).host
            return {
                "address": NetworkAddress(host, port).to_host_port_str(),
                "geometry": body.get("geometry"),
            }
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as e:
            last = e
            if attempt + 1 < tries:
                time.sleep(min(delay * 2**attempt, 5.0))
    raise BootstrapError(f"no pdxfer bootstrap behind SGLang's at {bootstrap_addr} ({url}): {last}")


# -- manager ---------------------------------------------------------------------------------


class PdxferKVManager(CommonKVManager):
    """One rank: SGLang's manager state, and one pdxfer ``Endpoint`` (the decode's is made
    on first contact with a prefill, when the KV head geometry is known)."""

    # pdxfer knows exactly when a failed request's pages can no longer be written
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.is_mla = bool(is_mla_backend)
        self.swa_index = swa_state(args)
        """Where SGLang's SWA pool sits in ``state_types`` (None: no sliding window)."""
        self.endpoint: Endpoint | None = None
        self.pools: list[Any] = []
        self.host_endpoint: Endpoint | None = None  # decode: over host_kv_data_* (if any)
        self.host_pools: list[Any] = []
        self.pdxfer_bootstrap: dict[str, str] = {}
        self.receivers: dict[int, PdxferKVReceiver] = {}
        self._ep_lock = threading.Lock()
        self.trusted: tuple[str, ...] = ()
        self.untrusted_refused = 0
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._start_prefill()
        else:  # a decode loads only from the SGLang bootstrap servers it was told to trust
            self.trusted = trusted_from_env(
                "PDXFER_TRUSTED_BOOTSTRAPS on the decode (the prefills' SGLang bootstrap servers)"
            )

    # -- configuration ----------------------------------------------------------------------
    def _config(
        self, role: Literal["prefill", "decode"], bootstrap: str | None = None
    ) -> EndpointConfig:
        dp_size = self.system_dp_size if self.system_dp_size > 1 else self.attn_dp_size
        dp_rank = self.system_dp_rank if self.system_dp_size > 1 else self.attn_dp_rank
        ib = getattr(self.kv_args, "ib_device", None) or ""
        return EndpointConfig(
            role=role,
            bootstrap=bootstrap,
            instance=INSTANCE,
            host=self.local_ip,
            tp_rank=self.attn_tp_rank,
            tp_size=self.attn_tp_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            pp_rank=self.pp_rank if role == "prefill" else 0,
            pp_size=self.pp_size if role == "prefill" else 1,
            transport="rdma" if ib else "auto",
            device=ib,
            limits=Limits(
                bootstrap_timeout_s=float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()),
                transfer_timeout_s=float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()),
            ),
        )

    def _location(self) -> str:
        gpu = getattr(self.kv_args, "gpu_id", None)
        try:
            import torch

            if gpu is not None and torch.cuda.is_available():
                return f"cuda:{int(gpu)}"
        except ImportError:  # pragma: no cover - SGLang always has torch
            pass
        return "cpu"

    def own_geometry(self) -> dict[str, int]:
        a = self.kv_args
        n_target = len(a.kv_item_lens) - int(getattr(a, "num_draft_entries", 0) or 0)
        token = int(a.kv_item_lens[0]) // int(a.page_size) if n_target else 0
        if self.is_mla:
            return {"token_bytes": token, "total_heads": 0, "head_bytes": 0}
        heads = int(a.kv_head_num)
        return {
            "token_bytes": token,
            "total_heads": int(a.total_kv_head_num),
            "head_bytes": token // heads,
        }

    def heads(self, geometry: dict[str, int]) -> Heads | None:
        if self.is_mla:
            return None
        a = self.kv_args
        hb = geometry["head_bytes"]
        rank_heads = int(getattr(a, "kv_head_num", 0) or 0) or None
        if rank_heads is None:  # a decode's KVArgs names no heads: from its bytes per token
            rank_heads = self._page_bytes_per_token(geometry) // hb
        return Heads.of_rank(
            geometry["total_heads"], rank_heads, hb, self.attn_tp_rank, self.attn_tp_size
        )

    def _page_bytes_per_token(self, geometry: dict[str, int]) -> int:
        """This rank's KV bytes per token. A decode that lands on a host pool (HiSparse) has
        items of fewer tokens than ``page_size``: its per-token size comes from the prefill's
        (MLA) or from the heads this rank holds (MHA)."""
        a = self.kv_args
        item = int(a.kv_item_lens[0])
        if self.is_mla:
            return geometry["token_bytes"]
        if getattr(a, "kv_head_num", None):
            return int(a.kv_head_num) * geometry["head_bytes"]
        tp = self.attn_tp_size
        rank_heads = max(1, geometry["total_heads"] // tp)
        per_token = rank_heads * geometry["head_bytes"]
        return per_token if item % per_token == 0 else item // int(a.page_size)

    def _start_prefill(self) -> None:
        front = self._front_bootstrap()
        found = discover(front, tries=8)
        geometry = self.own_geometry()
        try:
            _http("PUT", f"http://{front}{DISCOVERY}", geometry)
        except urllib.error.HTTPError as e:
            raise BootstrapError(
                f"SGLang bootstrap {front} refused this rank's KV geometry: "
                f"{e.read().decode(errors='replace')}"
            ) from None
        self.pools = pools_of(
            self.kv_args,
            is_mla=self.is_mla,
            heads=self.heads(geometry),
            location=self._location(),
            tp_rank=self.attn_tp_rank,
            tp_size=self.attn_tp_size,
        )
        self.endpoint = Endpoint(self._config("prefill", found["address"]), self.pools)

    def _front_bootstrap(self) -> str:
        """SGLang's bootstrap server, as ``register_to_bootstrap`` finds it."""
        if self.dist_init_addr:
            host = NetworkAddress.parse(self.dist_init_addr).resolved().host
        else:
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(
                self.bootstrap_host, self.bootstrap_host
            )
        return NetworkAddress(host, self.bootstrap_port).to_host_port_str()

    # -- decode ------------------------------------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's topology lookup, then pdxfer's bootstrap behind it (and, on first
        contact, this rank's pdxfer endpoint). A bootstrap this decode does not trust is
        refused before any connection (logged, counted in ``untrusted_refused``)."""
        if self.refuses(bootstrap_addr):  # its receivers are Failed already
            return False
        if not super().try_ensure_parallel_info(bootstrap_addr):
            return False
        if bootstrap_addr in self.pdxfer_bootstrap:
            return True
        try:
            found = discover(bootstrap_addr)
            geometry = found["geometry"]
            if geometry is None:
                raise BootstrapError(f"prefill behind {bootstrap_addr} published no KV geometry")
            self._ensure_decode_endpoint(_geometry(geometry))
        except (PdxferError, ValueError) as e:
            log.error("pdxfer bootstrap behind %s: %s", bootstrap_addr, e)
            self.prefill_info_table.pop(bootstrap_addr, None)  # ask again next time
            return False
        self.pdxfer_bootstrap[bootstrap_addr] = found["address"]
        return True

    def refuses(self, bootstrap_addr: str) -> str | None:
        """Why this decode will not load from ``bootstrap_addr`` (not trusted, or not a
        host:port), or None."""
        try:
            trusted_bootstrap(bootstrap_addr, self.trusted)
        except ConfigError as e:  # UntrustedBootstrap, or a malformed address
            return str(e)
        return None

    def _ensure_decode_endpoint(self, geometry: dict[str, int]) -> None:
        with self._ep_lock:
            if self.endpoint is not None:
                return
            per_token = self._page_bytes_per_token(geometry)
            item = int(self.kv_args.kv_item_lens[0])
            page = item // per_token if per_token and item % per_token == 0 else None
            host = page is not None and page != int(self.kv_args.page_size)
            heads = self.heads(geometry)
            self.pools = pools_of(
                self.kv_args,
                is_mla=self.is_mla,
                heads=heads,
                location="cpu" if host else self._location(),
                kv_page_size=page,
                tp_rank=self.attn_tp_rank,
                tp_size=self.attn_tp_size,
            )
            host_args = self._host_args()
            if host_args is not None:
                self.host_pools = pools_of(
                    host_args,
                    is_mla=self.is_mla,
                    heads=heads,
                    location="cpu",
                    kv_page_size=page,
                    tp_rank=self.attn_tp_rank,
                    tp_size=self.attn_tp_size,
                )
            self.endpoint = Endpoint(self._config("decode"), self.pools)
            if host_args is not None:
                self.host_endpoint = Endpoint(self._config("decode"), self.host_pools)

    @property
    def supports_host_destination(self) -> bool:
        """SGLang asks before it lands a request in host memory: yes when this rank's
        ``KVArgs`` name host KV buffers laid out as its device ones (one per KV buffer) and
        no request-scoped states (they would need host state buffers too)."""
        a = self.kv_args
        ptrs = getattr(a, "host_kv_data_ptrs", None) or []
        return (
            self.disaggregation_mode == DisaggregationMode.DECODE
            and bool(ptrs)
            and len(ptrs) == len(a.kv_data_ptrs)
            and len(getattr(a, "host_kv_data_lens", None) or []) == len(ptrs)
            and not getattr(a, "state_types", None)
        )

    def _host_args(self) -> KVArgs | None:
        """This rank's ``KVArgs`` with the host KV buffers in place of the device ones. SGLang
        hands host destinations out in the device's pages (``_pre_alloc_host``), so items
        keep the device's size; aux rows are the same buffers either way."""
        if not self.supports_host_destination:
            return None
        a = self.kv_args
        h = copy.copy(a)
        h.kv_data_ptrs = [int(x) for x in a.host_kv_data_ptrs]
        h.kv_data_lens = [int(x) for x in a.host_kv_data_lens]
        return h

    def kv_page_size(self, host: bool = False) -> int:
        return self.page_size(KV, host)

    def page_size(self, pool: str, host: bool = False) -> int:
        return next(
            p.page_size for p in (self.host_pools if host else self.pools) if p.name == pool
        )

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """SGLang's deferred release asks whether a held room's pages are safe: pdxfer's
        release has fired (every sender drained, or was declared dead)."""
        rx = self.receivers.get(bootstrap_room)
        return rx is None or rx.is_abort_release_safe()

    def teardown(self) -> None:
        """Release everything this rank holds: pdxfer's endpoints, and what SGLang's
        ``CommonKVManager`` opened (its ZMQ socket and context). SGLang's manager never closes
        them; left to the garbage collector, a context's finaliser can block forever on a
        socket collected in the same cycle, so a process that drops a manager would hang."""
        for ep in (self.endpoint, self.host_endpoint):
            if ep is not None:
                ep.close()
        self.endpoint = self.host_endpoint = None
        stop = getattr(self, "_heartbeat_shutdown", None)
        if stop is not None:
            stop.set()
        with self._socket_lock:
            for sock in [*self._socket_cache.values(), *self._monitor_cache.values()]:
                sock.close(linger=0)
            self._socket_cache.clear()
            self._monitor_cache.clear()
        self.server_socket.close(linger=0)
        self._zmq_ctx.destroy(linger=0)

    def close(self) -> None:
        self.teardown()


# -- sender ----------------------------------------------------------------------------------


class PdxferKVSender(CommonKVSender):
    """A prefill request: SGLang's chunk calls become pdxfer ``send()``s."""

    kv_mgr: PdxferKVManager
    _early_send_wait_event: Any
    """Set by SGLang's prefill: the event of the forward that writes an early send's pages."""

    def __init__(
        self,
        mgr: PdxferKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self.tx: KVSender | None = None
        self.swa_tx: KVSender | None = None  # the SWA pool's room (``window.py``)
        self._started = False
        self._pages = 0  # KV pages handed to pdxfer so far, the decode's prefix included
        self._swa: tuple[np.ndarray, int] | None = None  # SWA pages and their first page
        if self.conclude_state is None and mgr.endpoint is not None:
            # SGLang's prefill never learns which decode a room is for (the router tells
            # each side only the room and the prefill's bootstrap): nothing to bind to
            self.tx = mgr.endpoint.sender(int(bootstrap_room))
            if mgr.swa_index is not None:
                self.swa_tx = mgr.endpoint.sender(window_room(int(bootstrap_room)))

    def pop_decode_prefix_len(self) -> int:
        self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)
        return int(self.tx.prefix_len or 0) if self.tx is not None else 0

    def send(
        self,
        kv_indices: Any,
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        indices_event: Any = None,
    ) -> None:
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed) or self.tx is None:
            return
        kv_indices, _, is_last, skip = self._prepare_send_indices(kv_indices, state_indices)
        if skip:
            return
        for ev in (self._early_send_wait_event, indices_event):
            if ev is not None and hasattr(ev, "synchronize"):
                ev.synchronize()  # the forward that writes these pages has finished
        self._early_send_wait_event = None
        pages = np.asarray(getattr(kv_indices, "cpu", lambda: kv_indices)(), dtype=np.int64)
        try:
            if not self._started:
                self._started = True
                self._send_prefix(self.tx)
            slots: dict[str, int] = {}
            if is_last:
                slots = {
                    **aux_slots(self.kv_mgr.pools, self.aux_index),
                    **state_slots(self.kv_mgr.kv_args, state_indices),
                }
                if self.swa_tx is not None:
                    self._take_swa(state_indices, self._pages + pages.size)
            self.tx.send({KV: pages}, slots=slots, last=is_last)
            self._pages += pages.size
            self._flush_swa()
        except PdxferError as e:
            self._abort_rooms(str(e))
        self._record_transfer_indices(pages, state_indices if is_last else None)

    def _take_swa(self, state_indices: Any, total_pages: int) -> None:
        """The SWA pages SGLang gave with the last chunk: the window of the last prompt
        token, ending at the prompt's last page; a decode that asked for another window is
        refused before any KV of the last chunk goes."""
        swa = swa_pages(state_indices, self.kv_mgr.swa_index)
        if swa is None:
            raise ConfigError(
                f"room {self.bootstrap_room}: SGLang gave no SWA pages with the last chunk"
            )
        self._swa = (swa, start_page(total_pages, swa.size, self.bootstrap_room))
        self._check_window()

    def _check_window(self) -> bool:
        """Whether the decode's SWA request arrived (``PdxferError`` when it asks for a
        window that starts elsewhere than this prefill's)."""
        assert self.swa_tx is not None and self._swa is not None
        want = self.swa_tx.prefix_len
        if want is None:
            return False
        swa, start = self._swa
        ps = self.kv_mgr.page_size(SWA)
        if want != start * ps:
            raise ConfigError(mismatch(self.bootstrap_room, start, want, ps, start + swa.size))
        return True

    def _flush_swa(self) -> None:
        """Send the SWA room's pages once the decode's request for them is here (else the
        next ``poll()`` does): the window's pages after its first page's worth of unread ones."""
        if self._swa is None or self.swa_tx is None or not self._check_window():
            return
        swa, start = self._swa
        self._swa = None
        self.swa_tx.send(
            {SWA: np.concatenate((np.full(start, UNREAD, dtype=np.int64), swa))}, last=True
        )

    def _abort_rooms(self, why: str) -> None:
        for tx in (self.tx, self.swa_tx):
            if tx is not None:
                tx.abort(why)

    def _send_prefix(self, tx: KVSender) -> None:
        """Pages for the decode's prefix, which pdxfer skips: SGLang sends only the rest."""
        prefix = int(tx.prefix_len or 0)
        ps = self.kv_mgr.kv_page_size()
        if prefix % ps:
            raise PdxferError(
                f"room {self.bootstrap_room}: decode prefix {prefix} is not a "
                f"multiple of the prefill page size {ps}"
            )
        if prefix:
            tx.send({KV: np.zeros(prefix // ps, dtype=np.int64)})
            self._pages += prefix // ps

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        room = self.bootstrap_room
        if self.tx is None or self.kv_mgr.request_status.get(room) == KVPoll.Failed:
            self._conclude(KVPoll.Failed, None)
            return KVPoll.Failed
        state = self.tx.poll()
        if self.swa_tx is not None and state != PdxPoll.Failed:
            try:
                self._flush_swa()
            except PdxferError as e:
                self._abort_rooms(str(e))
            state = min(state, self.swa_tx.poll())
        if state == PdxPoll.Failed:
            failed = next(
                t for t in (self.tx, self.swa_tx) if t is not None and t.poll() == PdxPoll.Failed
            )
            self._abort_rooms(f"another room of request {room} failed")
            self._conclude(KVPoll.Failed, failed.failure)
            return KVPoll.Failed
        self.kv_mgr.update_status(room, int(state))
        if state == PdxPoll.Success:
            self._conclude(KVPoll.Success, None)
        return int(state)

    def _conclude(self, state: int, err: BaseException | None) -> None:
        if state == KVPoll.Failed:
            if err is not None or self.bootstrap_room not in self.kv_mgr.failure_records:
                self.kv_mgr.record_failure(self.bootstrap_room, describe(err))
            self._cause = err
        self.kv_mgr.update_status(self.bootstrap_room, state)
        self.conclude_state = state

    def failure_exception(self) -> None:
        cause = getattr(self, "_cause", None) or (self.tx.failure if self.tx else None)
        try:
            super().failure_exception()
        except KVTransferError as e:
            raise e from cause

    def abort(self) -> None:
        super().abort()
        self._abort_rooms("aborted by SGLang (AbortReq)")


# -- receiver --------------------------------------------------------------------------------


class PdxferKVReceiver(CommonKVReceiver):
    """A decode request: ``send_metadata`` becomes a pdxfer ``request()``."""

    kv_mgr: PdxferKVManager
    conclude_state: KVPoll | None

    def __init__(self, mgr: PdxferKVManager, bootstrap_addr: str, bootstrap_room: int) -> None:
        # SGLang's scheduler refuses a disaggregated request without a room (but the fake
        # backend's), so a pdxfer receiver always has one
        self.rx: KVReceiver | None = None
        self.swa_rx: KVReceiver | None = None  # the SWA pool's room (``window.py``)
        self._dp: int | None = None
        self._requested = False
        self._cause: BaseException | None = None
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        why = mgr.refuses(bootstrap_addr) if self.conclude_state is None else None
        if why is not None:  # before any connection: the request fails at once
            mgr.untrusted_refused += 1
            log.warning("room %s refused: %s", bootstrap_room, why)
            mgr.record_failure(bootstrap_room, f"pdxfer: {why}")
            mgr.update_status(bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
        if self.conclude_state is None:
            mgr.receivers[int(bootstrap_room)] = self

    @property
    def supports_host_destination(self) -> bool:
        return self.kv_mgr.supports_host_destination

    def init(self, prefill_dp_rank: int) -> None:
        if self.conclude_state == KVPoll.Failed:
            return
        if self.bootstrap_addr not in self.kv_mgr.pdxfer_bootstrap:
            self.kv_mgr.try_ensure_parallel_info(self.bootstrap_addr)
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed or self.kv_mgr.endpoint is None:
            return
        # WaitingForInput (SGLang's): send_metadata may come. pdxfer's receiver is made then,
        # on the endpoint of the destination it names; it looks the room up and pairs with
        # the prefill ranks once it has the request.
        self._dp = int(prefill_dp_rank)

    def _register_kv_args(self) -> bool:
        """pdxfer's ``Hello`` carries this rank's buffers; SGLang's REGISTER is not sent."""
        return self.bootstrap_infos is not None

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = KVTransferDestination.DEVICE,
        device_kv_indices: Any = None,
    ) -> None:
        host = destination == KVTransferDestination.HOST
        if not host and destination != KVTransferDestination.DEVICE:
            raise NotImplementedError(f"pdxfer: KV destination {destination!r}")
        if self.conclude_state == KVPoll.Failed:  # refused already: keep its reason
            return
        mgr = self.kv_mgr
        ep = mgr.host_endpoint if host else mgr.endpoint
        if self._dp is None or ep is None or self.rx is not None:
            why = (
                "a second send_metadata"
                if self.rx is not None
                else "this rank has no host KV buffers"
                if host and self._dp is not None
                else f"receiver was never initialised for {self.bootstrap_addr}"
            )
            mgr.record_failure(self.bootstrap_room, f"pdxfer: {why}")
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        prefix = int(decode_prefix_len or 0)
        ps = mgr.kv_page_size(host)
        n = prefix + pages.size * ps
        room = int(self.bootstrap_room)
        bootstrap = mgr.pdxfer_bootstrap[self.bootstrap_addr]
        try:
            swa = None
            if mgr.swa_index is not None:  # the window of the last prompt token
                swa = swa_pages(state_indices, mgr.swa_index)
                if swa is None:
                    raise ConfigError(f"room {room}: SGLang gave no SWA pages")
                sps = mgr.page_size(SWA)  # SGLang's page size (the KV's may be remapped)
                swa_start = start_page(-(-n // sps), swa.size, room) * sps
            self.rx = ep.receiver(room, bootstrap=bootstrap, dp=self._dp)
            if swa is not None:
                self.swa_rx = ep.receiver(window_room(room), bootstrap=bootstrap, dp=self._dp)
        except PdxferError as e:  # e.g. the room is still open on this rank: Failed, not raised
            if self.rx is not None:
                self.rx.abort(str(e))
            mgr.record_failure(self.bootstrap_room, describe(e))
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self._cause = e
            return
        slots = {**aux_slots(mgr.pools, aux_index), **state_slots(mgr.kv_args, state_indices)}
        self._requested = True
        try:
            self.rx.request({KV: pages}, slots=slots, prefix_len=prefix, num_tokens=n)
            if self.swa_rx is not None:
                self.swa_rx.request({SWA: swa}, prefix_len=swa_start, num_tokens=n)
        except PdxferError as e:  # the receiver is Failed with this reason; poll() says so
            log.info("room %s: request refused: %s", self.bootstrap_room, e)
        self.init_time = time.time()

    def _rooms(self) -> list[Any]:
        return [r for r in (self.rx, self.swa_rx) if r is not None]

    def is_abort_release_safe(self) -> bool:
        """No write can land in this request's pages any more."""
        return self.rx is None or not self._requested or all(r.released for r in self._rooms())

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.rx is None or not self._requested:
            return super().poll()
        room = self.bootstrap_room
        rooms = self._rooms()
        state = min(r.poll() for r in rooms)
        if state == PdxPoll.Failed or self.kv_mgr.request_status.get(room) == KVPoll.Failed:
            if self._cause is None:  # the first room's failure, before the others' aborts
                self._cause = next((r.failure for r in rooms if r.poll() == PdxPoll.Failed), None)
            for r in rooms:  # one room failed: the request did
                if not r.poll().terminal:
                    r.abort(f"another room of request {room} failed")
            if not self.is_abort_release_safe():
                return KVPoll.Transferring  # its pages may still be written: hold them
            failure = self._cause
            if failure is not None or room not in self.kv_mgr.failure_records:
                self.kv_mgr.record_failure(room, describe(failure))
            self.kv_mgr.update_status(room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            return KVPoll.Failed
        self.kv_mgr.request_status[room] = int(state)
        if state == PdxPoll.Success:
            self.conclude_state = KVPoll.Success
        return int(state)

    def failure_exception(self) -> None:
        cause = self._cause or next((r.failure for r in self._rooms() if r.failure), None)
        try:
            super().failure_exception()
        except KVTransferError as e:
            raise e from cause

    def abort(self) -> None:
        """SGLang's AbortReq: pdxfer tells the prefill and keeps the pages until its writes
        drained; ``poll()`` turns Failed then."""
        if self.conclude_state == KVPoll.Failed:
            return
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
        self.ensure_abort_notified()
        if self.rx is None or self.is_abort_release_safe():
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
        else:
            self.kv_mgr.request_status[self.bootstrap_room] = KVPoll.Failed

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        if self.kv_mgr.enable_deferred_decode_kv_release and (
            force_arm or self.init_time is not None
        ):
            self._abort_generation = self.kv_mgr.register_deferred_abort_room(self.bootstrap_room)
        for r in self._rooms():
            r.abort("aborted by SGLang (AbortReq)")

    def _clear(self) -> None:
        super()._clear()
        self.kv_mgr.receivers.pop(self.bootstrap_room, None)
