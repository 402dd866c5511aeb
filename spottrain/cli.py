"""``spottrain``: the workstation command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from spottrain import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spottrain",
        description=(
            "Train large models on spot GPU VMs as if they were reliable machines. "
            "Today: the Redis rendezvous for torchrun (--rdzv-backend=redis) and the agent "
            "(spottrain-agent). Fleet commands (up, status, logs, down, validate) come next."
        ),
    )
    parser.add_argument("--version", action="version", version=f"spottrain {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
