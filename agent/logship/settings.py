"""What a node's log shipping is told: ``spottrain-agent run``'s ``--logs-*`` flags, each
defaulting to its ``SPOTTRAIN_LOGS_*`` variable, and the spec's defaults behind them."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

from spottrain.protocol.boot import REDACT_FILE
from spottrain.protocol.env import (
    ENV_LOGS_BACKLOG_MB,
    ENV_LOGS_CHUNK_MB,
    ENV_LOGS_CHUNK_S,
    ENV_LOGS_FILE,
    ENV_LOGS_FILE_MAX_MB,
    ENV_LOGS_MAX_MB,
    ENV_LOGS_TO,
    ENV_VM_ID,
)
from spottrain.protocol.keys import DEFAULT_PREFIX
from spottrain.protocol.node_logs import default_logs_url

MB = 1_000_000
# The spec's defaults (spottrain.spec.sections, checked equal by the tests): the agent does
# not import the spec, and a boot script sets only what differs from them.
DEFAULT_LOG_CHUNK_S = 15.0
DEFAULT_LOG_CHUNK_MB = 4.0
DEFAULT_LOG_MAX_MB = 1024.0
DEFAULT_LOG_BACKLOG_MB = 64.0
# The spec's logs.chunk_mb range: a smaller chunk is one PUT per line.
MIN_LOG_CHUNK_MB = 0.01
MAX_LOG_CHUNK_MB = 256.0
_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class ShipSettings:
    """One VM's shipping.

    Attributes:
        url: the logs store (``s3://``, ``gs://``, ``file://`` or a path).
        file: the file the node's output is appended to.
        run_id, node: whose output it is (the chunks' prefix).
        vm: this VM's id; empty: asked of the cloud's metadata server, else the host name.
        cloud, metadata_endpoint: where to ask.
        chunk_s: a chunk is cut at most this long after its first line.
        chunk_bytes: uncompressed bytes that cut a chunk sooner.
        max_bytes: compressed bytes this VM ships at most (then a last marker chunk).
        backlog_bytes: unshipped bytes held before the oldest are dropped.
        file_max_bytes: truncate ``file`` once it is read past this (0: never; the local
            cloud keeps its console file whole).
        password_file: the Redis password's file, whose value is redacted from every chunk.
        redact_file: the boot's list of the secret values it read, redacted too.
        key_prefix: the run's Redis key prefix (the workers' Redis password, derived from
            the run's and its keys, is redacted too).
    """

    url: str
    file: str
    run_id: str
    node: str
    vm: str = ""
    cloud: str = "local"
    metadata_endpoint: str | None = None
    chunk_s: float = DEFAULT_LOG_CHUNK_S
    chunk_bytes: int = int(DEFAULT_LOG_CHUNK_MB * MB)
    max_bytes: int = int(DEFAULT_LOG_MAX_MB * MB)
    backlog_bytes: int = int(DEFAULT_LOG_BACKLOG_MB * MB)
    file_max_bytes: int = 0
    password_file: str | None = None
    redact_file: str = REDACT_FILE
    key_prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not 0 < self.chunk_s <= 3600:
            raise ValueError(f"logs chunk seconds {self.chunk_s:g} must be in (0, 3600]")
        if self.chunk_bytes < 1 or self.backlog_bytes < self.chunk_bytes:
            raise ValueError(
                f"logs backlog ({self.backlog_bytes} bytes) must hold at least one chunk "
                f"({self.chunk_bytes} bytes): raise --logs-backlog-mb or lower --logs-chunk-mb"
            )
        if self.max_bytes < 4096:
            raise ValueError(f"logs cap {self.max_bytes} bytes must be at least 4096")


def vm_name(raw: str) -> str:
    """``raw`` as a chunk name's VM part (letters, digits, '.', '_', '-'; 128 at most)."""
    return _NOT_A_NAME.sub("-", raw)[:128].strip(".") or "vm"


def add_logs_args(run: argparse.ArgumentParser, env: Callable[..., str | None]) -> None:
    """``spottrain-agent run``'s shipping flags; ``env`` reads (and registers) a variable."""
    g = run.add_argument_group("log shipping (the spec's logs: section)")
    g.add_argument(
        "--logs-to",
        default=env(ENV_LOGS_TO, ""),
        help="the store this node's output is shipped to (default: <--ckpt-copy-to>/logs; "
        "neither: nothing is shipped)",
    )
    g.add_argument(
        "--logs-file",
        default=env(ENV_LOGS_FILE, ""),
        help="the file this node's output is appended to (the systemd unit's, the local "
        "VM's console); empty: nothing is shipped",
    )
    g.add_argument(
        "--logs-chunk-seconds", default=env(ENV_LOGS_CHUNK_S, f"{DEFAULT_LOG_CHUNK_S:g}")
    )
    g.add_argument("--logs-chunk-mb", default=env(ENV_LOGS_CHUNK_MB, f"{DEFAULT_LOG_CHUNK_MB:g}"))
    g.add_argument("--logs-max-mb", default=env(ENV_LOGS_MAX_MB, f"{DEFAULT_LOG_MAX_MB:g}"))
    g.add_argument(
        "--logs-backlog-mb", default=env(ENV_LOGS_BACKLOG_MB, f"{DEFAULT_LOG_BACKLOG_MB:g}")
    )
    g.add_argument(
        "--logs-file-max-mb",
        default=env(ENV_LOGS_FILE_MAX_MB, "0"),
        help="truncate --logs-file once read past this many MB (0: never)",
    )
    g.add_argument("--vm-id", default=env(ENV_VM_ID, ""), help="this VM's id in chunk names")


def _mb(args: argparse.Namespace, name: str) -> float:
    raw = getattr(args, name)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag} {raw!r} (or its SPOTTRAIN_LOGS_* variable) must be a number")
    return value


def ship_settings(args: argparse.Namespace) -> ShipSettings | None:
    """The parsed flags as settings, or ``None`` when there is nothing to ship (no store, or
    no file the node's output goes to).

    Raises:
        ValueError: a flag that is not a number, or numbers that do not fit together.
    """
    url = args.logs_to or default_logs_url(args.ckpt_copy_to)
    if not url or not args.logs_file:
        return None
    chunk_mb = _mb(args, "logs_chunk_mb")
    if not MIN_LOG_CHUNK_MB <= chunk_mb <= MAX_LOG_CHUNK_MB:
        raise ValueError(
            f"--logs-chunk-mb {args.logs_chunk_mb!r} (or SPOTTRAIN_LOGS_CHUNK_MB) must be from "
            f"{MIN_LOG_CHUNK_MB:g} to {MAX_LOG_CHUNK_MB:g}, as the spec's logs.chunk_mb"
        )
    return ShipSettings(
        url=url,
        file=args.logs_file,
        run_id=args.run_id,
        node=args.node_id,
        vm=vm_name(args.vm_id) if args.vm_id else "",
        cloud=args.cloud,
        metadata_endpoint=args.metadata_endpoint,
        chunk_s=_mb(args, "logs_chunk_seconds"),
        chunk_bytes=int(chunk_mb * MB),
        max_bytes=int(_mb(args, "logs_max_mb") * MB),
        backlog_bytes=int(_mb(args, "logs_backlog_mb") * MB),
        file_max_bytes=int(_mb(args, "logs_file_max_mb") * MB),
        key_prefix=getattr(args, "key_prefix", DEFAULT_PREFIX),
        password_file=getattr(args, "password_file", None) or None,
    )
