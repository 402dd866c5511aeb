"""``spottrain-agent``: the command that runs on every VM."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from spottrain import __version__
from spottrain.keys import DEFAULT_PREFIX, RunKeys
from spottrain.redis_conn import (
    DEFAULT_PASSWORD_ENV,
    RedisAuthError,
    RedisConfigError,
    RedisSettings,
    RedisUnavailableError,
    connect,
    parse_endpoint,
    ping,
    resolve_password,
)


def _add_redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", required=True, help="HOST:PORT or redis[s]://HOST:PORT of the job")
    p.add_argument("--run-id", required=True, help="the run id (torchrun's --rdzv-id)")
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX)
    p.add_argument(
        "--password-file", help=f"file with the Redis password (default: ${DEFAULT_PASSWORD_ENV})"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spottrain-agent",
        description="The spottrain agent that runs on every VM of a job.",
    )
    parser.add_argument("--version", action="version", version=f"spottrain-agent {__version__}")
    sub = parser.add_subparsers(dest="command")
    leave = sub.add_parser(
        "leave",
        help="make a node leave the job's rendezvous now (its peers re-form at once)",
    )
    _add_redis_args(leave)
    leave.add_argument(
        "--node-id",
        default=os.environ.get("SPOTTRAIN_NODE_ID"),
        help="the node to remove (default: $SPOTTRAIN_NODE_ID)",
    )
    return parser


def _settings(args: argparse.Namespace) -> RedisSettings:
    host, port, tls, db = parse_endpoint(args.redis)
    return RedisSettings(
        host=host,
        port=port,
        db=db or 0,
        tls=bool(tls),
        password=resolve_password(DEFAULT_PASSWORD_ENV, args.password_file),
    )


def _leave(args: argparse.Namespace) -> int:
    from spottrain.agent.rendezvous.membership import leave_node

    if not args.node_id:
        print("spottrain-agent leave: give --node-id or set SPOTTRAIN_NODE_ID", file=sys.stderr)
        return 2
    settings = _settings(args)
    client = connect(settings)
    ping(client, settings)
    member = leave_node(client, RunKeys(args.run_id, args.key_prefix), args.node_id)
    print(f"node {args.node_id} ({member}) left run {args.run_id}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "leave":
            return _leave(args)
    except (RedisConfigError, RedisAuthError, RedisUnavailableError, ValueError) as exc:
        print(f"spottrain-agent {args.command}: {exc}", file=sys.stderr)
        return 2
    except LookupError as exc:
        print(f"spottrain-agent {args.command}: {exc.args[0]}", file=sys.stderr)
        return 3
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
