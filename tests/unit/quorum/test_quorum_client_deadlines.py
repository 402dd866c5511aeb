"""The quorum client's deadlines that need no Redis server: no blocking command outlasts its
connection's socket timeout, whatever the heartbeat timeout (the auto one reaches 40 s at
100,000 replicas); no try is started that could only send and give up; and no command
follows the last WAIT (the connected replicas for the message come with it)."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
import redis

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import confirm
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumNotReplicated, QuorumRedisRefused, QuorumTimeout
from spottrain.quorum.model import QuorumConfig
from spottrain.spec.fields import MAX_NODES
from spottrain.spec.heartbeat import HEARTBEAT_TIMEOUT_S_RANGE, auto_heartbeat_timeout_s

KEYS = RunKeys("client-deadlines-test")


def _client(socket_timeout: float | None, heartbeat_s: float, **kw: Any) -> QuorumClient:
    # Nothing is sent: redis-py connects on the first command.
    config = QuorumConfig(heartbeat_timeout_ms=round(heartbeat_s * 1000), join_timeout_ms=250)
    return QuorumClient(redis.Redis(socket_timeout=socket_timeout), KEYS, config, **kw)


@pytest.mark.parametrize(
    "heartbeat_s",
    [
        auto_heartbeat_timeout_s(MAX_NODES),  # 40 s: a 10 s slice, 12 s with its jitter
        auto_heartbeat_timeout_s(50_000),  # 20 s: a 6 s slice at its longest
        HEARTBEAT_TIMEOUT_S_RANGE[1],  # the spec's longest explicit timeout
    ],
)
def test_no_blocking_slice_outlasts_the_connections_socket_timeout(heartbeat_s: float) -> None:
    client = _client(5.0, heartbeat_s)  # RedisSettings' default socket timeout
    longest = client._slice_s(1.2)  # the BLPOP's jitter at its longest
    # Redis may end it a timer tick late; the reply still arrives inside the socket timeout.
    assert longest + confirm.REDIS_LATE_S + confirm.SOCKET_MARGIN_S <= 5.0 + 1e-9
    assert longest == pytest.approx(5.0 - confirm.REDIS_LATE_S - confirm.SOCKET_MARGIN_S)
    # Without a socket timeout nothing is cut: the slice stays a quarter of the timeout.
    assert _client(None, heartbeat_s)._slice_s(1.2) == pytest.approx(heartbeat_s / 4 * 1.2)


def test_a_slice_shorter_than_the_socket_timeout_is_kept() -> None:
    assert _client(5.0, 1.0)._slice_s() == pytest.approx(0.25)
    assert _client(5.0, 10.0)._slice_s(0.8) == pytest.approx(2.0)


def test_the_longest_block_leaves_the_reply_its_way_back() -> None:
    assert confirm.longest_block_s(None) is None
    assert confirm.longest_block_s(5.0) == pytest.approx(4.65)
    assert confirm.longest_block_s(0.2) == confirm.MIN_BLOCK_S  # never 0: blocks for ever


@pytest.mark.parametrize(
    "error",
    [
        redis.ConnectionError("Connection refused"),
        redis.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    ],
)
def test_a_back_off_with_no_try_left_raises_at_once_instead_of_sleeping(
    error: Exception,
) -> None:
    # Less than a blocking command's room is left: a try would send a REQUEST and a TICK
    # withdraw, bounded only by the socket timeout. Raised without sleeping at all.
    client = _client(5.0, 1.0)
    expected = QuorumRedisRefused if isinstance(error, redis.ResponseError) else QuorumTimeout
    with pytest.raises(expected):
        client._back_off(4, time.monotonic() + confirm.REDIS_LATE_S, error)
    with pytest.raises(expected):
        client._back_off(1, time.monotonic() - 1.0, error)


def test_a_back_off_with_time_left_returns_for_another_try() -> None:
    _client(5.0, 1.0)._back_off(1, time.monotonic() + 60.0, redis.ConnectionError("x"))


class _Pipe:
    """A pipeline that records its commands; WAIT blocks for its timeout, acknowledged by
    none of the two replicas connected."""

    def __init__(self, sent: list[list[str]]) -> None:
        self.sent, self.commands = sent, cast(list[str], [])

    def set(self, *args: object) -> None:
        self.commands.append("SET")

    def execute_command(self, name: str, need: int, ms: int) -> None:
        self.commands.append(name)
        self.ms = ms

    def info(self, section: str) -> None:
        self.commands.append(f"INFO {section}")

    def execute(self, raise_on_error: bool = True) -> list[object]:
        self.sent.append(self.commands)
        time.sleep(self.ms / 1000)
        counted = [{"connected_slaves": 2}] if self.commands[-1].startswith("INFO") else []
        return [True, 0, *counted]


class _Redis:
    connection_pool = redis.ConnectionPool()

    def __init__(self) -> None:
        self.sent: list[list[str]] = []

    def register_script(self, source: str) -> None:
        return None

    def pipeline(self, transaction: bool = True) -> _Pipe:
        return _Pipe(self.sent)

    def info(self, section: str) -> dict[str, object]:
        raise AssertionError("a command after the last WAIT, past the deadline")


def test_the_last_wait_brings_the_connected_replicas_and_nothing_follows_it() -> None:
    fake = _Redis()
    config = QuorumConfig(heartbeat_timeout_ms=40_000, join_timeout_ms=250)
    client = QuorumClient(cast(redis.Redis, fake), KEYS, config, wait_replicas=1)
    with pytest.raises(QuorumNotReplicated) as err:
        confirm.confirm(client, time.monotonic() + 1.0, "quorum 3 for replica a")
    assert "only 0 of the 1 Redis replicas" in str(err.value)
    assert "the primary has 2 connected" in str(err.value)
    # The WAIT cut by the deadline carried the INFO, in its own round trip.
    assert fake.sent[-1] == ["SET", "WAIT", "INFO replication"]
