"""Quorum relays against a fake quorum client and a real Redis (the lease): Nagle-style
batching, the wire format, the lease election and the direct fallback."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import redis

from spottrain.agent.quorum_shim import relay as r
from spottrain.agent.quorum_shim import wire
from spottrain.agent.quorum_shim.member import RelayedQuorum, shortest_hop_s
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.quorum import confirm, errors, scripts
from spottrain.quorum.errors import QuorumError, QuorumGone, QuorumNotFormed, QuorumRedisRefused
from spottrain.quorum.model import Answer, BatchItem, Member, QuorumConfig, Roster

CONFIG = QuorumConfig(heartbeat_timeout_ms=600, join_timeout_ms=150)


def _answer(rid: str) -> Answer:
    return Answer(7, int(rid[1:]), 9, 40, None, 3, 0, "ep", {"x": 39} if rid == "m1" else {})


def refused_for(rid: str) -> QuorumRedisRefused:
    """What the quorum client gives a relay batch's member while Redis's memory is full."""
    refused = errors.refusal(redis.OutOfMemoryError("command not allowed"), "10.0.0.5:6379")
    assert refused is not None
    return refused.for_replica(rid)


def not_formed_for(rid: str) -> QuorumNotFormed:
    """What the quorum client gives a relay batch's member whose round did not form."""
    return QuorumNotFormed(f"no quorum formed for replica {rid} in time: fewer than 2 ...")


class FakeDirect:
    """request_batch answers every item at once (``hold`` blocks the first call)."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[str]]] = []
        self.direct: list[str] = []
        self.gone: set[str] = set()
        self.refusals = 0  # the next this many batches: Redis refuses every item
        self.not_formed = 0  # the next this many batches: no item's round forms
        self.hold = threading.Event()
        self.hold.set()
        self.in_flight = threading.Event()

    def request_batch(
        self, relay_id: str, items: Sequence[BatchItem], timeout: float
    ) -> dict[str, Answer | QuorumError]:
        self.batches.append((relay_id, [i.replica_id for i in items]))
        self.in_flight.set()
        self.hold.wait(5)
        if self.refusals > 0:
            self.refusals -= 1
            return {i.replica_id: refused_for(i.replica_id) for i in items}
        if self.not_formed > 0:
            self.not_formed -= 1
            return {i.replica_id: not_formed_for(i.replica_id) for i in items}
        return {
            i.replica_id: QuorumGone("gone") if i.replica_id in self.gone else _answer(i.replica_id)
            for i in items
        }

    def request(self, replica_id: str, step: int, **kw: object) -> Answer:
        self.direct.append(replica_id)
        return _answer(replica_id)

    def join(self, member: Member, *, timeout: float = 0.0) -> None: ...
    def heartbeat(self, replica_ids: Sequence[str]) -> list[str]:
        return []

    def leave(self, replica_id: str) -> None: ...
    def roster(self) -> Roster:
        return Roster(1, ())

    def heartbeat_ages(self, replica_ids: Sequence[str]) -> dict[str, float | None]:
        return {}


def test_wire_format_and_groups() -> None:
    item = BatchItem("replica-3:ab-c", 12, 5, 1, True)
    assert r.decode_request(r.encode_request(item, 1.25)) == (item, 1.25)
    with pytest.raises(ValueError):
        r.decode_request(b"a b c")
    for a in (_answer("m1"), Answer(1, 0, 1, 0, 2, 1, 3, "e", {})):
        assert scripts.parse_answer(r.answer_line(a)) == a
    assert r.relay_group("replica-7", 2) == 3 and r.relay_group("replica-0", 100) == 0
    assert r.lease_key(RunKeys("x"), 4) == RunKeys("x").quorum_key("relay:4")


def test_batches_are_nagle_style_and_never_share_a_relay_id() -> None:
    fake = FakeDirect()
    fake.hold.clear()
    b = r.Batcher(fake, "0-r", gather_s=0.05)
    try:
        first = b.submit(BatchItem("m0", 40), 5)
        assert fake.in_flight.wait(5)
        rest = [b.submit(BatchItem(f"m{j}", 40), 5) for j in range(1, 6)]
        again = b.submit(BatchItem("m1", 40), 5)  # a retry joins its pending item
        assert b.submit(BatchItem("m2", 40), 5).cancel()  # its asker gave up: the rest still
        for _ in range(200):
            if len(fake.batches) == 2:
                break
            time.sleep(0.01)
        fake.hold.set()
        assert first.result(5) == _answer("m0")
        assert [f.result(5) for f in rest] == [_answer(f"m{j}") for j in range(1, 6)]
        assert again.result(5) == _answer("m1")
        # The first went alone and at once; the rest in ONE batch under another relay id.
        assert fake.batches == [("0-r.0", ["m0"]), ("0-r.1", [f"m{j}" for j in range(1, 6)])]
    finally:
        b.stop()


def test_a_steady_group_leaves_in_one_batch_when_its_last_member_asks() -> None:
    fake = FakeDirect()
    fake.hold.clear()
    b = r.Batcher(fake, "0-r", gather_s=0.0, max_wait_s=30.0, window_s=60.0)
    try:
        # m0's answer is held until all three asked: were it answered first, m0 would be
        # expected, and m1 and m2 would wait the whole max wait for it to ask again.
        first = [b.submit(BatchItem(f"m{j}", 40), 5) for j in range(3)]
        fake.hold.set()
        assert [f.result(5) for f in first] == [_answer(f"m{j}") for j in range(3)]
        fake.batches.clear()
        # m0..m2 are expected now: two of them wait (no wall clock: the max wait is 30 s)...
        nxt = [b.submit(BatchItem(f"m{j}", 41), 5) for j in range(2)]
        time.sleep(0.05)
        assert fake.batches == [] and not any(f.done() for f in nxt)
        nxt.append(b.submit(BatchItem("m2", 41), 5))  # ...until the last one asks
        assert [f.result(5) for f in nxt] == [_answer(f"m{j}") for j in range(3)]
        assert fake.batches == [("0-r.0", ["m0", "m1", "m2"])]
        # A refused member is no longer expected: the others leave without it.
        fake.gone.add("m2")
        refused = [b.submit(BatchItem(f"m{j}", 42), 5) for j in range(3)]
        with pytest.raises(QuorumGone):
            refused[2].result(5)
        fake.batches.clear()
        assert all(f.result(5) for f in [b.submit(BatchItem(f"m{j}", 43), 5) for j in (0, 1)])
        assert fake.batches == [("0-r.0", ["m0", "m1"])]
    finally:
        b.stop()


def _node(fake: FakeDirect, client: redis.Redis, keys: RunKeys) -> RelayedQuorum:
    port = free_port()
    lease = r.Lease(client, r.lease_key(keys, 0), f"127.0.0.1:{port}", 1800)
    return RelayedQuorum(fake, lease, CONFIG, bind=f"127.0.0.1:{port}", gather_s=0.001)


def test_members_relay_fall_back_directly_and_the_lease_moves(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    lease_redis = redis_client
    relay_fake, member_fake = FakeDirect(), FakeDirect()
    a = _node(relay_fake, lease_redis, run_keys).start()
    b = _node(member_fake, lease_redis, run_keys).start()
    try:
        assert a.holding and not b.holding and b.relay() == a.address
        assert lease_redis.get(a.lease.key) == a.address.encode()
        assert b.request("m1", 40, timeout=5) == _answer("m1")  # through a's relay
        assert a.request("m0", 40, timeout=5) == _answer("m0")  # a's own batcher
        assert relay_fake.direct == [] and member_fake.batches == []
        assert {i for _, ids in relay_fake.batches for i in ids} == {"m0", "m1"}
        assert (b.relayed, b.fallbacks) == (1, 0)
        relay_fake.gone.add("m2")
        with pytest.raises(QuorumGone):  # a refusal through the relay is final
            b.request("m2", 40, timeout=5)
        assert "m2" not in member_fake.direct

        relay_fake.hold.clear()  # the relay freezes: B waits out its hop deadline
        assert b.request("m1", 41, timeout=5) == _answer("m1")
        relay_fake.hold.set()
        assert member_fake.direct == ["m1"] and b.fallbacks == 1
        # Avoided while its lease could still be a dead relay's...
        assert b.request("m1", 42, timeout=5) and member_fake.direct == ["m1", "m1"]
        # ...and used again once it still holds the lease a whole TTL later (it renewed it).
        b._avoid, b._next_read = (a.address, time.monotonic() - b.ttl_s), 0.0
        relayed = b.relayed
        assert b.request("m1", 43, timeout=5) and b.relayed == relayed + 1

        a._server.stop()  # the relay dies (its lease stays until its TTL)
        assert b.request("m1", 44, timeout=5) == _answer("m1")
        assert member_fake.direct == ["m1"] * 3 and b.fallbacks == 3
        lease_redis.delete(a.lease.key)  # its TTL ran out
        b._next_read = 0.0
        assert b.request("m1", 45, timeout=5) == _answer("m1")
        assert b.holding and lease_redis.get(b.lease.key) == b.address.encode()
        assert member_fake.batches and member_fake.direct == ["m1"] * 3
    finally:
        a.stop()
        b.stop()
    assert lease_redis.get(b.lease.key) is None  # released on a clean stop


def test_a_redis_refusal_through_the_relay_keeps_the_relay(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    # The relay's batch failed because of Redis (full memory, a replica, NOREPLICAS, an
    # unacknowledged WAIT): the member asks the relay again, never Redis directly, and does
    # not avoid it; past its deadline it raises the refusal as a direct request would.
    relay_fake, member_fake = FakeDirect(), FakeDirect()
    a = _node(relay_fake, redis_client, run_keys).start()
    b = _node(member_fake, redis_client, run_keys).start()
    try:
        assert b.relay() == a.address
        relay_fake.refusals = 2
        assert b.request("m1", 40, timeout=5) == _answer("m1")  # the third batch answers
        assert [ids for _, ids in relay_fake.batches] == [["m1"]] * 3
        relay_fake.refusals = 1
        assert a.request("m0", 40, timeout=5) == _answer("m0")  # the relay's own member
        assert (b.relayed, b.fallbacks, a.fallbacks) == (1, 0, 0)
        assert b._avoid is None and member_fake.direct == relay_fake.direct == []

        relay_fake.refusals = 1 << 30  # refused until the deadline
        started = time.monotonic()
        with pytest.raises(QuorumRedisRefused) as err:
            b.request("m1", 41, timeout=1.0)
        assert time.monotonic() - started < 1.0 + 2.0  # by its deadline, plus a loaded box
        assert err.value.cause == "OOM" and str(err.value) == str(refused_for("m1"))
        assert b._avoid is None and b.fallbacks == 0 and member_fake.direct == []
        assert b.relay() == a.address
    finally:
        a.stop()
        b.stop()


def test_a_round_not_formed_through_the_relay_keeps_the_relay(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    # The relay's batch gave up because too few replicas asked by the hop's deadline: the
    # replicas', not the relay's failure. The member asks the relay again (never Redis
    # directly) and keeps it; past its deadline it raises what a direct request would.
    relay_fake, member_fake = FakeDirect(), FakeDirect()
    a = _node(relay_fake, redis_client, run_keys).start()
    b = _node(member_fake, redis_client, run_keys).start()
    try:
        assert b.relay() == a.address
        relay_fake.not_formed = 2
        assert b.request("m1", 40, timeout=5) == _answer("m1")  # the third batch answers
        relay_fake.not_formed = 1
        assert a.request("m0", 40, timeout=5) == _answer("m0")  # the relay's own member
        assert (b.relayed, b.fallbacks, a.fallbacks) == (1, 0, 0)

        relay_fake.not_formed = 1 << 30  # no round until the deadline
        with pytest.raises(QuorumNotFormed) as err:
            b.request("m1", 41, timeout=1.0)
        assert str(err.value) == str(not_formed_for("m1"))
        assert b._avoid is None and b.fallbacks == 0 and member_fake.direct == []
        assert relay_fake.direct == [] and b.relay() == a.address
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_the_shortest_hop_leaves_the_relays_batch_room_to_block(wait_replicas: int) -> None:
    # A hop's timeout on the wire is cut by the wire's margin, then waits up to the
    # batcher's longest wait for its group; what is left is the relay batch's timeout.
    def blocks(hop: float) -> bool:
        batch_s = hop - wire.ASK_MARGIN_S - r.MAX_WAIT_S
        by = confirm.answer_by(100.0 + batch_s, batch_s, wait_replicas)
        return confirm.block_s(100.0, by, 1.0) is not None

    shortest = shortest_hop_s(wait_replicas)
    assert blocks(shortest + 1e-6) and not blocks(shortest - 0.005)
    # At least the wire's margin + Redis's tick + a block (and a WAIT's share with it).
    assert shortest >= 0.05 + confirm.REDIS_LATE_S + 0.01 + (0.11 if wait_replicas else 0)


def test_too_short_a_hop_is_asked_directly_without_avoiding_the_relay(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    relay_fake, member_fake = FakeDirect(), FakeDirect()
    a = _node(relay_fake, redis_client, run_keys).start()
    b = _node(member_fake, redis_client, run_keys).start()
    try:
        assert b.relay() == a.address
        # The relay would give up at once (an error frame, once): not asked, not avoided.
        assert b.request("m1", 40, timeout=b.shortest_hop_s / 2) == _answer("m1")
        assert member_fake.direct == ["m1"] and relay_fake.batches == []
        assert b._avoid is None and b.relay() == a.address
        # Refused until too short a hop is left: the refusal, as a direct request's.
        relay_fake.refusals = 1 << 30
        with pytest.raises(QuorumRedisRefused):
            b.request("m1", 41, timeout=b.shortest_hop_s + 0.5)
        assert member_fake.direct == ["m1"] and b._avoid is None
    finally:
        a.stop()
        b.stop()
