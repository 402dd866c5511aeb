"""The shim's deadlines through a real gRPC channel: the quorum client is given the call's
deadline less the shim's margin (and ends by it, its last WAIT included: test_quorum_confirm
and test_quorum_client_deadlines), so the manager gets the quorum's own message, not its
gRPC deadline; a join waits out a Redis refusing writes under the call's deadline instead of
failing it at once. Nothing here claims a speed: a loaded machine only uses up slack."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence

import grpc
import pytest

from spottrain.agent.quorum_shim import proto
from spottrain.agent.quorum_shim.local import start_local_shim
from spottrain.agent.quorum_shim.server import (
    ANSWER_MARGIN_S,
    DEFAULT_WAIT_S,
    LighthouseShim,
    answer_within_s,
)
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumNotFormed
from spottrain.quorum.model import Answer, Member, QuorumConfig, Roster
from spottrain.redis_conn import RedisSettings, connect

CONFIG = QuorumConfig(heartbeat_timeout_ms=5000, join_timeout_ms=150, min_replicas=1)
KEYS = RunKeys("shim-deadlines-test")


@pytest.fixture
def primary() -> Iterator[RedisServer]:
    with RedisServer() as server:
        server.client().config_set("repl-diskless-sync-delay", 0)
        yield server


@pytest.fixture
def standby() -> Iterator[RedisServer]:
    server = RedisServer()
    with server:
        yield server
        server.stop(signal.SIGKILL)  # a replica's SIGTERM shutdown can take seconds


def _shim(server: RedisServer, wait_replicas: int, answer_margin_s: float) -> LighthouseShim:
    settings = RedisSettings(host="127.0.0.1", port=server.port)
    blocking = QuorumClient(connect(settings), KEYS, CONFIG, wait_replicas=wait_replicas)
    control = QuorumClient(connect(settings), KEYS, CONFIG)
    return LighthouseShim(blocking, control, CONFIG, answer_margin_s=answer_margin_s).start()


def _quorum(shim: LighthouseShim, rid: str, deadline_s: float) -> proto.Quorum:
    with grpc.insecure_channel(shim.address) as channel:
        call = channel.unary_unary(
            proto.QUORUM_METHOD,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=proto.LighthouseQuorumResponse.FromString,
        )
        member = proto.QuorumMember(
            replica_id=rid, address=f"http://{rid}", store_address="s:1", step=0, world_size=1
        )
        request = proto.LighthouseQuorumRequest(requester=member)
        return call(request, timeout=deadline_s).quorum


class Recording:
    """A quorum backend that records the timeouts the shim gives it; no round forms."""

    def __init__(self) -> None:
        self.timeouts: list[tuple[str, float]] = []

    def join(self, member: Member, *, timeout: float = 0.0) -> None:
        self.timeouts.append(("join", timeout))

    def request(self, replica_id: str, step: int, **kw: float) -> Answer:
        self.timeouts.append(("request", kw["timeout"]))
        raise QuorumNotFormed(f"no quorum formed for replica {replica_id} in time")

    def heartbeat(self, replica_ids: Sequence[str]) -> list[str]:
        return []

    def leave(self, replica_id: str) -> None: ...

    def roster(self) -> Roster:
        return Roster(0, ())

    def heartbeat_ages(self, replica_ids: Sequence[str]) -> dict[str, float | None]:
        return {}


@pytest.mark.parametrize(
    ("sent_s", "arrived_s"),
    # What gRPC's encoding of the timeout turned these into at the server, as measured.
    [(1.0, 1.0092), (10.0, 10.0994), (60.0, 60.099), (100.0, 100.9995), (1000.0, 1009.9994)],
)
def test_the_wait_ends_before_the_callers_deadline_though_grpc_rounded_it_up(
    sent_s: float, arrived_s: float
) -> None:
    assert 0.0 < answer_within_s(arrived_s, ANSWER_MARGIN_S) <= sent_s - ANSWER_MARGIN_S


def test_a_call_without_a_deadline_waits_the_default_and_a_spent_one_not_at_all() -> None:
    assert answer_within_s(None, ANSWER_MARGIN_S) == DEFAULT_WAIT_S
    assert answer_within_s(0.05, ANSWER_MARGIN_S) == 0.0


def test_the_client_is_given_the_calls_deadline_less_the_margin() -> None:
    backend = Recording()
    assert LighthouseShim(backend, backend, CONFIG).answer_margin_s == ANSWER_MARGIN_S
    margin = 2.0  # wider than any delay of a loaded machine, so only the margin explains it
    shim = LighthouseShim(backend, backend, CONFIG, answer_margin_s=margin).start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            _quorum(shim, "a", deadline_s=10.0)
    finally:
        shim.stop(0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.details() == "no quorum formed for replica a in time"
    (join, join_s), (request, request_s) = backend.timeouts
    assert (join, request) == ("join", "request")
    # Both end by the call's deadline less the margin (the request's is what the join left),
    # though gRPC delivered that deadline rounded up (10 s arrives as 10.1 s).
    assert request_s <= join_s <= 10.0 - margin
    assert join_s > 10.0 - margin - 5.0  # not cut to nothing


def test_the_manager_gets_the_quorums_message_before_its_own_deadline(primary) -> None:
    # No Redis replica to acknowledge the round: the client WAITs until the deadline the shim
    # gave it, then raises why. The margin is widened so a loaded machine cannot make the
    # reply itself late: what is checked is that the message is the quorum's, end to end.
    shim = _shim(primary, wait_replicas=1, answer_margin_s=1.5)
    try:
        with pytest.raises(grpc.RpcError) as err:
            _quorum(shim, "a", deadline_s=3.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.value.details().startswith(
            "quorum 1 for replica a formed, but only 0 of the 1 Redis replicas"
        ), err.value.details()
    finally:
        shim.stop(0)


def test_a_join_waits_out_refused_writes_under_the_calls_deadline(primary, standby) -> None:
    # min-replicas-to-write with no Redis replica: Redis refuses the join (NOREPLICAS). The
    # call waits; a replica attaching within its deadline lets the join and the round through.
    primary.client().config_set("min-replicas-to-write", 1)
    settings = RedisSettings(host="127.0.0.1", port=primary.port)
    shim = start_local_shim(settings, KEYS, CONFIG)
    attach = threading.Timer(
        1.0,
        lambda: standby.client().execute_command("REPLICAOF", "127.0.0.1", str(primary.port)),
    )
    attach.start()
    try:
        quorum = _quorum(shim, "a", deadline_s=15.0)
    finally:
        attach.join()
        shim.stop(0)
    assert quorum.quorum_id == 1 and [p.replica_id for p in quorum.participants] == ["a"]
