"""The ``pdxfer`` command: a thin dispatcher; each subcommand's logic lives in its module."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Literal

from .setting import setting


@dataclass(frozen=True, slots=True)
class CliOptions:
    """``pdxfer``'s own options: ``--log-level`` (every command), ``pdxfer bootstrap``'s and
    ``pdxfer demo``'s ``--engine``."""

    log_level: str = setting("WARNING", "DEBUG, INFO, WARNING, ERROR")
    host: str = setting("127.0.0.1", "address to bind (0.0.0.0: all)")
    advertise: str = setting(
        "",
        "address prefills and decodes reach it at (its ready line); default: --host",
        metavar="ADDRESS",
    )
    port: int = setting(8998, "HTTP port")
    engine: Literal["toy", "vllm"] = setting(
        "toy", "pdxfer demo's engine: the toy model, or real vLLM (needs the vllm extra)"
    )


def engine_pick() -> argparse.ArgumentParser:
    """``pdxfer demo``'s ``--engine``, read before the chosen demo parses the rest."""
    from .serving.cli_args import add_field_args

    pick = argparse.ArgumentParser(add_help=False)
    add_field_args(pick, CliOptions, "engine")
    return pick


def _bootstrap(a: argparse.Namespace) -> int:
    from .bootstrap import BootstrapServer
    from .netaddr import advertised

    shown = advertised(a.host, a.advertise)  # what prefills and decodes are told to dial
    srv = BootstrapServer(a.host, a.port, advertise=a.advertise).start()
    print(f"pdxfer bootstrap listening on {srv.address}", flush=True)
    print(f"PDXFER_READY http://{shown}:{srv.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    srv.stop()
    return 0


def _transfer_demo(a: argparse.Namespace) -> int:
    from .agents.transfer_demo import main as demo

    return demo(a.rest)


def _bench(a: argparse.Namespace) -> int:
    if a.rest and not a.rest[0].startswith("-"):  # a benchmark of the checkout: NAME
        from .checkout import run_benchmark

        return run_benchmark(a.rest[0], a.rest[1:])
    from .serving.toy.demo import bench  # no NAME: the toy cluster's, shipped in the wheel

    return bench(a.rest)


def _demo(a: argparse.Namespace) -> int:
    engine, rest = engine_pick().parse_known_args(a.rest)
    if engine.engine == "vllm":  # real vLLM (the `vllm` extra) behind the router
        from .serving.vllm.demo import main as vllm_demo

        return vllm_demo(rest)
    from .serving.toy.demo import main as demo

    return demo(rest)


def _prefill(a: argparse.Namespace) -> int:
    from .serving.toy.prefill import run

    return run(a)


def _decode(a: argparse.Namespace) -> int:
    if a.dp > 1:  # a front over independent decode groups
        from .serving.toy.dp import run
    else:
        from .serving.toy.decode import run

    return run(a)


def _router(a: argparse.Namespace) -> int:
    from .serving.router import run

    return run(a)


PASS_THROUGH = ("demo", "transfer-demo", "bench")
"""Subcommands that parse their own options (their --help lists them)."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (docs/configuration.md is generated from it)."""
    ap = argparse.ArgumentParser(prog="pdxfer", description="KV-cache transfer for PD serving")
    from .serving.cli_args import add_field_args, add_insecure_arg, add_router_args, add_worker_args

    add_field_args(ap, CliOptions, "log_level")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bootstrap", help="run a standalone bootstrap server")
    add_field_args(b, CliOptions, "host", "advertise", "port")
    add_insecure_arg(b)
    b.set_defaults(fn=_bootstrap)

    p = sub.add_parser("prefill", help="run a prefill worker (HTTP + transfer endpoint)")
    add_worker_args(p, "prefill")
    p.set_defaults(fn=_prefill)
    d = sub.add_parser("decode", help="run a decode worker (HTTP + transfer endpoint)")
    add_worker_args(d, "decode")
    d.set_defaults(fn=_decode)
    r = sub.add_parser("router", help="run the OpenAI-style router over prefill/decode pairs")
    add_router_args(r)
    r.set_defaults(fn=_router)
    sub.add_parser(
        "demo", help="serve a batch through router, prefill and decode; verify", add_help=False
    ).set_defaults(fn=_demo)
    sub.add_parser(
        "transfer-demo", help="move one request's KV between two processes", add_help=False
    ).set_defaults(fn=_transfer_demo)
    sub.add_parser(
        "bench",
        help="serving throughput/latency through the router (JSON); "
        "`pdxfer bench NAME`: a benchmark of a checkout's benchmarks/",
        add_help=False,
    ).set_defaults(fn=_bench)
    return ap


def pass_through_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers of the subcommands that parse their own options."""
    from .agents.transfer_demo import parser as transfer_parser
    from .serving.toy.demo import parser as demo_parser
    from .serving.vllm.demo import parser as vllm_parser

    return {
        "demo": demo_parser("pdxfer demo"),
        "demo --engine vllm": vllm_parser(),
        "transfer-demo": transfer_parser(),
        "bench": demo_parser("pdxfer bench"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a, rest = ap.parse_known_args(argv)
    if rest and a.cmd not in PASS_THROUGH:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    a.rest = rest
    if getattr(a, "insecure", False):  # before any knob is read; child processes inherit it
        os.environ["PDXFER_INSECURE"] = "1"
    logging.basicConfig(
        level=a.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from .errors import BootstrapError, ConfigError

    try:
        return int(a.fn(a))
    except (BootstrapError, ConfigError, ValueError) as e:  # a setup that cannot work: why
        print(f"pdxfer {a.cmd}: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
