"""The shim's deadlines against real Redis servers, through a real gRPC channel: the
manager's call gets the quorum's own message before its gRPC deadline (the client's last
WAIT ends inside the shim's margin), and a join waits out a Redis refusing writes under the
call's deadline instead of failing it at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import grpc
import pytest

from spottrain.agent.quorum_shim import proto
from spottrain.agent.quorum_shim.local import start_local_shim
from spottrain.agent.quorum_shim.server import LighthouseShim
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.model import QuorumConfig
from spottrain.redis_conn import RedisSettings

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


def _shim(server: RedisServer, wait_replicas: int) -> LighthouseShim:
    settings = RedisSettings(host="127.0.0.1", port=server.port)
    return start_local_shim(settings, KEYS, CONFIG, wait_replicas=wait_replicas)


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


def test_the_manager_gets_the_quorums_message_before_its_own_deadline(primary) -> None:
    # No Redis replica to acknowledge the round: the client WAITs until its deadline. Its
    # last WAIT must end inside the shim's margin, or the manager sees only "Deadline
    # Exceeded" from gRPC instead of what to fix.
    shim = _shim(primary, wait_replicas=1)
    try:
        for _ in range(3):  # the overrun was a matter of where the last WAIT slice fell
            with pytest.raises(grpc.RpcError) as err:
                _quorum(shim, "a", deadline_s=1.5)
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
    shim = _shim(primary, wait_replicas=0)
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
