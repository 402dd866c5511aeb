"""The Redis rendezvous backend honours torch's RendezvousBackend contract (the one its c10d
and etcd backends follow), against a real Redis server."""

from __future__ import annotations

import pickle
import queue
import threading

import pytest
import redis
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)

from spottrain.agent.rendezvous.backend import MemberGoneError, RedisRendezvousBackend
from spottrain.protocol.keys import RunKeys
from spottrain.redis_conn import RedisSettings, connect


@pytest.fixture
def backend(
    redis_client: redis.Redis, redis_settings: RedisSettings, run_keys: RunKeys
) -> RedisRendezvousBackend:
    return RedisRendezvousBackend(redis_client, redis_settings, run_keys, ttl_s=3600)


def test_backend_is_named_redis(backend: RedisRendezvousBackend) -> None:
    assert backend.name == "redis"


def test_get_state_returns_none_when_nothing_is_stored(backend: RedisRendezvousBackend) -> None:
    assert backend.get_state() is None


def test_set_state_without_token_stores_when_nothing_exists(
    backend: RedisRendezvousBackend,
) -> None:
    result = backend.set_state(b"first", None)
    assert result is not None
    state, token, has_set = result
    assert (state, has_set) == (b"first", True)
    assert backend.get_state() == (b"first", token)


def test_set_state_without_token_does_not_overwrite_existing_state(
    backend: RedisRendezvousBackend,
) -> None:
    _, token, _ = backend.set_state(b"first") or (None, None, None)
    result = backend.set_state(b"second", None)
    assert result == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_set_state_with_current_token_stores_and_issues_a_new_token(
    backend: RedisRendezvousBackend,
) -> None:
    _, token1, _ = backend.set_state(b"first") or (None, None, None)
    result = backend.set_state(b"second", token1)
    assert result is not None
    state, token2, has_set = result
    assert (state, has_set) == (b"second", True)
    assert token2 != token1
    assert backend.get_state() == (b"second", token2)


def test_set_state_with_stale_token_returns_current_state_and_token(
    backend: RedisRendezvousBackend,
) -> None:
    _, token1, _ = backend.set_state(b"first") or (None, None, None)
    _, token2, _ = backend.set_state(b"second", token1) or (None, None, None)
    assert backend.set_state(b"third", token1) == (b"second", token2, False)
    assert backend.get_state() == (b"second", token2)


@pytest.mark.parametrize("bad_token", ["1", b"1", 1.0, -3, 0, True, object()])
def test_set_state_with_invalid_token_returns_current_state_without_setting(
    backend: RedisRendezvousBackend, bad_token: object
) -> None:
    _, token, _ = backend.set_state(b"first") or (None, None, None)
    assert backend.set_state(b"evil", bad_token) == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_set_state_with_token_when_nothing_is_stored_returns_none(
    backend: RedisRendezvousBackend,
) -> None:
    assert backend.set_state(b"x", 7) is None
    assert backend.get_state() is None


def test_state_round_trips_arbitrary_bytes(backend: RedisRendezvousBackend) -> None:
    blob = pickle.dumps({"nodes": list(range(1000))}) + bytes(range(256))
    backend.set_state(blob)
    got = backend.get_state()
    assert got is not None and got[0] == blob


def test_corrupt_state_of_wrong_type_raises_state_error(
    backend: RedisRendezvousBackend, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    redis_client.set(run_keys.rdzv_state, b"not a hash")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.set_state(b"x", None)


@pytest.mark.parametrize(
    "fields",
    [{"state": b"s"}, {"token": b"3"}, {"token": b"abc", "state": b"s"}],
    ids=["no-token", "no-state", "non-numeric-token"],
)
def test_corrupt_state_hash_raises_state_error(
    backend: RedisRendezvousBackend,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    fields: dict[str, bytes],
) -> None:
    redis_client.hset(run_keys.rdzv_state, mapping=fields)  # type: ignore[arg-type]
    with pytest.raises(RendezvousStateError):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"x", 1)


def test_lost_connection_raises_connection_error(run_keys: RunKeys) -> None:
    from spottrain.ports import free_port

    settings = RedisSettings(host="127.0.0.1", port=free_port(), socket_timeout=0.5)
    backend = RedisRendezvousBackend(connect(settings, retries=0), settings, run_keys, 3600)
    with pytest.raises(RendezvousConnectionError, match="cannot reach Redis"):
        backend.get_state()
    with pytest.raises(RendezvousConnectionError):
        backend.set_state(b"x")
    assert backend.seconds_since_failure() < 5


def test_every_write_refreshes_the_ttl(
    backend: RedisRendezvousBackend, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    _, token, _ = backend.set_state(b"a") or (None, None, None)
    assert 3500 < redis_client.ttl(run_keys.rdzv_state) <= 3600
    redis_client.expire(run_keys.rdzv_state, 10)
    backend.set_state(b"b", token)
    assert redis_client.ttl(run_keys.rdzv_state) > 3500
    # A heartbeat is a write too: it keeps a long, quiet job's state alive.
    redis_client.expire(run_keys.rdzv_state, 10)
    backend.heartbeat("node-a")
    assert redis_client.ttl(run_keys.rdzv_state) > 3500
    assert redis_client.ttl(run_keys.rdzv_presence) > 3500


def test_heartbeat_is_refused_for_a_gone_member(backend: RedisRendezvousBackend) -> None:
    backend.heartbeat("m1")
    backend.mark_gone(["m1"], "dead")
    with pytest.raises(MemberGoneError) as info:
        backend.heartbeat("m1")
    assert info.value.reason == "dead"
    assert backend.read_liveness(5).gone == {"m1": "dead"}


def test_liveness_reports_stale_members_by_the_redis_clock(
    backend: RedisRendezvousBackend, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    now = backend.heartbeat("fresh")
    redis_client.zadd(run_keys.rdzv_presence, {"old": now - 10_000})
    live = backend.read_liveness(5)
    assert live.stale == frozenset({"old"})
    assert live.live_count == 1
    assert abs(live.now_ms - now) < 5_000


def test_view_only_moves_forward(
    backend: RedisRendezvousBackend, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    backend.publish_view(3, 2, ["a", "b"])
    backend.publish_view(2, 3, ["a", "b", "c"])
    view = redis_client.hgetall(run_keys.rdzv_view)
    assert view[b"round"] == b"3" and view[b"world_size"] == b"2"


def _race(port: int, run_id: str, rounds: int, who: int, barrier: object, out: object) -> None:
    settings = RedisSettings(host="127.0.0.1", port=port)
    client = connect(settings)  # each writer has its own connection
    backend = RedisRendezvousBackend(client, settings, RunKeys(run_id), 3600)
    wins = []
    try:
        for r in range(rounds):
            barrier.wait()  # type: ignore[attr-defined]
            current = backend.get_state()
            token = current[1] if current else None
            barrier.wait()  # type: ignore[attr-defined]  # everyone holds the same token
            result = backend.set_state(f"round {r} by {who}".encode(), token)
            barrier.wait()  # type: ignore[attr-defined]
            if result is not None and result[2]:
                wins.append(r)
    finally:
        client.close()
    out.put((who, wins))  # type: ignore[attr-defined]


def test_racing_writers_on_separate_connections_have_exactly_one_winner_per_round(
    redis_server: object, run_keys: RunKeys
) -> None:
    # Threads, not processes: the barrier makes every writer hold the same token before any
    # writes, so the claim rests on Redis's compare-and-set across connections, not on the
    # writers running in parallel (six spawned interpreters cost 13 s of imports).
    n, rounds = 6, 25
    barrier = threading.Barrier(n, timeout=60)
    out: queue.Queue[tuple[int, list[int]]] = queue.Queue()
    port = redis_server.port  # type: ignore[attr-defined]
    writers = [
        threading.Thread(target=_race, args=(port, run_keys.run_id, rounds, i, barrier, out))
        for i in range(n)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
    results = [out.get_nowait() for _ in writers]
    winners_per_round = {r: 0 for r in range(rounds)}
    for _, wins in results:
        for r in wins:
            winners_per_round[r] += 1
    assert set(winners_per_round.values()) == {1}
