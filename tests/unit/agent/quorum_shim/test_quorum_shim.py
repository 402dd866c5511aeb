"""The lighthouse shim against a fake quorum client, through a real gRPC channel: the
participant list it rebuilds, the coalesced heartbeats, the stall-free leave, refusals and
how errors map to gRPC status codes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest
import redis

from spottrain.agent.quorum_shim import proto
from spottrain.agent.quorum_shim.roster import RosterCache, fake_roster, rebuild_cost
from spottrain.agent.quorum_shim.server import LighthouseShim, status_of
from spottrain.agent.replica.refusal import RefusalGuard, shim_refused
from spottrain.agent.replica.watchdog import shim_ages
from spottrain.quorum.errors import QuorumCorrupt, QuorumGone, QuorumTimeout
from spottrain.quorum.model import Answer, Member, QuorumConfig, Roster


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeQuorum:
    """Answers every request with a fixed roster of 3 (member ``b`` one step behind)."""

    def __init__(self) -> None:
        self.joins: list[Member] = []
        self.join_timeouts: list[float] = []
        self.requests: list[tuple[str, int, int]] = []
        self.beats: list[list[str]] = []
        self.left: list[str] = []
        self.rosters = 0
        self.age_reads = 0
        self.gone: set[str] = set()
        self.fail: BaseException | None = None
        self.version = 5
        self.members = tuple(
            Member(f"{n}:u", f"http://h{n}:1", f"h{n}:2", 2, "") for n in ("a", "b", "c")
        )

    def join(self, member: Member, *, timeout: float = 0.0) -> None:
        self.joins.append(member)
        self.join_timeouts.append(timeout)

    def request(
        self,
        replica_id: str,
        step: int,
        *,
        held_quorum_id: int = 0,
        commit_failures: int = 0,
        shrink_only: bool = False,
        timeout: float = 60.0,
    ) -> Answer:
        self.requests.append((replica_id, step, held_quorum_id))
        if self.fail is not None:
            raise self.fail
        if replica_id in self.gone:
            raise QuorumGone(f"replica {replica_id} left")
        return Answer(9, 0, 3, 12, None, self.version, 1, "ep", {"b:u": 11})

    def heartbeat(self, replica_ids: Sequence[str]) -> list[str]:
        self.beats.append(list(replica_ids))
        return [r for r in replica_ids if r in self.gone]

    def leave(self, replica_id: str) -> None:
        self.left.append(replica_id)
        self.gone.add(replica_id)

    def roster(self) -> Roster:
        self.rosters += 1
        return Roster(self.version, self.members)

    def heartbeat_ages(self, replica_ids: Sequence[str]) -> dict[str, float | None]:
        self.age_reads += 1
        return {r: None if r in self.gone else 0.25 for r in replica_ids}


@pytest.fixture
def shim() -> Iterator[tuple[LighthouseShim, FakeQuorum, FakeClock, grpc.Channel]]:
    fake, clock = FakeQuorum(), FakeClock()
    s = LighthouseShim(
        fake, fake, QuorumConfig(), heartbeat_interval_s=3600, fresh_s=0.5, clock=clock
    ).start()
    channel = grpc.insecure_channel(s.address)
    try:
        yield s, fake, clock, channel
    finally:
        channel.close()
        s.stop(0)


def _quorum(channel: grpc.Channel, rid: str, step: int = 12) -> proto.Quorum:
    call = channel.unary_unary(
        proto.QUORUM_METHOD,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=proto.LighthouseQuorumResponse.FromString,
    )
    member = proto.QuorumMember(
        replica_id=rid, address=f"http://{rid}", store_address="s:1", step=step, world_size=2
    )
    return call(proto.LighthouseQuorumRequest(requester=member), timeout=10).quorum


def _heartbeat(channel: grpc.Channel, rid: str) -> None:
    call = channel.unary_unary(
        proto.HEARTBEAT_METHOD,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=proto.LighthouseHeartbeatResponse.FromString,
    )
    call(proto.LighthouseHeartbeatRequest(replica_id=rid), timeout=10)


def test_quorum_rebuilds_torchfts_participants_and_caches_the_roster(shim) -> None:
    _, fake, _, channel = shim
    q = _quorum(channel, "a:u")
    assert q.quorum_id == 9 and q.created.seconds > 0
    got = [(p.replica_id, p.address, p.store_address, p.step, p.world_size) for p in q.participants]
    assert got == [
        ("a:u", "http://ha:1", "ha:2", 12, 2),
        ("b:u", "http://hb:1", "hb:2", 11, 2),  # behind: its own step
        ("c:u", "http://hc:1", "hc:2", 12, 2),
    ]
    assert all(p.commit_failures == 1 for p in q.participants)
    _quorum(channel, "a:u")
    # Joined once, the roster read once (same version), the held id sent on the 2nd request.
    assert len(fake.joins) == 1 and fake.rosters == 1
    assert fake.requests == [("a:u", 12, 0), ("a:u", 12, 9)]
    fake.version = 6
    _quorum(channel, "a:u")
    assert fake.rosters == 2  # a new membership: read again


def test_heartbeats_coalesce_and_a_leave_waits_for_the_step_boundary(shim) -> None:
    s, fake, clock, channel = shim
    for rid in ("a:u", "c:u"):
        _heartbeat(channel, rid)
    s.beat_once()
    assert fake.beats == [["a:u", "c:u"]]  # one Redis call for both
    clock.t += 0.6  # "c" froze: its manager went quiet (not yet past the 1 s timeout)
    _heartbeat(channel, "a:u")
    s.beat_once()
    assert fake.beats[-1] == ["a:u"]

    assert s.leave() == ["a:u", "c:u"]
    _heartbeat(channel, "a:u")
    s.beat_once()
    assert fake.left == ["c:u"]  # already quiet: left at once; "a" still trains
    assert fake.beats[-1] == ["a:u"]
    clock.t += 0.6  # "a"'s worker left at its step boundary: its manager stopped
    s.beat_once()
    assert fake.left == ["c:u", "a:u"]
    with pytest.raises(grpc.RpcError) as err:
        _quorum(channel, "a:u")
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "never rejoin under this id" in err.value.details()
    assert s.refused == ["a:u"]


def test_a_manager_silent_past_the_timeout_never_comes_back_under_its_id(shim) -> None:
    s, fake, clock, channel = shim
    _heartbeat(channel, "b:u")
    clock.t += 1.5  # frozen (SIGSTOP) past the heartbeat timeout, then woken
    _heartbeat(channel, "b:u")
    assert fake.left == ["b:u"]  # the quorum's own rule, applied even if no round swept it
    s.beat_once()
    assert ["b:u"] not in fake.beats
    with pytest.raises(grpc.RpcError) as err:
        _quorum(channel, "b:u")
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "silent for 1.5 s" in err.value.details()


def test_dropped_ids_are_refused_and_errors_map_to_status_codes(shim) -> None:
    s, fake, _, channel = shim
    fake.gone.add("b:u")
    _heartbeat(channel, "b:u")
    s.beat_once()  # Redis says it was dropped (it froze past the timeout)
    with pytest.raises(grpc.RpcError) as err:
        _quorum(channel, "b:u")
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "dropped" in err.value.details()
    assert not [r for r in fake.requests if r[0] == "b:u"]  # refused without asking Redis

    fake.fail = QuorumCorrupt("Redis key q:state holds a list")
    with pytest.raises(grpc.RpcError) as err:
        _quorum(channel, "a:u")
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "q:state" in err.value.details()
    for exc, code in (
        (QuorumTimeout("no quorum"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (QuorumGone("gone"), grpc.StatusCode.NOT_FOUND),
        (redis.ConnectionError("refused"), grpc.StatusCode.UNAVAILABLE),
        (redis.ResponseError("NOAUTH"), grpc.StatusCode.INTERNAL),
    ):
        assert status_of(exc)[0] is code
    # A requester missing from the roster (membership changed again): retryable.
    fake.fail = None
    with pytest.raises(grpc.RpcError) as err:
        _quorum(channel, "zz:u")
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE


def test_the_workers_watchdog_reads_heartbeat_ages_through_the_shim(shim) -> None:
    s, fake, clock, _ = shim
    read = shim_ages(s.address)
    fake.gone.add("b:u")
    assert read(("a:u", "b:u")) == {"a:u": 0.25}  # "b" gone: no age, so it counts as lost
    read(("a:u", "b:u"))  # a second rank of the node polls just after: the same read
    assert fake.age_reads == 1
    clock.t += 1.0
    read(("a:u", "b:u"))
    assert fake.age_reads == 2


def test_rebuild_is_cheap_and_byte_exact() -> None:
    roster = fake_roster(50)
    cache = RosterCache()
    behind = {roster.members[3].replica_id: 7, roster.members[49].replica_id: 8}
    answer = Answer(4, 0, 50, 2**40, None, 1, 0, "e", behind)
    body = cache.response(answer, roster.members[0].replica_id, lambda: roster, created=5.5)
    q = proto.LighthouseQuorumResponse.FromString(body).quorum
    expected = proto.Quorum(quorum_id=4)
    for m in roster.members:
        expected.participants.add(
            replica_id=m.replica_id,
            address=m.address,
            store_address=m.store_address,
            world_size=m.world_size,
            step=behind.get(m.replica_id, 2**40),
        )
    expected.created.seconds, expected.created.nanos = 5, 500_000_000
    assert q == expected
    assert rebuild_cost(100, repeats=1) >= 0.0  # BENCH's entry point runs


def test_a_replica_that_just_asked_for_a_quorum_sends_no_heartbeat() -> None:
    # A request is a heartbeat in Redis too: at 12,500 VMs the coalesced heartbeats would
    # otherwise add N x 5 / timeout script calls a second to the per-step requests.
    fake, clock = FakeQuorum(), FakeClock()
    s = LighthouseShim(fake, fake, QuorumConfig(), heartbeat_interval_s=0.2, clock=clock).start()
    channel = grpc.insecure_channel(s.address)
    try:
        _quorum(channel, "a:u")
        _heartbeat(channel, "c:u")
        s.beat_once()
        assert fake.beats == [["c:u"]]  # "a" asked within the interval
        clock.t += 0.25
        for rid in ("a:u", "c:u"):
            _heartbeat(channel, rid)
        s.beat_once()
        assert fake.beats[-1] == ["a:u", "c:u"]  # its request is older than the interval
    finally:
        channel.close()
        s.stop(0)


def test_a_refused_replica_is_told_at_once_and_its_workers_guard_ends_the_wait(shim) -> None:
    s, fake, clock, channel = shim
    ask = shim_refused(s.address)
    _heartbeat(channel, "b:u")
    assert ask("b:u") is None and ask("never-seen:u") is None
    calls: list[tuple[str, str]] = []
    told = threading.Event()
    guard = RefusalGuard(ask, lambda rid, why: (calls.append((rid, why)), told.set()), poll_s=0.01)
    try:
        # A quorum under way for a live id: the guard asks, learns nothing, does nothing.
        guard.arm("b:u")
        deadline = time.monotonic() + 10
        while guard.asked < 3 and time.monotonic() < deadline:
            told.wait(0.01)
        assert guard.asked >= 3 and calls == []
        guard.disarm()
        # Frozen past the timeout, then woken: the manager's heartbeat gets it refused; its
        # Quorum call fails at once (torchft would retry it for its whole quorum timeout) ...
        clock.t += 1.5
        _heartbeat(channel, "b:u")
        assert fake.left == ["b:u"]
        with pytest.raises(grpc.RpcError) as err:
            _quorum(channel, "b:u")
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        assert s.refused_why("b:u") == ask("b:u") and "silent for 1.5 s" in str(ask("b:u"))
        # ... and the worker's guard, armed for that call, ends its wait.
        guard.arm("b:u")
        assert told.wait(10), "the guard never reported the refusal"
        assert calls == [("b:u", str(ask("b:u")))]
        assert ask("a:u") is None  # others go on
    finally:
        guard.stop()
