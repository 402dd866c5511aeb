"""The replica slot claim in real Redis: the Lua answers what the pure decision answers,
concurrent claims get distinct slots, a lost node's slot is taken over and a live one's never,
and the lighthouse address is read as the controller writes it."""

from __future__ import annotations

import json
import threading

import pytest
import redis
from replica_slot_cases import CASES

from spottrain.agent.replica_launch import wait_lighthouse
from spottrain.agent.replica_slots import (
    CLAIM_LUA,
    SlotClaim,
    claim_slot,
    find_claim,
    read_claims,
    read_slots,
    release_slot,
)
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys


def _beat(client: redis.Redis, keys: RunKeys, *nodes: str) -> None:
    for node in nodes:
        client.set(keys.heartbeat(node), "joined", px=60_000)


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_the_lua_claims_what_the_decision_chooses(
    redis_client: redis.Redis, run_keys: RunKeys, case: tuple
) -> None:
    slots, live, node, k, expected = case
    for name, nodes in slots.items():
        redis_client.hset(run_keys.replica_slots, name, json.dumps({"nodes": nodes, "at": 1}))
    _beat(redis_client, run_keys, *live)
    claim = SlotClaim(*expected)
    assert claim_slot(redis_client, run_keys, node, k) == claim
    assert read_claims(redis_client, run_keys)[claim.slot] == claim


@pytest.mark.parametrize(("agents", "k"), [(16, 1), (9, 3)])
def test_concurrent_claims_get_distinct_slots(
    redis_server: RedisServer, run_keys: RunKeys, agents: int, k: int
) -> None:
    claims: dict[str, SlotClaim] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(agents)

    def boot(node: str) -> None:
        client = redis_server.client()
        try:
            _beat(client, run_keys, node)
            start.wait()
            claims[node] = claim_slot(client, run_keys, node, k)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=boot, args=(f"n{i}",)) for i in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    client = redis_server.client()
    slots = read_slots(client, run_keys)
    client.close()
    assert sorted(slots) == sorted(f"replica-{j}" for j in range(agents // k))
    assert all(len(nodes) == k for nodes in slots.values())
    assert sorted(n for nodes in slots.values() for n in nodes) == sorted(claims)
    for node, claim in claims.items():
        assert node in slots[claim.slot]
    # Every member of a slot rendezvous in one generation: the first claim of each slot
    # started it, the others joined it.
    assert {c.gen for c in claims.values()} == {1}


def test_concurrent_backfills_of_one_vacated_slot_share_one_new_generation(
    redis_server: RedisServer, run_keys: RunKeys
) -> None:
    """Three nodes of a replica are lost at once; three backfills claim the slot together:
    the first starts generation 2, the other two join it (never one each)."""
    client = redis_server.client()
    client.hset(
        run_keys.replica_slots, "replica-0", json.dumps({"nodes": ["x", "y", "z"], "gen": 1})
    )
    client.hset(run_keys.replica_generations, "replica-0", 1)
    claims: dict[str, SlotClaim] = {}
    start = threading.Barrier(3)

    def boot(node: str) -> None:
        c = redis_server.client()
        try:
            _beat(c, run_keys, node)
            start.wait()
            claims[node] = claim_slot(c, run_keys, node, 3)
        finally:
            c.close()

    threads = [threading.Thread(target=boot, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(claims) == ["a", "b", "c"]
    assert {(c.slot, c.gen) for c in claims.values()} == {("replica-0", 2)}
    [record] = read_claims(client, run_keys).values()
    assert sorted(record.members) == ["a", "b", "c"] and record.gen == 2
    assert client.hget(run_keys.replica_generations, "replica-0") == b"2"
    client.close()


def test_a_vacated_slot_starts_a_new_generation_each_time(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    _beat(redis_client, run_keys, "a", "b")
    a = claim_slot(redis_client, run_keys, "a", 2)
    assert (a.slot, a.gen) == ("replica-0", 1)
    # b joins a live member: the same rendezvous.
    assert claim_slot(redis_client, run_keys, "b", 2) == SlotClaim("replica-0", ("a", "b"), 1)
    # Both leave cleanly (their torchruns closed generation 1): the slot's record goes, its
    # number stays.
    assert release_slot(redis_client, run_keys, a, "a")
    assert release_slot(redis_client, run_keys, a, "b")
    assert read_claims(redis_client, run_keys) == {}
    _beat(redis_client, run_keys, "c", "d")
    assert claim_slot(redis_client, run_keys, "c", 2) == SlotClaim("replica-0", ("c",), 2)
    # c's VM dies (its heartbeat expires, no release): d starts generation 3 alone.
    redis_client.delete(run_keys.heartbeat("c"))
    assert claim_slot(redis_client, run_keys, "d", 2) == SlotClaim("replica-0", ("d",), 3)
    assert find_claim(redis_client, run_keys, "d") == SlotClaim("replica-0", ("d",), 3)
    assert find_claim(redis_client, run_keys, "c") is None
    # d's agent restarts on the same VM: nobody else is live, so a new generation too.
    assert claim_slot(redis_client, run_keys, "d", 2).gen == 4
    # Lost counter (or a record from before generations): still above the record.
    redis_client.delete(run_keys.replica_generations)
    redis_client.delete(run_keys.heartbeat("d"))
    _beat(redis_client, run_keys, "e")
    assert claim_slot(redis_client, run_keys, "e", 2).gen == 5


def test_a_backfill_takes_a_lost_nodes_slot_never_a_live_ones(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    _beat(redis_client, run_keys, "a", "b")
    assert claim_slot(redis_client, run_keys, "a", 1).slot == "replica-0"
    assert claim_slot(redis_client, run_keys, "b", 1).slot == "replica-1"
    # a's VM is gone: its heartbeat key expired (or its agent removed it).
    redis_client.delete(run_keys.heartbeat("a"))
    _beat(redis_client, run_keys, "c", "d")
    # ... in a new generation of its rendezvous (a's may be closed).
    assert claim_slot(redis_client, run_keys, "c", 1) == SlotClaim("replica-0", ("c",), 2)
    # b is alive: d never doubles up with it.
    assert claim_slot(redis_client, run_keys, "d", 1).slot == "replica-2"
    assert read_slots(redis_client, run_keys) == {
        "replica-0": ["c"],
        "replica-1": ["b"],
        "replica-2": ["d"],
    }


def test_a_claim_naming_a_node_it_was_not_told_of_writes_nothing(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    """The Lua reads only declared heartbeat keys: a node listed since the caller looked
    makes it answer retry (claim_slot then reads again)."""
    redis_client.hset(run_keys.replica_slots, "replica-0", json.dumps({"nodes": ["x"], "at": 1}))
    reply = redis_client.eval(
        CLAIM_LUA, 2, run_keys.replica_slots, run_keys.replica_generations, "b", 1, "2"
    )
    assert reply == [b"retry", b"x"]
    assert read_slots(redis_client, run_keys) == {"replica-0": ["x"]}


def test_release_drops_the_node_and_an_empty_slot(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    _beat(redis_client, run_keys, "a", "b")
    a = claim_slot(redis_client, run_keys, "a", 2)
    b = claim_slot(redis_client, run_keys, "b", 2)
    assert a.slot == b.slot == "replica-0"
    assert release_slot(redis_client, run_keys, a, "a")
    assert read_slots(redis_client, run_keys) == {"replica-0": ["b"]}
    assert release_slot(redis_client, run_keys, b, "b")
    assert not release_slot(redis_client, run_keys, b, "b")
    assert redis_client.hlen(run_keys.replica_slots) == 0


def test_the_lighthouse_address_is_read_as_the_controller_writes_it(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    assert wait_lighthouse(redis_client, run_keys, 0) is None
    redis_client.set(run_keys.replica_lighthouse, "127.0.0.1:29510")
    assert wait_lighthouse(redis_client, run_keys, 0) == "127.0.0.1:29510"
    redis_client.set(run_keys.replica_lighthouse, "garbage")
    with pytest.raises(ValueError, match="replica:lighthouse 'garbage' is not HOST:PORT"):
        wait_lighthouse(redis_client, run_keys, 0)


def test_a_launch_waits_for_the_lighthouse_until_it_is_published(
    redis_server: RedisServer, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    waiting = threading.Event()
    found: list[str | None] = []

    def stopped() -> bool:
        waiting.set()  # asked once the first read found nothing
        return False

    thread = threading.Thread(
        target=lambda: found.append(
            wait_lighthouse(redis_server.client(), run_keys, 60, stopped=stopped)
        )
    )
    thread.start()
    assert waiting.wait(30)
    redis_client.set(run_keys.replica_lighthouse, "10.0.0.5:29510")
    thread.join(timeout=60)
    assert found == ["10.0.0.5:29510"]
