"""The issue's faults at the client level, each against a real Redis: restarts (with the data
and without it), a frozen replica, two replicas racing to join, a partitioned minority,
garbage in every quorum key, and a Redis stall longer than the heartbeat timeout."""

from __future__ import annotations

import dataclasses
import shutil
import signal
import threading

import pytest
from quorum_harness import FAST, CutProxy, Fleet, connect_to, wait_until

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumCorrupt, QuorumGone, QuorumTimeout
from spottrain.quorum.model import Answer, Member

IDS = ["a", "b", "c"]


def _steps(step: int, ids: list[str] = IDS) -> dict[str, int]:
    return {rid: step for rid in ids}


def _one_quorum(answers: dict[str, Answer]) -> Answer:
    assert len({(a.quorum_id, a.replica_count, a.epoch) for a in answers.values()}) == 1
    assert sorted(a.replica_rank for a in answers.values()) == list(range(len(answers)))
    return next(iter(answers.values()))


@pytest.mark.parametrize("keep_data", [True, False], ids=["aof", "empty"])
def test_redis_restart_mid_round(
    make_fleet, own_redis: RedisServer, run_keys: RunKeys, keep_data: bool
) -> None:
    # No join timeout in reach: the round waits for all three across the restart.
    config = dataclasses.replace(FAST, join_timeout_ms=60_000)
    fleet: Fleet = make_fleet(config, client=connect_to(own_redis.port))
    fleet.add(*IDS)
    before = _one_quorum(fleet.round(_steps(0)))
    # Two of three are waiting on the next round when Redis goes away.
    waiting = {rid: fleet.ask(rid, 1) for rid in ("a", "b")}
    wait_until(lambda: own_redis.client().hlen(run_keys.quorum_key("req")) == 2)
    own_redis.stop()
    if not keep_data:
        shutil.rmtree(own_redis.data_dir)  # the state is lost, as after a failover to nothing
    own_redis.start()
    waiting["c"] = fleet.ask("c", 1)
    after = _one_quorum({rid: f.result(60) for rid, f in waiting.items()})
    assert after.replica_count == 3 and after.max_step == 1
    if keep_data:
        assert (after.quorum_id, after.epoch) == (before.quorum_id, before.epoch)
    else:
        # A new state generation, and the ids held by the replicas floor the counter.
        assert after.epoch != before.epoch
        assert after.quorum_id > before.quorum_id
    # The quorum goes on, and a membership change still gets a fresh id.
    fleet.client.leave("c")
    last = _one_quorum(fleet.round(_steps(2, ["a", "b"])))
    assert last.quorum_id > after.quorum_id and last.epoch == after.epoch


def test_frozen_replica_cannot_come_back(make_fleet, run_keys, redis_client) -> None:
    fleet: Fleet = make_fleet()
    fleet.add(*IDS)
    before = _one_quorum(fleet.round(_steps(0)))
    fleet.hb.paused.add("c")  # frozen: no heartbeats, no requests
    survivors = _one_quorum(fleet.round(_steps(1, ["a", "b"])))
    assert survivors.quorum_id > before.quorum_id and survivors.replica_count == 2

    # Woken after its heartbeat timeout: it is dropped before it can ask, under any call.
    def expired() -> bool:
        age = fleet.client.heartbeat_ages(["c"])["c"]  # None: dropped already
        return age is None or age > FAST.heartbeat_timeout_ms / 1000

    wait_until(expired, what="c's heartbeat to expire")
    with pytest.raises(QuorumGone, match="replica c is gone"):
        fleet.client.request("c", 1, held_quorum_id=before.quorum_id, timeout=10)
    assert fleet.client.heartbeat(["c"]) == ["c"]
    with pytest.raises(QuorumGone):
        fleet.client.join(Member("c"))
    assert redis_client.llen(scripts.reply_key(run_keys, "c")) == 0  # never an answer
    later = _one_quorum(fleet.round(_steps(2, ["a", "b"])))
    assert later.quorum_id == survivors.quorum_id  # one quorum, not two
    assert [m.replica_id for m in fleet.client.roster().members] == ["a", "b"]


def test_two_replicas_racing_to_join(make_fleet) -> None:
    fleet: Fleet = make_fleet()
    fleet.add("a", "b")
    _one_quorum(fleet.round(_steps(0, ["a", "b"])))
    seen: dict[str, list[Answer]] = {rid: [] for rid in "abcd"}
    start = threading.Barrier(4)

    def replica(rid: str, step: int) -> None:
        start.wait(10)
        if rid in "cd":
            fleet.add(rid)
        for _ in range(50):  # until all four train together
            seen[rid].append(fleet.client.request(rid, step, timeout=20))
            step += 1
            if seen[rid][-1].replica_count == 4:
                return

    threads = [
        threading.Thread(target=replica, args=(r, s))
        for r, s in zip("abcd", (1, 1, 0, 0), strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    by_id: dict[int, dict[str, int]] = {}
    for rid, answers in seen.items():
        assert answers and answers[-1].replica_count == 4
        qids = [a.quorum_id for a in answers]
        assert qids == sorted(qids)
        for a in answers:
            by_id.setdefault(a.quorum_id, {})[rid] = a.replica_rank
    final = max(by_id)
    assert sorted(by_id[final]) == ["a", "b", "c", "d"]
    assert by_id[final] == {"a": 0, "b": 1, "c": 2, "d": 3}
    for ranks in by_id.values():
        assert len(set(ranks.values())) == len(ranks)


def test_partitioned_minority_cannot_form(make_fleet, redis_server, run_keys) -> None:
    proxy = CutProxy(redis_server.port)
    majority: Fleet = make_fleet()
    minority: Fleet = make_fleet(client=connect_to(proxy.port))
    majority.add("a", "b", "c")
    minority.add("d", "e")
    futures = {**{r: majority.ask(r, 0) for r in "abc"}, **{r: minority.ask(r, 0) for r in "de"}}
    first = _one_quorum({r: f.result(30) for r, f in futures.items()})
    assert first.replica_count == 5
    proxy.cut()
    cut_off = {r: minority.ask(r, 1, timeout=1.5) for r in "de"}
    on = _one_quorum(majority.round(_steps(1, ["a", "b", "c"])))
    assert on.replica_count == 3 and on.quorum_id > first.quorum_id
    for f in cut_off.values():
        with pytest.raises(QuorumTimeout, match="unreachable"):
            f.result(30)
    proxy.heal()  # too late: the minority was dropped, it must restart under new ids
    wait_until(lambda: majority.client.heartbeat_ages(["d"])["d"] is None)
    with pytest.raises(QuorumGone):
        minority.client.request("d", 1, timeout=10)
    proxy.cut()


GARBAGE = [  # (key part, how to spoil it, what shows it)
    ("seq", lambda r, k: r.hset(k, "x", "1"), "request"),
    ("seq", lambda r, k: r.set(k, "twelve"), "request"),
    ("state", lambda r, k: r.set(k, "x"), "request"),
    ("state", lambda r, k: r.hset(k, mapping={"epoch": "e", "qid": "x"}), "request"),
    ("prev", lambda r, k: r.set(k, "x"), "request"),
    ("req", lambda r, k: r.set(k, "x"), "request"),
    ("req", lambda r, k: r.hset(k, "z", "not a request"), "request"),
    ("hb", lambda r, k: r.set(k, "x"), "request"),
    ("info", lambda r, k: r.set(k, "x"), "request"),
    ("roster", lambda r, k: r.set(k, "{nonsense"), "roster"),
    ("roster", lambda r, k: r.rpush(k, "x"), "roster"),
    ("gone", lambda r, k: r.set(k, "x"), "request"),
    ("gone_at", lambda r, k: r.set(k, "x"), "leave"),
    ("reply:a", lambda r, k: r.set(k, "x"), "request"),
    ("rlog", lambda r, k: r.set(k, "x"), "request"),
    ("rlog_vs", lambda r, k: r.set(k, "x"), "request"),
    ("pdrop", lambda r, k: r.set(k, "x"), "request"),
]


PARTS = scripts.KEY_PARTS


def test_garbage_in_each_key_is_reported_not_waited_on(redis_server, redis_client) -> None:
    for n, (part, spoil, shown_by) in enumerate(GARBAGE):
        keys = RunKeys(f"garbage-{n}")
        redis_client.delete(*[keys.quorum_key(p) for p in (*PARTS, "reply:a")])
        client = QuorumClient(connect_to(redis_server.port), keys, FAST)
        key = keys.quorum_key(part)
        if shown_by == "roster":  # every membership change rewrites it: spoil it after
            client.join(Member("a"))
            client.heartbeat(["a"])
            client.request("a", 0, timeout=30)
        redis_client.delete(key)
        spoil(redis_client, key)
        with pytest.raises(QuorumCorrupt, match=f"Redis key {key} holds") as err:
            if shown_by == "roster":
                client.roster()
            client.join(Member("a"))
            client.heartbeat(["a"])
            if shown_by == "request":
                client.request("a", 0, timeout=30)
            client.leave("a")
        assert f"{keys.quorum_base}:*" in str(err.value), part
        redis_client.delete(*[keys.quorum_key(p) for p in (*PARTS, "reply:a")])


def test_redis_stall_past_the_heartbeat_timeout_drops_nobody(
    make_fleet, own_redis, run_keys
) -> None:
    fleet: Fleet = make_fleet(client=connect_to(own_redis.port))
    fleet.add(*IDS)
    before = _one_quorum(fleet.round(_steps(0)))
    admin = own_redis.client()
    stall_s = 2 * FAST.heartbeat_timeout_ms / 1000
    # A stall with two replicas waiting on the round, then one between rounds.
    waiting = {rid: fleet.ask(rid, 1) for rid in ("a", "b")}
    admin.execute_command("DEBUG", "SLEEP", stall_s)
    waiting["c"] = fleet.ask("c", 1)
    mid = _one_quorum({rid: f.result(30) for rid, f in waiting.items()})
    admin.execute_command("CLIENT", "PAUSE", int(stall_s * 1000), "ALL")
    after = _one_quorum(fleet.round(_steps(2)))
    assert (mid.quorum_id, after.quorum_id, after.replica_count) == (before.quorum_id,) * 2 + (3,)
    assert admin.hlen(run_keys.quorum_key("gone")) == 0


def test_wait_replicas_has_a_redis_replica_hold_the_quorum(own_redis, run_keys) -> None:
    own_redis.client().config_set("repl-diskless-sync-delay", 0)  # no 5 s wait to sync
    with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(own_redis.port)]) as replica:
        wait_until(lambda: replica.client().info("replication").get("master_link_status") == "up")
        client = QuorumClient(connect_to(own_redis.port), run_keys, FAST, wait_replicas=1)
        client.join(Member("a"))
        client.heartbeat(["a"])
        answer = client.request("a", 0, timeout=30)
        # WAIT returned: the replica holds the state the answer came from.
        state = replica.client().hgetall(run_keys.quorum_key("state"))
        replica.stop(signal.SIGKILL)  # a replica's SIGTERM shutdown can take seconds
        assert int(state[b"qid"]) == answer.quorum_id == 1
