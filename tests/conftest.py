"""Shared fixtures: a real Redis server on 127.0.0.1 and a free port, and per-test run ids
whose keys are removed afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.redis_conn import RedisSettings


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def redis_settings(redis_server: RedisServer) -> RedisSettings:
    return RedisSettings(host=redis_server.host, port=redis_server.port)


@pytest.fixture
def run_keys(redis_client: redis.Redis) -> Iterator[RunKeys]:
    """A fresh run id for one test; every key under it is deleted afterwards."""
    keys = RunKeys(f"t-{uuid.uuid4().hex[:12]}")
    yield keys
    stale = list(redis_client.scan_iter(match=keys.pattern, count=1000))
    if stale:
        redis_client.delete(*stale)


@pytest.fixture
def no_egress(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every HTTP(S) proxy variable points at a dead port and only 127.0.0.1 is exempt, so a
    client that tried to leave for a real cloud fails at once instead of passing unseen."""
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(var, "127.0.0.1,localhost")


@pytest.fixture(scope="session")
def box_index() -> Iterator[Any]:
    """A package index of every wheel the agent needs (from this machine's wheels and PyPI,
    kept in ``~/.cache/spottrain-box``), which does not carry spottrain: the index a VM and
    the controller's lock resolution use in the box (tests/box/index.py)."""
    from box.index import LocalIndex, assemble_wheels, default_cache_dir

    wheels = assemble_wheels(default_cache_dir())
    with LocalIndex(wheels.path) as index:
        yield index
