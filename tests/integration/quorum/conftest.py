"""Fixtures for the Redis quorum's tests (the helpers live in quorum_harness)."""

from __future__ import annotations

from collections.abc import Iterator

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
