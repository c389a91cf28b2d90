"""``RouterSettings``: the router's settings, each field carrying its flag's default and help.

``pdxfer router`` generates its flags from these fields (and from ``MediaPolicy``'s, for what
chat requests may carry); ``Router`` takes its defaults from them. Nothing heavy is imported
here, so ``pdxfer --help`` stays cheap.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal, get_args

from pdxfer.setting import from_namespace, settings_of
from pdxfer.setting import setting as setting_field

Policy = Literal["auto", "round_robin", "least_outstanding", "kv_aware"]
"""How the router pairs workers (``auto``: kv_aware with several decodes, else round_robin)."""
POLICIES: tuple[str, ...] = get_args(Policy)
Dispatch = Literal["concurrent", "sequential"]
"""When a vLLM decode gets its request (``RouterSettings.dispatch``)."""
DISPATCHES: tuple[str, ...] = get_args(Dispatch)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings:
    """What ``pdxfer router`` is told: its address, its workers and how it pairs them."""

    host: str = setting_field("127.0.0.1", "address to bind (0.0.0.0: all)")
    advertise: str = setting_field(
        "",
        "address clients reach the router at (its ready line); default: --host",
        metavar="ADDRESS",
    )
    port: int = setting_field(8000, "HTTP port (0: pick a free one)")
    prefill: tuple[str, ...] = setting_field(
        help="a prefill instance: its HTTP URL, its bootstrap host:port and optionally its "
        "instance name (repeat for more). An instance whose registration has several "
        "data-parallel ranks (vLLM --data-parallel-size) is one record per rank",
        metavar="URL,BOOTSTRAP[,INST]",
    )
    decode: tuple[str, ...] = setting_field(
        help="a decode instance's HTTP URL and optionally its instance name, which rooms are "
        "bound to (repeat for more). A decode whose health shows several groups (pdxfer "
        "decode --dp; vLLM: one engine label per data-parallel rank in its /metrics) is one "
        "record per group",
        metavar="URL[,INSTANCE]",
    )
    engine: Literal["toy", "vllm"] = setting_field(
        "toy", "what the workers run: pdxfer's toy workers, or `vllm serve` with PdxferConnector"
    )
    tokenizer: str | None = setting_field(
        None,
        "--engine vllm: the served model's folder for the tokenizer (default: the root "
        "the decode's /v1/models names)",
        metavar="PATH",
    )
    page_size: int | None = setting_field(
        None,
        "--engine vllm: the decodes' block size for KV-aware routing (default: read "
        "from their /metrics)",
    )
    dispatch: Dispatch = setting_field(
        "concurrent",
        "--engine vllm: send the decode its request at the same time as the "
        "prefill's (concurrent: the decode allocates and asks while the prefill computes), "
        "or after the prefill answered (sequential: vLLM's own proxy protocol)",
    )
    policy: Policy = setting_field(
        "auto",
        "pairing policy (auto: kv_aware where a leg has a choice, several prefills or "
        "several decodes, else round_robin)",
    )
    kv_events: tuple[str, ...] = setting_field(
        (),
        "kv_aware: a worker's KV event stream (vLLM --kv-events-config publisher zmq: its "
        "endpoint and replay_endpoint, e.g. "
        "http://10.0.0.1:8100=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558); workers without one "
        "are judged by the router's own history (repeat for more). A worker with several "
        "data-parallel ranks gets one feed per rank at the given ports plus the rank, as "
        "vLLM publishes them",
        metavar="WORKER_URL=ENDPOINT[,REPLAY]",
    )
    kv_load_weight: float = setting_field(
        0.5,
        "kv_aware: how many prompts' worth of tokens one outstanding request on a decode "
        "weighs against the prefix it holds (a prefill's load is the prompt tokens it still "
        "has to compute)",
    )
    kv_stale_misses: int = setting_field(
        3,
        "kv_aware: requests that contradict a worker's KV events (it held less than they "
        "claimed, or they never showed blocks it stored) within --kv-stale-window before "
        "its feed is taken as out of sync: history decides for it until the feed resyncs",
    )
    kv_stale_window_s: float = setting_field(
        60.0, "kv_aware: the window (seconds) in which --kv-stale-misses contradictions count"
    )
    kv_stale_tolerance_blocks: int = setting_field(
        1,
        "kv_aware: blocks a worker may hold fewer of than its events claimed without that "
        "counting as a contradiction (one evicted between choice and arrival, or the last "
        "block an engine computes again)",
    )
    kv_stale_deadline_s: float = setting_field(
        5.0,
        "kv_aware: seconds after a worker served a prompt by which its KV events should "
        "show the blocks it lacked; none by then counts as a contradiction",
    )
    kv_index_blocks: int = setting_field(
        0,
        "kv_aware: the (worker, block) pairs the KV index is sized for at the start: the "
        "fleet's KV cache blocks (each worker's num_gpu_blocks, summed), so it does not grow "
        "while events stream in (about 50 bytes each); 0: it starts small and grows. It "
        "grows past this when it must",
        metavar="N",
    )
    expose_cache_stats: bool = setting_field(
        False,
        "show clients how many prompt tokens came from the decode's cache "
        "(usage.prompt_tokens_details.cached_tokens, pdxfer.restored_tokens)",
    )
    prefill_queue_tokens: int = setting_field(
        16384,
        "prompt tokens a prefill may have waiting to be computed, with a new request's: past "
        "it, requests wait at the router (first come, first served) until a prefill has "
        "room; an idle prefill takes any request (0: no limit)",
    )
    max_held: int = setting_field(
        1024,
        "requests that may wait at the router for a prefill with room; past it a request "
        "is refused at once with 503",
    )
    timeout_s: float = setting_field(
        120.0,
        "per-request deadline towards the workers (seconds); --engine vllm: also how "
        "long the start waits for a decode to answer (at least 120 s)",
    )

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> RouterSettings:
        """The settings ``pdxfer router``'s flags (generated from these fields) parsed into."""
        return cls(**from_namespace(cls, a))


DEFAULT = {k: s.default for k, s in settings_of(RouterSettings).items()}
"""Each setting's default, for ``Router``'s parameters."""
