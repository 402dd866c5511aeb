"""Fixtures for the Redis quorum's tests (the helpers live in quorum_harness)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from quorum_harness import FAST, Fleet

from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.model import QuorumConfig


@pytest.fixture
def make_fleet(redis_server: object, run_keys: RunKeys) -> Iterator[object]:
    made: list[Fleet] = []

    def make(config: QuorumConfig = FAST, client: redis.Redis | None = None) -> Fleet:
        r = client or redis_server.client()  # type: ignore[attr-defined]
        fleet = Fleet(QuorumClient(r, run_keys, config), config)
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        fleet.close()
