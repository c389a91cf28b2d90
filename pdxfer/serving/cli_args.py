"""Command-line options of the serving subcommands (kept apart so ``--help`` stays cheap)."""

from __future__ import annotations

import argparse


def add_worker_args(ap: argparse.ArgumentParser, role: str) -> None:
    ap.add_argument("--host", default="127.0.0.1", help="HTTP and transfer bind address")
    ap.add_argument("--port", type=int, default=0, help="HTTP port (0: pick a free one)")
    ap.add_argument("--bootstrap", default=None, required=role == "prefill",
                    help="bootstrap server host:port" + (" to register with" if role == "prefill"
                                                         else " (default for requests)"))
    ap.add_argument("--instance", default="default", help="prefill instance name")
    ap.add_argument("--pages", type=int, default=1024, help="KV pages in the pool")
    ap.add_argument("--aux-slots", type=int, default=64, help="aux rows (concurrent requests)")
    ap.add_argument("--seed", type=int, default=0, help="toy model seed (same on both sides)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--chunk-size", type=int, default=64, help="prefill chunk (tokens)")
    ap.add_argument("--prefix-cache-pages", type=int, default=512,
                    help="host-memory prefix cache in pages (0: off): the decode restores a "
                         "cached prefix instead of receiving it, the prefill instead of "
                         "recomputing it")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the toy model's ops are tiny: more threads only spin)")
    ap.add_argument("--bootstrap-timeout", type=float, default=30.0)
    ap.add_argument("--transfer-timeout", type=float, default=60.0)
    ap.add_argument("--heartbeat", type=float, default=0.5)
    ap.add_argument("--max-waiting", type=int, default=256,
                    help="requests that may wait for pages; more get 503 with Retry-After")
    ap.add_argument("--admission-timeout", type=float, default=30.0,
                    help="seconds a request waits for pages before a 503")



def add_router_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (0: pick a free one)")
    ap.add_argument("--prefill", action="append", required=True, metavar="URL,BOOTSTRAP[,INST]",
                    help="a prefill instance: its HTTP URL, its bootstrap host:port and "
                         "optionally its instance name (repeat for more)")
    ap.add_argument("--decode", action="append", required=True, metavar="URL",
                    help="a decode instance's HTTP URL (repeat for more)")
    ap.add_argument("--policy", default="auto",
                    choices=["auto", "round_robin", "least_outstanding", "kv_aware"],
                    help="pairing policy (auto: kv_aware with several decodes, else "
                         "round_robin)")
    ap.add_argument("--expose-cache-stats", action="store_true",
                    help="show clients how many prompt tokens came from the decode's cache "
                         "(usage.prompt_tokens_details.cached_tokens, pdxfer.restored_tokens)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="per-request deadline towards the workers (seconds)")
