"""Fixtures for the Redis quorum's tests (the helpers live in quorum_harness)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from quorum_harness import FAST, Fleet, connect_to

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.model import QuorumConfig


@pytest.fixture
def make_fleet(redis_server: object, run_keys: RunKeys) -> Iterator[object]:
    made: list[Fleet] = []

    def make(config: QuorumConfig = FAST, client: redis.Redis | None = None) -> Fleet:
        r = client or connect_to(redis_server.port)  # type: ignore[attr-defined]
        fleet = Fleet(QuorumClient(r, run_keys, config), config)
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        fleet.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own (AOF on), which it may restart, wipe or stall."""
    with RedisServer(extra_args=["--enable-debug-command", "yes"]) as server:
        yield server


# A primary and a replica-to-be, for wait_replicas, min-replicas-to-write and failovers.
@pytest.fixture
def primary() -> Iterator[RedisServer]:
    with RedisServer() as server:
        server.client().config_set("repl-diskless-sync-delay", 0)  # no 5 s wait to sync
        yield server


@pytest.fixture
def standby() -> Iterator[RedisServer]:
    """A Redis that is nobody's replica yet (the test makes it one); it syncs at once should
    a failover make it the primary."""
    server = RedisServer()
    with server:
        server.client().config_set("repl-diskless-sync-delay", 0)
        yield server
        server.stop(signal.SIGKILL)  # a replica's SIGTERM shutdown can take seconds


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for requests that block while the test changes Redis under them."""
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor
