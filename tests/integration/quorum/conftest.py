"""Fixtures for the Redis quorum's tests: a client factory on the session's Redis, and
replicas that heartbeat from a thread like the agent's shim does."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import redis

from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.model import Answer, Member, QuorumConfig

# Small timeouts keep the tests fast; deadlines stay generous for a loaded machine.
FAST = QuorumConfig(heartbeat_timeout_ms=500, join_timeout_ms=150, min_replicas=1)


class Heartbeater:
    """Heartbeats a set of replica ids every timeout/5 (coalesced, as one VM does)."""

    def __init__(self, client: QuorumClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self.ids: set[str] = set()
        self.paused: set[str] = set()
        self.gone: set[str] = set()
        self.errors: list[Exception] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            ids = sorted(self.ids - self.paused - self.gone)
            try:
                self.gone.update(self.client.heartbeat(ids))
            except (redis.ConnectionError, redis.TimeoutError) as e:
                self.errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Fleet:
    """Replicas sharing one QuorumClient (one VM) with one heartbeat thread."""

    def __init__(self, client: QuorumClient, config: QuorumConfig) -> None:
        self.client = client
        self.config = config
        self.hb = Heartbeater(client, config.heartbeat_timeout_ms / 5000)
        self.pool = ThreadPoolExecutor(max_workers=16)

    def add(self, *replica_ids: str) -> None:
        for rid in replica_ids:
            self.client.join(Member(rid, address=f"http://{rid}", store_address=f"{rid}:1"))
            self.hb.ids.add(rid)
        self.client.heartbeat(list(replica_ids))

    def ask(
        self, replica_id: str, step: int, timeout: float = 20.0, **kw: object
    ) -> Future[Answer]:
        return self.pool.submit(self.client.request, replica_id, step, timeout=timeout, **kw)  # type: ignore[arg-type]

    def round(self, steps: dict[str, int], timeout: float = 20.0) -> dict[str, Answer]:
        futures = {rid: self.ask(rid, step, timeout) for rid, step in steps.items()}
        return {rid: f.result(timeout + 10) for rid, f in futures.items()}

    def close(self) -> None:
        self.hb.stop()
        self.pool.shutdown(wait=True, cancel_futures=True)


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
