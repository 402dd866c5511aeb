"""RedisStore behaves like torch's own TCPStore.

The contract tests run unchanged over a real ``torch.distributed.TCPStore`` and over our
``RedisStore`` on a real Redis server, so every behaviour torchelastic relies on (blocking
reads, timeouts, atomic counters, compare-and-set, prefixes, the exit barrier) is checked
against the reference implementation. The RedisStore-only tests at the end cover what TCPStore
has no equivalent for: the key schema, TTLs, isolation between runs and an unreachable server.

A blocking read on a TCPStore handle holds that handle's socket, so anything "another node"
does runs on a second handle from ``StoreUnderTest.connect``, as it would in real life.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import redis
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier

from spottrain.agent.rendezvous.store import RedisStore
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.redis_conn import RedisSettings, connect

# Every handle's default timeout: long enough for slow CI, short enough that a hang fails fast.
DEFAULT_TIMEOUT = timedelta(seconds=5)
# The timeout the tests that expect a timeout set, to keep the file quick.
SHORT_TIMEOUT = timedelta(seconds=0.3)
# How much later than its timeout a timed-out read may return (scheduling, polling).
SLACK_S = 1.5

EARLY_TIMEOUT_BUG = (
    "RedisStore gives up before its timeout: multi_get/wait raise as soon as "
    "`now + delay > deadline`, i.e. up to one poll interval (50 ms) early, where TCPStore "
    "always waits the full timeout"
)
ZERO_TIMEOUT_BUG = (
    "RedisStore.wait(keys, timedelta(0)) waits the store's default timeout: "
    "`timeout or self.timeout` treats a zero timedelta as 'not given'; TCPStore fails at once"
)


@dataclass
class StoreUnderTest:
    """One store implementation: ``store`` is the handle under test, ``connect`` opens
    another handle on the same data, as a second agent would."""

    name: str
    store: dist.Store
    connect: Callable[[], dist.Store]
    handles: list[dist.Store] = field(default_factory=list)


def _tcp_store_under_test() -> Iterator[StoreUnderTest]:
    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size=1,
        is_master=True,
        timeout=DEFAULT_TIMEOUT,
        wait_for_workers=False,
        multi_tenant=False,
    )
    handles: list[dist.Store] = []

    def open_client() -> dist.Store:
        client = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size=1,
            is_master=False,
            timeout=DEFAULT_TIMEOUT,
            multi_tenant=False,
        )
        handles.append(client)
        return client

    sut = StoreUnderTest("tcp", master, open_client, handles)
    yield sut
    # TCPStore has no close(): dropping every reference shuts the server and clients down.
    sut.store = None  # type: ignore[assignment]
    handles.clear()
    del master, sut
    gc.collect()
    deadline = time.monotonic() + 5
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                break
        assert time.monotonic() < deadline, f"TCPStore server on port {port} is still up"
        time.sleep(0.05)


def _redis_store_under_test(request: pytest.FixtureRequest) -> Iterator[StoreUnderTest]:
    client: redis.Redis = request.getfixturevalue("redis_client")
    settings: RedisSettings = request.getfixturevalue("redis_settings")
    keys: RunKeys = request.getfixturevalue("run_keys")
    clients: list[redis.Redis] = []
    handles: list[dist.Store] = []

    def open_client() -> dist.Store:
        own = connect(settings)
        clients.append(own)
        handle = RedisStore(own, settings, keys, ttl_s=3600, timeout=DEFAULT_TIMEOUT)
        handles.append(handle)
        return handle

    store = RedisStore(client, settings, keys, ttl_s=3600, timeout=DEFAULT_TIMEOUT)
    yield StoreUnderTest("redis", store, open_client, handles)
    handles.clear()
    for own in clients:
        own.close()


@pytest.fixture(params=["tcp", "redis"])
def backend(request: pytest.FixtureRequest) -> Iterator[StoreUnderTest]:
    if request.param == "tcp":
        yield from _tcp_store_under_test()
    else:
        yield from _redis_store_under_test(request)


def later(delay_s: float, action: Callable[[], object]) -> threading.Timer:
    timer = threading.Timer(delay_s, action)
    timer.daemon = True
    timer.start()
    return timer


def timed(action: Callable[[], object]) -> float:
    start = time.monotonic()
    action()
    return time.monotonic() - start


def timed_failure(action: Callable[[], object], exc: type[Exception]) -> float:
    start = time.monotonic()
    with pytest.raises(exc):
        action()
    return time.monotonic() - start


# -- set / get --------------------------------------------------------------------------------


def test_a_str_value_reads_back_as_bytes(backend: StoreUnderTest) -> None:
    backend.store.set("greeting", "héllo")
    value = backend.store.get("greeting")
    assert isinstance(value, bytes)
    assert value == "héllo".encode()


def test_a_bytes_value_reads_back_byte_for_byte(backend: StoreUnderTest) -> None:
    payload = bytes(range(256))
    backend.store.set("blob", payload)
    assert backend.store.get("blob") == payload


def test_an_empty_value_is_stored_and_read_back_as_empty_bytes(backend: StoreUnderTest) -> None:
    backend.store.set("empty", "")
    assert backend.store.get("empty") == b""
    assert backend.store.check(["empty"]) is True


def test_setting_a_key_again_replaces_its_value(backend: StoreUnderTest) -> None:
    backend.store.set("k", "first")
    backend.store.set("k", "second")
    assert backend.store.get("k") == b"second"


def test_a_value_set_on_one_handle_is_read_on_another(backend: StoreUnderTest) -> None:
    backend.store.set("shared", "v")
    assert backend.connect().get("shared") == b"v"


def test_get_blocks_until_another_client_sets_the_key(backend: StoreUnderTest) -> None:
    peer = backend.connect()
    timer = later(0.2, lambda: peer.set("late", "arrived"))
    start = time.monotonic()
    value = backend.store.get("late")
    elapsed = time.monotonic() - start
    timer.join()
    assert value == b"arrived"
    assert 0.15 <= elapsed < DEFAULT_TIMEOUT.total_seconds()


def test_get_of_a_missing_key_raises_dist_store_error_after_the_store_timeout(
    backend: StoreUnderTest,
) -> None:
    backend.store.set_timeout(SHORT_TIMEOUT)
    assert backend.store.timeout == SHORT_TIMEOUT
    elapsed = timed_failure(lambda: backend.store.get("never-set"), dist.DistStoreError)
    limit = SHORT_TIMEOUT.total_seconds()
    assert limit * 0.8 <= elapsed < limit + SLACK_S


def test_get_never_gives_up_before_the_store_timeout_has_passed(
    backend: StoreUnderTest, request: pytest.FixtureRequest
) -> None:
    timeout = timedelta(seconds=0.2)
    backend.store.set_timeout(timeout)
    # Three tries, so a lucky poll that lands just past the deadline cannot hide the bug.
    elapsed = [
        timed_failure(lambda: backend.store.get("never-set"), dist.DistStoreError) for _ in range(3)
    ]
    assert min(elapsed) >= timeout.total_seconds() - 0.001, elapsed


# -- add --------------------------------------------------------------------------------------


def test_add_creates_a_missing_key_and_returns_the_new_value(backend: StoreUnderTest) -> None:
    assert backend.store.add("counter", 3) == 3
    assert backend.store.get("counter") == b"3"


def test_add_increments_and_returns_the_new_value(backend: StoreUnderTest) -> None:
    backend.store.add("counter", 3)
    assert backend.store.add("counter", 4) == 7
    assert backend.store.add("counter", -10) == -3
    assert backend.store.add("counter", 0) == -3
    assert backend.store.get("counter") == b"-3"


def test_add_counts_on_from_a_number_written_with_set(backend: StoreUnderTest) -> None:
    backend.store.set("counter", "5")
    assert backend.store.add("counter", 2) == 7


def test_add_from_many_handles_at_once_loses_no_increment(backend: StoreUnderTest) -> None:
    handles = [backend.connect() for _ in range(4)]

    def bump(store: dist.Store) -> list[int]:
        return [int(store.add("hits", 1)) for _ in range(25)]

    with ThreadPoolExecutor(max_workers=len(handles)) as pool:
        seen = [v for values in pool.map(bump, handles) for v in values]
    assert sorted(seen) == list(range(1, 101))
    assert backend.store.get("hits") == b"100"


# -- compare_set ------------------------------------------------------------------------------


def test_compare_set_on_a_missing_key_with_empty_expected_sets_it(backend: StoreUnderTest) -> None:
    assert backend.store.compare_set("cas", "", "desired") == b"desired"
    assert backend.store.get("cas") == b"desired"


def test_compare_set_on_a_missing_key_with_other_expected_returns_expected_and_sets_nothing(
    backend: StoreUnderTest,
) -> None:
    assert backend.store.compare_set("cas", "expected", "desired") == b"expected"
    assert backend.store.check(["cas"]) is False


def test_compare_set_with_matching_expected_sets_and_returns_desired(
    backend: StoreUnderTest,
) -> None:
    backend.store.set("cas", "old")
    assert backend.store.compare_set("cas", "old", "new") == b"new"
    assert backend.store.get("cas") == b"new"


def test_compare_set_with_mismatching_expected_returns_current_and_keeps_it(
    backend: StoreUnderTest,
) -> None:
    backend.store.set("cas", "current")
    assert backend.store.compare_set("cas", "stale", "new") == b"current"
    assert backend.store.get("cas") == b"current"


def test_compare_set_with_empty_expected_does_not_overwrite_an_existing_key(
    backend: StoreUnderTest,
) -> None:
    backend.store.set("cas", "current")
    assert backend.store.compare_set("cas", "", "new") == b"current"
    assert backend.store.get("cas") == b"current"


def test_compare_set_matches_an_existing_empty_value(backend: StoreUnderTest) -> None:
    backend.store.set("cas", "")
    assert backend.store.compare_set("cas", "", "filled") == b"filled"
    assert backend.store.get("cas") == b"filled"


def test_compare_set_handles_binary_values(backend: StoreUnderTest) -> None:
    assert backend.store.compare_set("cas", b"", b"\x00\xff") == b"\x00\xff"
    assert backend.store.compare_set("cas", b"\x00\xff", b"\xfe\x00") == b"\xfe\x00"
    assert backend.store.get("cas") == b"\xfe\x00"


# -- wait -------------------------------------------------------------------------------------


def test_wait_for_keys_that_exist_returns_at_once(backend: StoreUnderTest) -> None:
    backend.store.set("a", "1")
    backend.store.set("b", "2")
    assert timed(lambda: backend.store.wait(["a", "b"])) < 0.5
    assert timed(lambda: backend.store.wait(["a", "b"], timedelta(seconds=1))) < 0.5


def test_wait_without_timeout_returns_once_another_client_sets_every_key(
    backend: StoreUnderTest,
) -> None:
    peer = backend.connect()
    backend.store.set("a", "1")
    timer = later(0.2, lambda: peer.multi_set(["b", "c"], ["2", "3"]))
    elapsed = timed(lambda: backend.store.wait(["a", "b", "c"]))
    timer.join()
    assert 0.15 <= elapsed < DEFAULT_TIMEOUT.total_seconds()
    assert backend.store.check(["a", "b", "c"]) is True


def test_wait_with_explicit_timeout_returns_once_another_client_sets_the_key(
    backend: StoreUnderTest,
) -> None:
    peer = backend.connect()
    timer = later(0.2, lambda: peer.set("late", "v"))
    elapsed = timed(lambda: backend.store.wait(["late"], timedelta(seconds=3)))
    timer.join()
    assert 0.15 <= elapsed < 3


def test_wait_without_timeout_raises_dist_store_error_after_the_store_timeout(
    backend: StoreUnderTest,
) -> None:
    backend.store.set_timeout(SHORT_TIMEOUT)
    elapsed = timed_failure(lambda: backend.store.wait(["never-set"]), dist.DistStoreError)
    limit = SHORT_TIMEOUT.total_seconds()
    assert limit * 0.8 <= elapsed < limit + SLACK_S


def test_wait_with_explicit_timeout_raises_dist_store_error_after_that_timeout(
    backend: StoreUnderTest,
) -> None:
    # The store's own timeout is 5 s: the explicit 0.3 s must win.
    timeout = timedelta(seconds=0.3)
    elapsed = timed_failure(lambda: backend.store.wait(["never-set"], timeout), dist.DistStoreError)
    assert timeout.total_seconds() * 0.8 <= elapsed < timeout.total_seconds() + SLACK_S


def test_wait_with_explicit_timeout_longer_than_the_store_timeout_keeps_waiting(
    backend: StoreUnderTest,
) -> None:
    backend.store.set_timeout(timedelta(seconds=0.2))
    peer = backend.connect()
    timer = later(0.5, lambda: peer.set("late", "v"))
    elapsed = timed(lambda: backend.store.wait(["late"], timedelta(seconds=3)))
    timer.join()
    assert 0.45 <= elapsed < 3


def test_wait_raises_when_only_some_of_the_keys_exist(backend: StoreUnderTest) -> None:
    backend.store.set("present", "1")
    with pytest.raises(dist.DistStoreError):
        backend.store.wait(["present", "absent"], timedelta(seconds=0.2))


def test_wait_never_gives_up_before_its_explicit_timeout_has_passed(
    backend: StoreUnderTest, request: pytest.FixtureRequest
) -> None:
    timeout = timedelta(seconds=0.2)
    elapsed = [
        timed_failure(lambda: backend.store.wait(["never-set"], timeout), dist.DistStoreError)
        for _ in range(3)
    ]
    assert min(elapsed) >= timeout.total_seconds() - 0.001, elapsed


def test_wait_with_a_zero_timeout_fails_at_once_for_a_missing_key(
    backend: StoreUnderTest, request: pytest.FixtureRequest
) -> None:
    backend.store.set_timeout(timedelta(seconds=0.6))
    elapsed = timed_failure(
        lambda: backend.store.wait(["never-set"], timedelta(0)), dist.DistStoreError
    )
    assert elapsed < 0.2


def test_wait_for_no_keys_returns_at_once(backend: StoreUnderTest) -> None:
    assert timed(lambda: backend.store.wait([])) < 0.5


# -- check / delete_key -----------------------------------------------------------------------


def test_check_is_true_only_when_every_key_exists_and_never_blocks(
    backend: StoreUnderTest,
) -> None:
    backend.store.set("a", "1")
    backend.store.set("b", "2")
    start = time.monotonic()
    assert backend.store.check(["a"]) is True
    assert backend.store.check(["a", "b"]) is True
    assert backend.store.check(["a", "missing"]) is False
    assert backend.store.check(["missing"]) is False
    assert backend.store.check([]) is True
    assert time.monotonic() - start < 1


def test_delete_key_returns_true_then_false_and_removes_the_key(
    backend: StoreUnderTest,
) -> None:
    backend.store.set("doomed", "v")
    assert backend.store.delete_key("doomed") is True
    assert backend.store.check(["doomed"]) is False
    assert backend.store.delete_key("doomed") is False


def test_a_deleted_key_can_be_set_again(backend: StoreUnderTest) -> None:
    backend.store.set("k", "old")
    backend.store.delete_key("k")
    backend.store.set("k", "new")
    assert backend.store.get("k") == b"new"


# -- append -----------------------------------------------------------------------------------


def test_append_creates_a_missing_key_and_then_extends_it(backend: StoreUnderTest) -> None:
    backend.store.append("log", "ab")
    backend.store.append("log", b"\x00cd")
    assert backend.store.get("log") == b"ab\x00cd"


# -- multi_set / multi_get --------------------------------------------------------------------


def test_multi_set_then_multi_get_returns_the_values_in_key_order(
    backend: StoreUnderTest,
) -> None:
    backend.store.multi_set(["x", "y", "z"], ["1", b"\x00\x01", ""])
    assert backend.store.multi_get(["z", "x", "y"]) == [b"", b"1", b"\x00\x01"]
    assert backend.store.get("y") == b"\x00\x01"


def test_multi_get_of_no_keys_returns_an_empty_list(backend: StoreUnderTest) -> None:
    assert backend.store.multi_get([]) == []


def test_multi_get_blocks_until_another_client_sets_the_missing_keys(
    backend: StoreUnderTest,
) -> None:
    peer = backend.connect()
    backend.store.set("x", "1")
    timer = later(0.2, lambda: peer.set("y", "2"))
    start = time.monotonic()
    values = backend.store.multi_get(["x", "y"])
    elapsed = time.monotonic() - start
    timer.join()
    assert values == [b"1", b"2"]
    assert elapsed >= 0.15


def test_multi_get_raises_dist_store_error_when_a_key_stays_missing(
    backend: StoreUnderTest,
) -> None:
    backend.store.set_timeout(SHORT_TIMEOUT)
    backend.store.set("x", "1")
    elapsed = timed_failure(lambda: backend.store.multi_get(["x", "absent"]), dist.DistStoreError)
    assert elapsed < SHORT_TIMEOUT.total_seconds() + SLACK_S


# -- num_keys ---------------------------------------------------------------------------------


def test_num_keys_grows_by_the_number_of_new_keys_only(backend: StoreUnderTest) -> None:
    # TCPStore counts keys of its own, so only differences are comparable.
    before = backend.store.num_keys()
    backend.store.set("n1", "1")
    backend.store.multi_set(["n2", "n3"], ["2", "3"])
    backend.store.add("n4", 1)
    assert backend.store.num_keys() - before == 4
    backend.store.set("n1", "again")
    backend.store.add("n4", 1)
    assert backend.store.num_keys() - before == 4
    backend.store.delete_key("n2")
    assert backend.store.num_keys() - before == 3


# -- PrefixStore ------------------------------------------------------------------------------


def test_a_prefix_store_sets_and_gets_under_its_prefix(backend: StoreUnderTest) -> None:
    prefixed = dist.PrefixStore("worker", backend.store)
    prefixed.set("addr", "10.0.0.1:29500")
    assert prefixed.get("addr") == b"10.0.0.1:29500"
    assert backend.store.get("worker/addr") == b"10.0.0.1:29500"
    assert backend.store.check(["addr"]) is False


def test_two_prefix_stores_on_one_store_do_not_share_keys(backend: StoreUnderTest) -> None:
    first = dist.PrefixStore("first", backend.store)
    second = dist.PrefixStore("second", backend.store)
    first.set("k", "1")
    second.set("k", "2")
    assert (first.get("k"), second.get("k")) == (b"1", b"2")


def test_a_prefix_store_adds_under_its_prefix(backend: StoreUnderTest) -> None:
    prefixed = dist.PrefixStore("worker", backend.store)
    assert prefixed.add("count", 2) == 2
    assert prefixed.add("count", 3) == 5
    assert backend.store.get("worker/count") == b"5"


def test_a_prefix_store_wait_returns_once_the_prefixed_key_is_set(
    backend: StoreUnderTest,
) -> None:
    prefixed = dist.PrefixStore("worker", backend.store)
    # Keep the wrapped handle referenced: a Python Store that only C++ holds loses its methods.
    peer_handle = backend.connect()
    peer = dist.PrefixStore("worker", peer_handle)
    timer = later(0.2, lambda: peer.set("ready", "1"))
    elapsed = timed(lambda: prefixed.wait(["ready"]))
    timer.join()
    assert 0.15 <= elapsed < DEFAULT_TIMEOUT.total_seconds()
    prefixed.wait(["ready"], timedelta(seconds=1))


def test_a_prefix_store_wait_times_out_with_dist_store_error(backend: StoreUnderTest) -> None:
    prefixed = dist.PrefixStore("worker", backend.store)
    backend.store.set("ready", "set without the prefix")
    timeout = timedelta(seconds=0.3)
    elapsed = timed_failure(lambda: prefixed.wait(["ready"], timeout), dist.DistStoreError)
    assert elapsed < timeout.total_seconds() + SLACK_S


def test_a_prefix_store_uses_the_timeout_of_the_store_it_wraps(backend: StoreUnderTest) -> None:
    backend.store.set_timeout(SHORT_TIMEOUT)
    prefixed = dist.PrefixStore("worker", backend.store)
    assert prefixed.timeout == SHORT_TIMEOUT
    elapsed = timed_failure(lambda: prefixed.get("never-set"), dist.DistStoreError)
    assert elapsed < SHORT_TIMEOUT.total_seconds() + SLACK_S


# -- torchelastic's exit barrier --------------------------------------------------------------


def test_the_exit_barrier_releases_three_agents_only_once_all_three_arrive(
    backend: StoreUnderTest,
) -> None:
    handles = [backend.connect() for _ in range(3)]

    def arrive(store: dist.Store) -> float:
        barrier(store, world_size=3, key_prefix="torchelastic/agent/exit", barrier_timeout=10)
        return time.monotonic()

    with ThreadPoolExecutor(max_workers=3) as pool:
        early = [pool.submit(arrive, store) for store in handles[:2]]
        time.sleep(0.3)
        assert not any(f.done() for f in early), "the barrier let agents through before all came"
        last_arrival = time.monotonic()
        last = pool.submit(arrive, handles[2])
        released = [f.result(timeout=10) for f in [*early, last]]
    assert all(t >= last_arrival for t in released)
    assert backend.store.get("torchelastic/agent/exit/num_members") == b"3"


def test_the_exit_barrier_times_out_with_dist_store_error_when_an_agent_is_missing(
    backend: StoreUnderTest,
) -> None:
    handles = [backend.connect() for _ in range(2)]

    def arrive(store: dist.Store) -> None:
        barrier(store, world_size=3, key_prefix="exit", barrier_timeout=0.3)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(arrive, store) for store in handles]
        errors = [f.exception(timeout=10) for f in futures]
    assert all(isinstance(e, dist.DistStoreError) for e in errors), errors
    assert backend.store.get("exit/num_members") == b"2"


# -- RedisStore only --------------------------------------------------------------------------


@pytest.fixture
def redis_store(
    redis_client: redis.Redis, redis_settings: RedisSettings, run_keys: RunKeys
) -> RedisStore:
    return RedisStore(redis_client, redis_settings, run_keys, ttl_s=3600, timeout=DEFAULT_TIMEOUT)


def test_every_write_lands_under_the_run_store_key_with_a_ttl(
    redis_store: RedisStore, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    redis_store.set("set", "v")
    redis_store.multi_set(["multi1", "multi2"], ["1", "2"])
    redis_store.add("add", 1)
    redis_store.compare_set("cas", "", "v")
    redis_store.append("append", "v")
    written = ["set", "multi1", "multi2", "add", "cas", "append"]
    found = {k.decode() for k in redis_client.scan_iter(match=run_keys.pattern)}
    assert found == {run_keys.store_key(k) for k in written}
    for key in written:
        ttl_ms = redis_client.pttl(run_keys.store_key(key))
        assert 3_590_000 < ttl_ms <= 3_600_000, (key, ttl_ms)
    assert redis_client.get(run_keys.store_key("set")) == b"v"
    assert redis_store.num_keys() == len(written)


def test_stores_of_two_runs_do_not_see_each_others_keys(
    redis_client: redis.Redis, redis_settings: RedisSettings, run_keys: RunKeys
) -> None:
    other_keys = RunKeys(f"t-{uuid.uuid4().hex[:12]}")
    ours = RedisStore(redis_client, redis_settings, run_keys, ttl_s=3600)
    theirs = RedisStore(
        redis_client, redis_settings, other_keys, ttl_s=3600, timeout=timedelta(seconds=0.3)
    )
    try:
        ours.set("addr", "ours")
        ours.add("count", 5)
        assert theirs.check(["addr"]) is False
        assert theirs.num_keys() == 0
        with pytest.raises(dist.DistStoreError):
            theirs.get("addr")
        theirs.set("addr", "theirs")
        assert theirs.add("count", 1) == 1
        assert ours.get("addr") == b"ours"
        assert ours.get("count") == b"5"
        assert ours.num_keys() == theirs.num_keys() == 2
    finally:
        stale = list(redis_client.scan_iter(match=other_keys.pattern))
        if stale:
            redis_client.delete(*stale)


UNREACHABLE_OPERATIONS: dict[str, Callable[[dist.Store], object]] = {
    "set": lambda s: s.set("k", "v"),
    "get": lambda s: s.get("k"),
    "add": lambda s: s.add("k", 1),
    "compare_set": lambda s: s.compare_set("k", "", "v"),
    "append": lambda s: s.append("k", "v"),
    "delete_key": lambda s: s.delete_key("k"),
    "check": lambda s: s.check(["k"]),
    "wait": lambda s: s.wait(["k"], timedelta(seconds=2)),
    "multi_set": lambda s: s.multi_set(["k"], ["v"]),
    "multi_get": lambda s: s.multi_get(["k"]),
    "num_keys": lambda s: s.num_keys(),
}


@pytest.mark.parametrize("operation", list(UNREACHABLE_OPERATIONS))
def test_a_store_whose_redis_is_unreachable_raises_dist_network_error(operation: str) -> None:
    settings = RedisSettings(host="127.0.0.1", port=free_port(), socket_timeout=0.5)
    client = connect(settings, retries=0)
    store = RedisStore(client, settings, RunKeys("t-unreachable"), ttl_s=60)
    try:
        start = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match="cannot reach Redis") as info:
            UNREACHABLE_OPERATIONS[operation](store)
        assert time.monotonic() - start < 1.5
        assert settings.address in str(info.value)
    finally:
        client.close()
