"""The holder rows and the atomic leave decision against a real Redis."""

from __future__ import annotations

import json
import time

import redis

from spottrain.agent.replica.holders import HolderBoard, HolderRow
from spottrain.protocol.keys import RunKeys


def board(client: redis.Redis, keys: RunKeys, replica: str) -> HolderBoard:
    b = HolderBoard(client, keys, replica, f"node-{replica}", interval=3600)
    return b


def test_rows_are_written_only_once_the_replica_holds_the_state(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    b = board(redis_client, run_keys, "replica-0")
    try:
        b.beat()
        assert redis_client.hget(run_keys.replica_holders, "replica-0") is None
        b.update(step=4, quorum_id=2, participants=2, discarded=1)
        b.beat()
        row = json.loads(redis_client.hget(run_keys.replica_holders, "replica-0"))
        assert row["state"] == "live" and row["step"] == 4 and row["discarded"] == 1
        assert abs(row["at"] - time.time()) < 30
    finally:
        b.stop()


def test_two_leavers_at_once_leave_exactly_one_to_save(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    boards = [board(redis_client, run_keys, f"replica-{j}") for j in range(3)]
    for b in boards:
        b.update(step=9)
        b.beat()
    # A row that stopped beating long ago is not a holder.
    stale = HolderRow(step=9, at=time.time() - 600).to_json()
    redis_client.hset(run_keys.replica_holders, "replica-9", stale)
    assert boards[0].live_peers() == 2
    answers = [boards[0].leave(), boards[1].leave()]
    assert answers == [2, 1]  # replica-2 is still live: neither must save
    assert boards[2].leave() == 0  # the last one saves
    rows = redis_client.hgetall(run_keys.replica_holders)
    assert {json.loads(rows[f"replica-{j}".encode()])["state"] for j in range(3)} == {"leaving"}


def test_a_drain_request_for_this_node_is_seen(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    b = board(redis_client, run_keys, "replica-0")
    try:
        other = {"id": 1, "drain": True, "at": time.time() + 1}
        redis_client.hset(run_keys.ckpt_requests, "node-replica-1", json.dumps(other))
        b.beat()
        assert not b.drain.is_set()
        redis_client.hset(run_keys.ckpt_requests, "node-replica-0", json.dumps(other))
        b.beat()
        assert b.drain.is_set()
    finally:
        b.stop()
