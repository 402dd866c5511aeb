"""Relays (``QuorumClient.request_batch``) against a real Redis: the answers through relay
batches are those of direct requests and of the quorum's rules over random rounds; a steady
round touches no member's key; retries are idempotent; a relay that dies mid-round costs its
members a direct request, not a hang or a double count; garbage in the new keys is
reported."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import redis
from quorum_harness import FAST, connect_to
from relay_model import Asker, Model, no_epoch, split

from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumCorrupt, QuorumGone, QuorumTimeout
from spottrain.quorum.model import Answer, BatchItem, Member
from spottrain.quorum.relay import RelayBatch

SLOW = dataclasses.replace(FAST, heartbeat_timeout_ms=60_000, join_timeout_ms=60_000)


def _pair(port: int, run_keys: RunKeys) -> tuple[Asker, Asker]:
    """Two quorums on one Redis: one asked only directly, one mostly through relays."""
    r = connect_to(port)
    direct = QuorumClient(r, RunKeys(run_keys.run_id + "-d"), SLOW)
    relayed = QuorumClient(r, run_keys, SLOW)
    return Asker(direct), Asker(relayed)


@pytest.mark.parametrize("seed", [1, 2])
def test_relayed_answers_equal_direct_ones_and_the_rules(redis_server, run_keys, seed) -> None:
    rng = random.Random(seed)
    d, rl = _pair(redis_server.port, run_keys)
    model = Model()
    live = [f"r{i:02d}" for i in range(8)]
    for a in (d, rl):
        a.join(*live)
    fresh, kinds = 8, set()
    for rnd in range(36):
        waiting = set(model.waiting)
        newcomers: list[str] = []
        if rng.random() < 0.2:  # a replica joins; it asks first (else the members'
            newcomers = [f"r{fresh:02d}"]  # fast path could form without it)
            fresh += 1
            for a in (d, rl):
                a.join(*newcomers)
        members = [r for r in live if r not in waiting]
        rng.shuffle(members)
        gone = ""
        if rng.random() < 0.2 and len(members) > 3:
            gone = members.pop()  # leaves or is dropped before the last requests
        step = rnd + 1
        asks = {r: (step, 0, False) for r in newcomers + members}
        what = rng.random()
        if what < 0.2:
            kinds.add("behind")
            for r in members:
                asks[r] = (step - rng.randint(0, 2), 0, False)
        elif what < 0.3:
            kinds.add("commit failure")
            asks[rng.choice(members)] = (step, 1, False)
        elif what < 0.4:
            kinds.add("shrink_only")
            asks[rng.choice(members)] = (step, 0, True)
        order = newcomers + members
        groups = split(rng, order, relays=3)
        for k, (via, ids) in enumerate(groups):
            if gone and k == len(groups) - 1:
                kinds.add("leave/drop")
                _remove(d, rl, gone, leave=rng.random() < 0.5)
                model.remove(gone)
                live.remove(gone)
            for r in ids:
                d.ask_direct(r, *asks[r])
            if via:
                rl.ask_batch(via, [_item(r, *asks[r]) for r in ids])
            else:
                for r in ids:
                    rl.ask_direct(r, *asks[r])
        live += newcomers
        want = no_epoch(model.form(asks))
        got_d, got_r = d.collect(), rl.collect()
        assert no_epoch(got_d) == want, (rnd, asks)  # type: ignore[arg-type]
        assert no_epoch(got_r) == want, (rnd, asks)  # type: ignore[arg-type]
    assert kinds == {"behind", "commit failure", "shrink_only", "leave/drop"}


def _item(rid: str, step: int, cf: int, shrink: bool) -> BatchItem:
    return BatchItem(rid, step, commit_failures=cf, shrink_only=shrink)


def _remove(d: Asker, rl: Asker, rid: str, leave: bool) -> None:
    for a in (d, rl):
        if leave:
            a.c.leave(rid)
        else:  # its heartbeat expired: the next script's sweep drops it
            a.c._redis.zadd(a.c._keys.quorum_key("hb"), {rid: 0})


def _stats(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}


def test_steady_round_touches_no_member_key(redis_server, run_keys, redis_client) -> None:
    _, rl = _pair(redis_server.port, run_keys)
    ids = [f"m{i}" for i in range(10)]
    rl.join(*ids)

    def round_(step: int) -> dict[str, Answer]:
        rl.ask_batch("relay-a", [BatchItem(r, step) for r in ids[:5]])
        rl.ask_direct(ids[5], step)
        rl.ask_batch("relay-b", [BatchItem(r, step) for r in ids[6:]])
        return rl.collect()  # type: ignore[return-value]

    first = round_(0)  # a membership change: the full FORM
    round_(1)
    redis_client.config_resetstat()
    third = round_(2)
    stats = _stats(redis_client)
    for rid, a in third.items():
        assert (a.replica_rank, a.replica_count, a.max_step) == (ids.index(rid), 10, 2)
        assert (a.quorum_id, a.roster_version) == (first[rid].quorum_id,) * 2
    # No HGETALL of the requests, no member's info, prev or roster: one LPUSH per relay
    # batch and per direct waiter, the sets of this round's relays and direct waiters.
    assert "hgetall" not in stats and "set" not in stats
    assert (stats["lpush"], stats["smembers"], stats["sismember"]) == (3, 2, 1)
    # prev for each batch, and rdirect for the batch sent after the direct request.
    assert stats["smismember"] == 3 and stats["sadd"] == 3  # rrelays x2, rdirect


def test_retries_a_dead_relay_and_the_blocking_client(redis_server, run_keys) -> None:
    r = connect_to(redis_server.port)
    client = QuorumClient(r, run_keys, SLOW)
    ids = ["a", "b", "c", "d", "e", "f"]
    for rid in ids:
        client.join(Member(rid))
    client.heartbeat(ids)
    state = run_keys.quorum_key("state")

    def blocking(relay: str, part: list[str], step: int, out: dict, **kw: object) -> None:
        items = [BatchItem(x, step, **kw) for x in part]  # type: ignore[arg-type]
        out.update(client.request_batch(relay, items, timeout=20))

    def round_(step: int, direct: list[str], cf: int = 0) -> dict:
        out: dict = {}
        kw = {"commit_failures": cf}
        threads = [
            threading.Thread(target=blocking, args=("r2", ["d", "e"], step, out), kwargs=kw),
            *[
                threading.Thread(target=lambda x=x: out.update({x: client.request(x, step)}))
                for x in direct
            ],
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    # Round 0 through the blocking client; "a", "b", "c" through relay r1 in a thread too.
    got: dict = {}
    t = threading.Thread(target=blocking, args=("r1", ["a", "b", "c"], 0, got))
    t.start()
    got.update(round_(0, ["f"]))
    t.join(30)
    assert sorted((k, v.replica_rank, v.replica_count) for k, v in got.items()) == [
        (x, i, 6) for i, x in enumerate(ids)
    ]
    # Retries: r1's batch sent twice counts once; resent after its round formed, it reads
    # the answer waiting for it and registers nothing in the next round.
    again = RelayBatch(client, "r1", [BatchItem(x, 1) for x in "abc"], timeout=20)
    again._send()
    again.unsent = set(again.open)
    again._send()
    assert r.hget(state, "joined_prev") == b"3"
    later = round_(1, ["f"])
    again.unsent = set(again.open)
    again._send()
    assert not again.open and r.hlen(run_keys.quorum_key("req")) == 0
    assert {a.max_step for a in [*later.values(), *again.out.values()]} == {1}
    # r1 dies after sending its batch: its members ask Redis directly. Before the round
    # formed (round 2): they are answered directly, each counted once. After it formed with
    # them (round 3: steady, round 4: a full FORM, a commit failed): each finds its answer
    # in the dead batch's list, asking nothing anew.
    for step, early in ((2, ["a", "b", "c"]), (3, []), (4, [])):
        dead = RelayBatch(client, "r1", [BatchItem(x, step) for x in "abc"], timeout=20)
        dead._send()
        got = round_(step, ["f", *early], cf=int(step == 4))
        got.update({x: client.request(x, step, timeout=5) for x in "abc" if x not in early})
        assert {(a.replica_count, a.max_step) for a in got.values()} == {(6, step)}
        assert {a.commit_failures for a in got.values()} == {int(step == 4)}
        assert sorted(a.replica_rank for a in got.values()) == list(range(6))
        assert r.hlen(run_keys.quorum_key("req")) == 0 and client.status().members == 6
        assert r.pttl(dead.key) > 0  # the dead batch's list expires
    # Per item: a replica that left is gone; the others time out and are withdrawn.
    client.leave("f")
    out = client.request_batch("r3", [BatchItem("f", 5), BatchItem("a", 5)], timeout=0.5)
    assert isinstance(out["f"], QuorumGone) and isinstance(out["a"], QuorumTimeout)
    assert r.hlen(run_keys.quorum_key("req")) == 0


def test_garbage_in_relay_keys_is_reported(redis_server, run_keys, redis_client) -> None:
    client = QuorumClient(connect_to(redis_server.port), run_keys, SLOW)
    ids = ["a", "b"]
    for rid in ids:
        client.join(Member(rid))
    client.heartbeat(ids)
    k = run_keys.quorum_key
    asker = Asker(client)
    asker.ask_batch("r", [BatchItem(x, 0) for x in ids])
    assert len(asker.collect()) == 2
    for part in ("rrelays", "ranks", "relayreply:"):
        batch = RelayBatch(client, "r", [BatchItem("a", 1)], timeout=5)
        key = batch.key if part == "relayreply:" else k(part)
        redis_client.set(key, "x")
        with pytest.raises(QuorumCorrupt, match=f"Redis key {key} holds"):
            batch._send()
            asker.ask_direct("b", 1)  # a steady round: b's rank is read from ranks
        redis_client.delete(key, k("req"), k("rdirect"), k("rrelays"))
        redis_client.hset(k("state"), mapping={"steady": 2, "nreq": 0, "joined_prev": 0})
