"""``python -m spottrain.agent.logship``: ship one file until SIGTERM or SIGINT, as the
agent does (the same flags as ``spottrain-agent run``'s ``--logs-*``). For shipping a file
by hand, and for the tests that kill a shipper mid-chunk."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from .settings import add_logs_args, ship_settings
from .shipper import FINAL_FLUSH_S, LogShipper


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spottrain.agent.logship")
    p.add_argument("--run-id", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--ckpt-copy-to", default="")
    p.add_argument("--cloud", default="local", choices=("local", "aws", "gcp"))
    p.add_argument("--metadata-endpoint", default=None)
    add_logs_args(p, os.environ.get)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s logship %(message)s")
    try:
        settings = ship_settings(args)
    except ValueError as exc:
        print(f"logship: {exc}", file=sys.stderr)
        return 2
    if settings is None:
        print("logship: give --logs-file and --logs-to (or --ckpt-copy-to)", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    shipper = LogShipper(settings).start()
    print("logship: shipping", flush=True)
    stop.wait()
    return 0 if shipper.close(FINAL_FLUSH_S) else 1


if __name__ == "__main__":
    sys.exit(main())
