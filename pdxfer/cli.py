"""The ``pdxfer`` command."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def _bootstrap(a: argparse.Namespace) -> int:
    from .bootstrap import BootstrapServer

    srv = BootstrapServer(a.host, a.port).start()
    print(f"pdxfer bootstrap listening on {srv.address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    srv.stop()
    return 0


def _demo(a: argparse.Namespace) -> int:
    from .transfer_demo import main as demo

    return demo(a.rest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdxfer", description="KV-cache transfer for PD serving")
    ap.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bootstrap", help="run a standalone bootstrap server")
    b.add_argument("--host", default="127.0.0.1")
    b.add_argument("--port", type=int, default=8998)
    b.set_defaults(fn=_bootstrap)
    d = sub.add_parser("demo", help="move one request's KV between two processes and report")
    d.set_defaults(fn=_demo)
    a, rest = ap.parse_known_args(argv)
    if rest and a.cmd != "demo":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    a.rest = rest
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return int(a.fn(a))


if __name__ == "__main__":
    sys.exit(main())
