"""``spottrain-agent watch``: print the preemption notices this VM's cloud shows, as JSON lines.

For operators and tests: it runs the same watcher the agent runs, prints each notice once
(``Notice.to_json()`` on stdout) and each error once (plain lines on stderr), and exits 0 on
Ctrl-C or SIGTERM. It acts on nothing.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import TextIO

from spottrain.agent.notices.aws import AwsImdsWatcher
from spottrain.agent.notices.gcp import GcpMetadataWatcher
from spottrain.agent.notices.metadata_http import DEFAULT_TIMEOUT_S, WatcherError
from spottrain.agent.notices.notice import Notice
from spottrain.agent.notices.poll_loop import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, PollLoop

_PROG = "spottrain-agent watch"


def add_watch_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``watch`` subcommand to ``spottrain-agent``'s subparsers."""
    p = subparsers.add_parser(
        "watch",
        help="print the preemption notices this VM's cloud shows, one JSON line each",
        description=(
            "Poll the cloud's metadata service and print each preemption notice once as a "
            "JSON line on stdout (errors go to stderr). Stops on Ctrl-C or SIGTERM."
        ),
    )
    p.add_argument("--cloud", required=True, choices=["aws", "gcp"])
    p.add_argument(
        "--endpoint",
        help=(
            "AWS: IMDS base URL (default $AWS_EC2_METADATA_SERVICE_ENDPOINT or "
            "http://169.254.169.254); GCP: metadata HOST[:PORT] (default $GCE_METADATA_HOST "
            "or metadata.google.internal)"
        ),
    )
    p.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help=f"seconds between polls, at most {MAX_INTERVAL_S:g} (default {DEFAULT_INTERVAL_S:g})",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds each metadata request may take (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="poll once and exit (0 whether or not there is a notice, 2 if the poll failed)",
    )


class _Printer:
    """Prints each notice once per (dedup key, deadline): a notice that stays up is one line,
    one that comes back with a new deadline is a new line."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self._out = out
        self._err = err
        self._printed: set[tuple[tuple[str, str], float | None]] = set()
        self._lock = threading.Lock()

    def notice(self, notice: Notice) -> None:
        key = (notice.dedup_key, notice.deadline)
        with self._lock:
            if key in self._printed:
                return
            self._printed.add(key)
            print(notice.to_json(), file=self._out, flush=True)

    def error(self, message: str) -> None:
        with self._lock:
            print(f"{_PROG}: {message}", file=self._err, flush=True)


def _make_watcher(args: argparse.Namespace) -> AwsImdsWatcher | GcpMetadataWatcher:
    if args.cloud == "aws":
        return AwsImdsWatcher(args.endpoint, timeout=args.timeout)
    return GcpMetadataWatcher(args.endpoint, timeout=args.timeout)


def _run_once(watcher: AwsImdsWatcher | GcpMetadataWatcher, printer: _Printer) -> int:
    try:
        notices = watcher.poll()
    except WatcherError as exc:
        printer.error(str(exc))
        return 2
    for message in watcher.last_errors:
        printer.error(message)
    for notice in notices:
        printer.notice(notice)
    return 0


def run_watch(args: argparse.Namespace) -> int:
    """Runs ``spottrain-agent watch`` with parsed arguments; returns the exit status.

    Exits 0 after Ctrl-C or SIGTERM (or after one poll with ``--once``), 2 on bad
    arguments or when a ``--once`` poll could check nothing.
    """
    out: TextIO = sys.stdout
    printer = _Printer(out, sys.stderr)
    try:
        watcher = _make_watcher(args)
        loop = PollLoop(
            watcher,
            printer.notice,
            printer.error,
            interval=args.interval,
            name=f"spottrain-watch-{args.cloud}",
        )
    except ValueError as exc:
        printer.error(f"{exc}; nothing was polled")
        return 2
    if args.once:
        return _run_once(watcher, printer)

    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # The main thread only reads this flag between sleeps, so set() never waits on a
        # lock held by the code the signal interrupted.
        stopping.set()

    installed = False
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, on_signal)
        installed = True
    except ValueError:
        pass  # not the main thread: signals cannot reach us there; KeyboardInterrupt still can
    loop.start()
    try:
        while not stopping.is_set():
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    finally:
        loop.stop()
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spottrain.agent.watch_cmd watch ...``: the subcommand on its own."""
    parser = argparse.ArgumentParser(prog="spottrain-agent")
    sub = parser.add_subparsers(dest="command", required=True)
    add_watch_parser(sub)
    return run_watch(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
