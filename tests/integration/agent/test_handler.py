"""The redis rendezvous handler, several nodes in one process against a real Redis server:
formation, prompt restarts on loss, explicit leave, no split brain, fencing, Redis outages."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from spottrain.agent.rendezvous.config import RendezvousConfigError
from spottrain.agent.rendezvous.handler import RedisRendezvousHandler, create_handler
from spottrain.agent.rendezvous.membership import leave_node
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.ports import free_port
from spottrain.protocol.env import ENV_ROUND
from spottrain.protocol.keys import RunKeys

FAST = {"keep_alive_interval": 1, "keep_alive_max_attempt": 2, "last_call_timeout": 8}


def make_handler(
    endpoint: str, run_id: str, node_id: str, max_nodes: int = 3, **conf: Any
) -> RedisRendezvousHandler:
    params = RendezvousParameters(
        backend="redis",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=1,
        max_nodes=max_nodes,
        local_addr="127.0.0.1",
        **{**FAST, "node_id": node_id, **conf},
    )
    return create_handler(params)


@pytest.fixture
def handlers(
    redis_server: RedisServer, run_keys: RunKeys
) -> Iterator[list[RedisRendezvousHandler]]:
    made: list[RedisRendezvousHandler] = []
    yield made
    for h in made:
        h._stop_beating()
        h._backend.client.close()


def spawn(
    made: list[RedisRendezvousHandler], endpoint: str, run_id: str, n: int, **conf: Any
) -> list[RedisRendezvousHandler]:
    new = [make_handler(endpoint, run_id, f"node{len(made) + i}", **conf) for i in range(n)]
    made.extend(new)
    return new


def join_all(hs: list[RedisRendezvousHandler]) -> list[RendezvousInfo]:
    with ThreadPoolExecutor(len(hs)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), hs))


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.05) -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


def freeze(h: RedisRendezvousHandler) -> None:
    """What a SIGSTOP does to a node: its heartbeats stop."""
    h._stop_beating()


def thaw(h: RedisRendezvousHandler) -> None:
    h._ensure_beating()


def test_three_nodes_form_one_round_with_distinct_ranks(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    hs = spawn(handlers, redis_server.endpoint, run_keys.run_id, 3)
    infos = join_all(hs)
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    assert {h.round for h in hs} == {0}
    assert all(h.num_nodes_waiting() == 0 for h in hs)


def test_round_is_exported_to_workers_and_published_as_the_view(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    handlers: list[RedisRendezvousHandler],
) -> None:
    hs = spawn(handlers, redis_server.endpoint, run_keys.run_id, 1, max_nodes=1)
    hs[0].next_rendezvous()
    assert os.environ[ENV_ROUND] == str(hs[0].round)
    view = redis_client.hgetall(run_keys.rdzv_view)
    assert int(view[b"round"]) == hs[0].round
    assert view[b"world_size"] == b"1"


def test_survivors_are_told_to_restart_when_a_member_stops_heartbeating(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    a, b, c = spawn(handlers, redis_server.endpoint, run_keys.run_id, 3)
    join_all([a, b, c])
    freeze(c)
    waited = wait_until(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, 10)
    # dead after 2 s without a beat (1 s x 2), plus a sync: never torch's 30-minute collective.
    assert waited < 5
    infos = join_all([a, b])
    assert {i.world_size for i in infos} == {2}
    assert a.round is not None and a.round > 0


def test_reformed_round_completes_without_sitting_out_the_last_call(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    a, b, c = spawn(handlers, redis_server.endpoint, run_keys.run_id, 3, last_call_timeout=30)
    join_all([a, b, c])
    leave_node(a._backend.client, run_keys, "node2")
    wait_until(lambda: a.num_nodes_waiting() > 0, 5)
    start = time.monotonic()
    infos = join_all([a, b])
    assert {i.world_size for i in infos} == {2}
    assert time.monotonic() - start < 10  # the last call is 30 s


def test_explicit_leave_lets_peers_restart_with_no_heartbeat_wait(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    handlers: list[RedisRendezvousHandler],
) -> None:
    a, b, c = spawn(handlers, redis_server.endpoint, run_keys.run_id, 3, keep_alive_max_attempt=30)
    join_all([a, b, c])
    member = leave_node(redis_client, run_keys, "node2")
    assert member == c.member
    # The heartbeat timeout is 30 s here: the peers must not wait for it.
    waited = wait_until(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, 5)
    assert waited < 3
    # The node that left stops its workers at its next health check, and never rejoins.
    wait_until(lambda: c._gone_reason == "left", 3)
    with pytest.raises(SignalException):
        c.num_nodes_waiting()
    with pytest.raises(SignalException):
        c.next_rendezvous()
    assert {i.world_size for i in join_all([a, b])} == {2}


def test_leave_method_removes_the_node_itself(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    a, b = spawn(handlers, redis_server.endpoint, run_keys.run_id, 2, max_nodes=2)
    join_all([a, b])
    b.leave()
    wait_until(lambda: a.num_nodes_waiting() > 0, 3)
    assert b.member not in {repr(n) for n in a._holder.state.participants}
    assert b.shutdown() is True  # leaving is not closing: the job goes on
    assert not a.is_closed()


def test_leave_of_an_unknown_node_is_a_lookup_error(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    with pytest.raises(LookupError, match="no rendezvous member"):
        leave_node(redis_client, run_keys, "ghost")


def test_node_wrongly_declared_dead_rejoins_as_a_new_member_without_split_brain(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    a, b, c = spawn(handlers, redis_server.endpoint, run_keys.run_id, 3)
    join_all([a, b, c])
    old_member, old_round = c.member, c.round
    freeze(c)
    wait_until(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, 10)
    join_all([a, b])
    survivors_round = a.round
    assert survivors_round is not None and old_round is not None
    assert survivors_round > old_round

    thaw(c)  # the VM wakes up and believes it is still in round `old_round`
    wait_until(lambda: c.num_nodes_waiting() > 0, 15)  # ... but it is told to restart
    assert c._membership_change() is not None

    results: dict[str, Any] = {}

    def rejoin() -> None:
        try:
            results["c"] = c.next_rendezvous()
        except Exception as exc:  # surfaced by the assertion below
            results["error"] = exc

    t = threading.Thread(target=rejoin)
    t.start()
    # The woken node waits to join as a new member; the survivors see it waiting.
    wait_until(lambda: a.num_nodes_waiting() > 0, 20)
    assert c.member != old_member
    infos = join_all([a, b])
    t.join(60)
    assert "error" not in results, results.get("error")
    assert {i.world_size for i in [*infos, results["c"]]} == {3}
    participants = {repr(n) for n in a._holder.state.participants}
    assert old_member not in participants and c.member in participants
    assert a.round == b.round == c.round and a.round is not None and a.round > survivors_round


def test_redis_outage_does_not_stop_a_round_that_is_not_changing(
    tmp_path: Any, handlers: list[RedisRendezvousHandler]
) -> None:
    with RedisServer(data_dir=tmp_path) as server:
        hs = spawn(handlers, server.endpoint, RunKeys("outage-1").run_id, 2, max_nodes=2)
        join_all(hs)
        server.stop()
        # While Redis is down nobody is told to restart ...
        deadline = time.monotonic() + 4  # longer than the 2 s heartbeat timeout
        while time.monotonic() < deadline:
            assert [h.num_nodes_waiting() for h in hs] == [0, 0]
            time.sleep(0.2)
        server.start()
        # ... and once it is back, nobody is declared dead for the beats it missed.
        end = time.monotonic() + 5
        while time.monotonic() < end:
            assert [h.num_nodes_waiting() for h in hs] == [0, 0]
            time.sleep(0.2)
        assert all(h._gone_reason is None for h in hs)


def test_shutdown_after_success_closes_the_rendezvous(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    a, b = spawn(handlers, redis_server.endpoint, run_keys.run_id, 2, max_nodes=2)
    join_all([a, b])
    assert a.shutdown() is True
    wait_until(b.is_closed, 5)


def test_wrong_password_is_a_one_line_connection_error(tmp_path: Any) -> None:
    with RedisServer(data_dir=tmp_path, password="s3cret") as server:
        os.environ["SPOTTRAIN_TEST_PW"] = "wrong"
        try:
            with pytest.raises(RendezvousConnectionError) as info:
                make_handler(server.endpoint, "pw-1", "n", password_env="SPOTTRAIN_TEST_PW")
        finally:
            del os.environ["SPOTTRAIN_TEST_PW"]
        assert "refused the password" in str(info.value) and "\n" not in str(info.value)
        with pytest.raises(RendezvousConnectionError, match="requires a password"):
            make_handler(server.endpoint, "pw-1", "n", password_env="SPOTTRAIN_TEST_NOPE")


def test_correct_password_from_a_file_is_accepted(tmp_path: Any) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    with RedisServer(data_dir=tmp_path / "data", password="s3cret") as server:
        h = make_handler(server.endpoint, "pw-2", "n", max_nodes=1, password_file=str(secret))
        try:
            assert h.next_rendezvous().world_size == 1
        finally:
            h._stop_beating()


def test_unreachable_redis_is_a_one_line_connection_error() -> None:
    with pytest.raises(RendezvousConnectionError) as info:
        make_handler(f"127.0.0.1:{free_port()}", "x-1", "n", socket_timeout=1)
    assert "cannot reach Redis" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("endpoint", "conf", "needle"),
    [
        ("127.0.0.1:99999", {}, "port"),
        ("http://h:1", {}, "scheme"),
        ("127.0.0.1:6379", {"password": "x"}, "refused"),
        ("127.0.0.1:6379", {"keep_alive_interval": "fast"}, "keep_alive_interval"),
        ("127.0.0.1:6379", {"colour": "blue"}, "colour"),
    ],
)
def test_malformed_endpoint_or_conf_is_a_one_line_config_error(
    endpoint: str, conf: dict[str, Any], needle: str
) -> None:
    with pytest.raises(RendezvousConfigError) as info:
        make_handler(endpoint, "x-2", "n", **conf)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_node_declared_dead_while_joining_starts_over_as_a_new_member(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    a, b = spawn(handlers, redis_server.endpoint, run_keys.run_id, 2, max_nodes=2)
    writes = []
    original = a._backend.set_state

    def counting_set_state(state: bytes, token: Any = None) -> Any:
        writes.append(token)
        return original(state, token)

    a._backend.set_state = counting_set_state  # type: ignore[method-assign]
    results: dict[str, Any] = {}

    def join_a() -> None:
        try:
            results["a"] = a.next_rendezvous()
        except Exception as exc:  # surfaced by the assertion below
            results["error"] = exc

    t = threading.Thread(target=join_a)
    t.start()
    wait_until(lambda: len(writes) > 0, 10)  # a is inside torch's join, waiting for a peer
    old_member = a.member
    # What its peers do when a stalls for longer than the heartbeat timeout mid-join:
    a._backend.mark_gone([old_member], "dead")
    wait_until(lambda: a.member != old_member, 10)
    info_b = b.next_rendezvous()
    t.join(30)
    assert "error" not in results, results.get("error")
    assert {info_b.world_size, results["a"].world_size} == {2}
    assert old_member not in {repr(n) for n in b._holder.state.participants}
    # It started over once; it did not spin re-adding its dead identity.
    assert len(writes) < 50


def test_lost_compare_and_set_backs_off_before_retrying(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    (h,) = spawn(handlers, redis_server.endpoint, run_keys.run_id, 1, max_nodes=1)
    holder = h._holder
    # Another node wrote the state; this holder's writes carry no token, so each one loses.
    holder._backend.set_state(pickle.dumps(_RendezvousState()))
    start = time.monotonic()
    for _ in range(12):
        holder._dirty, holder._token = True, None
        assert holder.sync() is False
    assert holder._conflicts == 12
    # Jittered pauses doubling up to 100 ms: about 0.35 s expected over 12 losses.
    assert time.monotonic() - start > 0.05


def test_a_round_with_a_gap_in_its_ranks_is_refused_before_workers_start(
    redis_server: RedisServer, run_keys: RunKeys, handlers: list[RedisRendezvousHandler]
) -> None:
    from spottrain.agent.rendezvous.handler import BrokenRoundError

    (h,) = spawn(handlers, redis_server.endpoint, run_keys.run_id, 1)
    state = h._holder.state
    state.complete = True
    state.participants[h._this_node] = 1  # rank 0 was dropped after the round completed
    with pytest.raises(BrokenRoundError, match="ranks \\[1\\]"):
        h._get_world()
    state.participants[h._this_node] = 0
    assert h._get_world() == (0, 1)


def test_first_member_to_restart_ends_the_round_for_all_in_one_write(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    handlers: list[RedisRendezvousHandler],
) -> None:
    a, b, c = spawn(handlers, redis_server.endpoint, run_keys.run_id, 3)
    join_all([a, b, c])
    old_round = a.round
    assert old_round is not None
    leave_node(redis_client, run_keys, "node2")
    token_before = int(redis_client.hget(run_keys.rdzv_state, "token") or 0)
    a._dissolve_round()
    state = pickle.loads(redis_client.hget(run_keys.rdzv_state, "state") or b"")
    assert (state.round, state.complete, state.participants) == (old_round + 1, False, {})
    token_after = int(redis_client.hget(run_keys.rdzv_state, "token") or 0)
    assert token_after == token_before + 1
    b._dissolve_round()  # already ended: nothing to write
    assert int(redis_client.hget(run_keys.rdzv_state, "token") or 0) == token_after
    assert {i.world_size for i in join_all([a, b])} == {2}
