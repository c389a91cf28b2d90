"""Command-line options of the serving subcommands (kept apart so ``--help`` stays cheap).

The flags that set an endpoint setting are generated from its field (``add_setting_args``):
default, type, choices and help come from ``pdxfer.endpoint_settings``, written once there.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdxfer import endpoint_settings


def flag_of(name: str) -> str:
    """An endpoint setting's flag: ``bootstrap_timeout_s`` -> ``--bootstrap-timeout``."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def add_setting_args(ap: argparse.ArgumentParser | Any, *names: str) -> None:
    """One flag per endpoint setting, everything about it taken from its field."""
    known = endpoint_settings()
    for name in names:
        s = known[name]
        kw: dict[str, Any] = {"default": s.default,
                              "help": s.help.replace("``", "").replace("%", "%%")}
        if s.kind == "bool":
            kw["action"] = "store_false" if s.default else "store_true"
        else:
            kw["type"] = {"int": int, "float": float}.get(s.kind, str)
        if s.choices:
            kw["choices"] = list(s.choices)
        ap.add_argument(flag_of(name), **kw)


def add_worker_args(ap: argparse.ArgumentParser, role: str) -> None:
    add_setting_args(ap.add_argument_group("addresses", "the HTTP server binds --host too, and "
                                           "prints --advertise in its ready line"),
                     "host", "advertise")
    ap.add_argument("--port", type=int, default=0, help="HTTP port (0: pick a free one)")
    ap.add_argument("--bootstrap", default=None, required=role == "prefill",
                    help="bootstrap server host:port to register with" if role == "prefill"
                    else "the bootstrap servers this decode trusts (host:port, several "
                         "separated by commas; required): it loads KV only from prefills "
                         "found through them, and refuses a request naming any other")
    add_setting_args(ap, "insecure", "instance", "transport", "device")
    ap.add_argument("--torch-device", default="cpu", metavar="DEVICE",
                    help="where the toy model computes and its KV pools live: cpu (default) "
                         "or cuda[:N] (the forward on that GPU, the pools registered with the "
                         "transport as device memory; needs --tp 1)")
    ap.add_argument("--pages", type=int, default=1024, help="KV pages in the pool")
    ap.add_argument("--aux-slots", type=int, default=64, help="aux rows (concurrent requests)")
    ap.add_argument("--seed", type=int, default=0, help="toy model seed (same on both sides)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--max-seq-len", type=int, default=1024,
                    help="longest prompt plus output, in tokens")
    ap.add_argument("--chunk-size", type=int, default=64, help="prefill chunk (tokens)")
    ap.add_argument("--l2-pages", "--prefix-cache-pages", dest="l2_pages", type=int,
                    default=512,
                    help="host-DRAM prefix cache (L2, pdxfer.tiers) in pages (0: off): the "
                         "decode restores a cached prefix instead of receiving it, the "
                         "prefill instead of recomputing it")
    if role == "decode":
        ap.add_argument("--l3-dir", default="",
                        help="L3 (storage) folder: prefixes survive a decode restart "
                             "(default: $XDG_CACHE_HOME/pdxfer/l3)")
        ap.add_argument("--l3-max-gb", type=float, default=4.0,
                        help="size bound of the L3 folder; a full L3 is a logged miss")
        ap.add_argument("--l3-mooncake", default="", metavar="MASTER",
                        help="use Mooncake Store as L3: its master's host:port")
        ap.add_argument("--l3-mooncake-metadata", default="", metavar="URL",
                        help="the Mooncake Store metadata URL (http://host:port/metadata)")
        ap.add_argument("--l3-mooncake-segment-mb", type=int, default=256,
                        help="store memory this decode contributes to Mooncake Store (0: "
                             "none; objects then live in other clients' segments and "
                             "survive this decode's restart)")
        ap.add_argument("--no-l3", action="store_true", help="no L3: host DRAM only")
        ap.add_argument("--kv-landing", choices=["device", "host"], default="device",
                        help="host: receive into a token-granular host pool (page size 1, "
                             "HiSparse-style) and decode from it; pairs with a prefill of any "
                             "page size")
        add_setting_args(ap, "integrity", "integrity_retry")
    ap.add_argument("--kv-ballast-bytes-per-token", type=int, default=0, metavar="N",
                    help="benchmark device: a sidecar pool of N bytes per token (a multiple "
                         "of 8) that is transferred, tiered and checked with the KV, so the "
                         "toy model moves as many bytes as a real one (131072: an 8B model "
                         "with GQA); prefill and decode must agree (0: off)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks: one process each (this one is rank 0), each "
                         "holding and transferring its share of the KV heads; any TP size "
                         "pairs with any other that divides it or that it divides")
    if role == "decode":
        ap.add_argument("--dp", type=int, default=1,
                        help="independent decode groups (each of --tp ranks) behind this one "
                             "address; the router routes to each group as to a decode of its "
                             "own")
    if role == "decode":
        ap.add_argument("--min-step-s", type=float, default=0.0, metavar="SECONDS",
                        help="a floor on each decode step's duration (an emulated slower "
                             "model: a generation of N tokens then lasts at least N times "
                             "this on any machine; tests that must outlast a client use it)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the toy model's ops are tiny: more threads only spin)")
    add_setting_args(ap, "bootstrap_timeout_s", "transfer_timeout_s", "heartbeat_s")
    ap.add_argument("--max-waiting", type=int, default=256,
                    help="requests that may wait for pages; more get 503 with Retry-After")
    ap.add_argument("--admission-timeout", type=float, default=20.0,
                    help="seconds a request waits for pages before a 503 (keep it under the "
                         "prefill's --bootstrap-timeout: the prefill waits that long for the "
                         "decode to admit a request)")


def add_insecure_arg(ap: argparse.ArgumentParser) -> None:
    add_setting_args(ap, "insecure")


def add_router_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    ap.add_argument("--advertise", default="", metavar="ADDRESS",
                    help="address clients reach the router at (its ready line); "
                         "default: --host")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (0: pick a free one)")
    add_insecure_arg(ap)
    ap.add_argument("--prefill", action="append", required=True, metavar="URL,BOOTSTRAP[,INST]",
                    help="a prefill instance: its HTTP URL, its bootstrap host:port and "
                         "optionally its instance name (repeat for more)")
    ap.add_argument("--decode", action="append", required=True, metavar="URL[,INSTANCE]",
                    help="a decode instance's HTTP URL and optionally its instance name, which "
                         "rooms are bound to (repeat for more)")
    ap.add_argument("--engine", choices=["toy", "vllm"], default="toy",
                    help="what the workers run: pdxfer's toy workers, or `vllm serve` with "
                         "PdxferConnector")
    ap.add_argument("--tokenizer", default=None, metavar="PATH",
                    help="--engine vllm: the served model's folder for the tokenizer (default: "
                         "the root the decode's /v1/models names)")
    ap.add_argument("--page-size", type=int, default=None,
                    help="--engine vllm: the decodes' block size for KV-aware routing (default: "
                         "read from their /metrics)")
    ap.add_argument("--dispatch", choices=["concurrent", "sequential"], default="concurrent",
                    help="--engine vllm: send the decode its request at the same time as the "
                         "prefill's (concurrent: the decode allocates and asks while the prefill "
                         "computes), or after the prefill answered (sequential: vLLM's own "
                         "proxy protocol)")
    ap.add_argument("--policy", default="auto",
                    choices=["auto", "round_robin", "least_outstanding", "kv_aware"],
                    help="pairing policy (auto: kv_aware with several decodes, else "
                         "round_robin)")
    ap.add_argument("--kv-events", action="append", default=[],
                    metavar="WORKER_URL=ENDPOINT[,REPLAY]",
                    help="kv_aware: a worker's KV event stream (vLLM --kv-events-config "
                         "publisher zmq: its endpoint and replay_endpoint, e.g. "
                         "http://10.0.0.1:8100=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558); "
                         "workers without one are judged by the router's own history "
                         "(repeat for more)")
    ap.add_argument("--kv-load-weight", type=float, default=0.5,
                    help="kv_aware: how many prompts' worth of tokens one outstanding request "
                         "on a worker weighs against the prefix it holds")
    ap.add_argument("--expose-cache-stats", action="store_true",
                    help="show clients how many prompt tokens came from the decode's cache "
                         "(usage.prompt_tokens_details.cached_tokens, pdxfer.restored_tokens)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="per-request deadline towards the workers (seconds); --engine vllm: "
                         "also how long the start waits for a decode to answer (at least "
                         "120 s)")
