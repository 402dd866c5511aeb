"""Starts every notice source of a node but SIGTERM (which :mod:`.signals` installs on the
main thread at start-up): its cloud's metadata monitors, and the injected notices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from spottrain.protocol.keys import RunKeys

from .injected import InjectedNotices
from .notice import Notice


def start_sources(
    cloud: str,
    client: redis.Redis,
    keys: RunKeys,
    node_id: str,
    on_notice: Callable[[Notice], None],
    on_error: Callable[[str], None],
    *,
    metadata_endpoint: str | None = None,
    poll_interval: float = 2.0,
) -> list[Any]:
    """Starts the sources; returns what to ``stop()`` when the agent ends.

    Args:
        cloud: "aws" (IMDS: spot action, rebalance, Auto Scaling lifecycle), "gcp" (preempted,
            maintenance) or "local" (injected notices only).
        on_notice: Takes every notice (the handler's ``submit``).
        on_error: Takes each new error of a metadata monitor, one line.
        metadata_endpoint: The metadata service's address, when not the cloud's own.
        poll_interval: Seconds between two polls of the metadata service.
    """
    from .poll_loop import PollLoop, Watcher

    started: list[Any] = []
    watcher: Watcher | None = None
    if cloud == "aws":
        from .aws import AwsImdsWatcher

        watcher = AwsImdsWatcher(metadata_endpoint)
    elif cloud == "gcp":
        from .gcp import GcpMetadataWatcher

        watcher = GcpMetadataWatcher(metadata_endpoint)
    if watcher is not None:
        loop = PollLoop(watcher, on_notice, on_error, interval=poll_interval)
        started.append(loop.start())
    started.append(InjectedNotices(client, keys, node_id, on_notice).start())
    return started
