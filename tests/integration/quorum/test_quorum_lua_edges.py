"""The quorum's Lua at its edges, in a real Redis: numbers Lua cannot hold exactly are refused
before they reach it (Lua's numbers are doubles), and the stall guard neither starves a
waiter whose replica heartbeats seldom nor takes a first heartbeat for a loss of Redis's
data."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.model import BatchItem, Member, QuorumConfig


def test_a_step_lua_cannot_hold_exactly_is_refused_with_a_clear_error(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    client = QuorumClient(redis_client, run_keys, QuorumConfig(10_000, 50, 1))
    client.join(Member("a"))
    client.heartbeat(["a"])
    top = 2**53 - 1  # the largest integer a Lua number (a double) holds with its successor
    assert client.request("a", top, timeout=10).max_step == top  # exact at the edge
    for step in (2**63, 2**53 + 1, -(2**63)):
        with pytest.raises(ValueError, match=r"step .* out of the Redis quorum's range"):
            client.request("a", step, timeout=10)
        with pytest.raises(ValueError, match="out of the Redis quorum's range"):
            scripts.relay_args("r:1", [BatchItem("a", step)], [0])


def test_a_huge_held_quorum_id_never_makes_ids_go_back(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    client = QuorumClient(redis_client, run_keys, QuorumConfig(10_000, 50, 1))
    client.join(Member("a"))
    client.heartbeat(["a"])
    first = client.request("a", 1, timeout=10).quorum_id
    with pytest.raises(ValueError, match=r"quorum id .* out of the Redis quorum's range"):
        client.request("a", 2, held_quorum_id=2**63, timeout=10)
    top = 2**52  # ids past it still count up exactly for 2**52 rounds
    assert client.request("a", 3, held_quorum_id=top, timeout=10).quorum_id == top + 1 > first


class Scripts:
    """The quorum's scripts called one by one, so a test says when each call reaches Redis
    (a waiter's TICKs, its replica's heartbeats) instead of a client's own pacing."""

    def __init__(self, r: redis.Redis, keys: RunKeys, config: QuorumConfig) -> None:
        self.r, self.keys = r, keys
        self.head = scripts.config_args(keys, config, "0badcafe")
        self.fns = {name: r.register_script(src) for name, src in scripts.ALL.items()}

    def __call__(self, name: str, *args: str) -> Any:
        return self.fns[name](keys=scripts.script_keys(self.keys), args=[*self.head, *args])

    def answered(self, replica_id: str) -> bool:
        return int(self.r.llen(scripts.reply_key(self.keys, replica_id))) > 0


def test_a_waiter_heartbeating_seldom_gets_its_first_round(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    # Each call comes more than half a heartbeat timeout after the last (the replica
    # heartbeats seldom, and its waiter rechecks right after): the old guard took every gap
    # for a stall of Redis and restarted the grace, in which no first round forms, forever.
    hb_s = 1.2
    call = Scripts(redis_client, run_keys, QuorumConfig(int(hb_s * 1000), 50, 1))
    call("JOIN", "a", scripts.member_json(Member("a")))
    time.sleep(0.55 * hb_s)
    call("HEARTBEAT", "a")
    call("REQUEST", *scripts.request_args("a", 0, 0, 0, False, "t1"))
    rechecks = 0
    while not call.answered("a") and rechecks < 6:
        time.sleep(0.55 * hb_s)
        call("HEARTBEAT", "a")
        call("TICK", "a", "t1")
        rechecks += 1
    assert call.answered("a"), f"no first round after {rechecks} rechecks"
    assert rechecks <= 3  # the grace of one gap, then the first call past it forms


def test_a_first_heartbeat_is_not_a_loss_of_redis_data(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    call = Scripts(redis_client, run_keys, QuorumConfig(60_000, 50, 1))
    call("HEARTBEAT", "a")  # creates the state: a new run, not one Redis lost
    call("JOIN", "a", scripts.member_json(Member("a")))
    call("REQUEST", *scripts.request_args("a", 0, 0, 0, False, "t1"))
    assert call.answered("a")  # formed at once, not a heartbeat timeout later


def test_a_replica_redis_forgot_still_gets_the_loss_grace(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    # The evidence of a loss: a request from a replica the state does not know although its
    # client joined it. The live replicas get a heartbeat timeout to heartbeat again before
    # a round forms on the slow path.
    call = Scripts(redis_client, run_keys, QuorumConfig(60_000, 50, 1))
    call("JOIN", "a", scripts.member_json(Member("a")))
    call("REQUEST", *scripts.request_args("a", 0, 0, 0, False, "t1"))
    assert call.answered("a")
    redis_client.delete(*redis_client.keys(run_keys.quorum_key("*")))  # Redis lost it all
    call("HEARTBEAT", "a")
    with pytest.raises(redis.ResponseError, match="QJOIN a"):
        call("REQUEST", *scripts.request_args("a", 1, 0, 0, False, "t2"))
    call("JOIN", "a", scripts.member_json(Member("a")))
    call("REQUEST", *scripts.request_args("a", 1, 0, 0, False, "t2"))
    assert not call.answered("a")
