"""Relays for real: lighthouse shims on a real Redis in relay groups of 2, fake managers
calling each shim's LighthouseService over gRPC; the relay's shim process is SIGKILLed
mid-run and its group's member falls back directly, nobody else is dropped, and the lease
moves to the survivor."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import redis

from spottrain.agent.quorum_shim import proto
from spottrain.agent.quorum_shim.local import RelayPlan, start_local_shim
from spottrain.agent.quorum_shim.member import RelayedQuorum
from spottrain.agent.quorum_shim.relay import lease_key
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.model import QuorumConfig
from spottrain.redis_conn import RedisSettings

CONFIG = QuorumConfig(heartbeat_timeout_ms=600, join_timeout_ms=150, min_replicas=1)

_SHIM = """
import sys, time
from spottrain.agent.quorum_shim.local import RelayPlan, start_local_shim
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.model import QuorumConfig
from spottrain.redis_conn import RedisSettings
port, relay_port, run = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
addr = f"127.0.0.1:{relay_port}"
shim = start_local_shim(RedisSettings(host="127.0.0.1", port=port), RunKeys(run),
                 QuorumConfig(heartbeat_timeout_ms=600, join_timeout_ms=150),
                 relay=RelayPlan(group=0, bind=addr, address=addr))
print("ready", shim.address, flush=True)
time.sleep(600)
"""


class Manager:
    """torchft's manager as the shim sees it: heartbeats, and one Quorum call per step."""

    def __init__(self, rid: str, address: str) -> None:
        self.rid, self.channel = rid, grpc.insecure_channel(address)
        self.rounds: list[tuple[int, int, list[str]]] = []  # (qid, max step, members)
        self.error: grpc.RpcError | None = None
        self.stop = threading.Event()
        self._quorum = self.channel.unary_unary(
            proto.QUORUM_METHOD,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=proto.LighthouseQuorumResponse.FromString,
        )
        self._beat = self.channel.unary_unary(
            proto.HEARTBEAT_METHOD,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=proto.LighthouseHeartbeatResponse.FromString,
        )
        for target in (self._beats, self._steps):
            threading.Thread(target=target, daemon=True).start()

    def _beats(self) -> None:
        while not self.stop.wait(0.05):
            with contextlib.suppress(grpc.RpcError):
                self._beat(proto.LighthouseHeartbeatRequest(replica_id=self.rid), timeout=1)

    def _steps(self) -> None:
        step = 0
        while not self.stop.is_set():
            me = proto.QuorumMember(
                replica_id=self.rid, address=f"http://{self.rid}", store_address="s:1", step=step
            )
            try:
                q = self._quorum(proto.LighthouseQuorumRequest(requester=me), timeout=10).quorum
            except grpc.RpcError as exc:
                self.error = exc
                return
            steps = [p.step for p in q.participants]
            self.rounds.append((q.quorum_id, max(steps), [p.replica_id for p in q.participants]))
            step = max(steps) + 1


def _until(what: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_killed_relay_costs_a_fallback_not_a_replica(
    redis_server: object, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    port = redis_server.port  # type: ignore[attr-defined]
    a_relay = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SHIM, str(port), str(a_relay), run_keys.run_id],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    shims, managers = [], []
    try:
        assert proc.stdout is not None
        ready, a_address = proc.stdout.readline().split()
        assert ready == "ready"
        key0 = lease_key(run_keys, 0)
        assert redis_client.get(key0) == f"127.0.0.1:{a_relay}".encode()  # A is group 0's relay
        settings = RedisSettings(host="127.0.0.1", port=port)
        told: dict[str, list[bool]] = {"b": [], "c": [], "d": []}
        for name, group in zip("bcd", (0, 1, 1), strict=True):  # B in group 0; C, D in 1
            relay = free_port()
            plan = RelayPlan(group, f"127.0.0.1:{relay}", f"127.0.0.1:{relay}")
            shims.append(
                start_local_shim(settings, run_keys, CONFIG, relay=plan, on_lease=told[name].append)
            )
        b, c, d = (s.blocking for s in shims)
        assert isinstance(b, RelayedQuorum) and isinstance(c, RelayedQuorum)
        assert isinstance(d, RelayedQuorum)
        assert not b.holding and c.holding and not d.holding
        assert told == {"b": [], "c": [True], "d": []}  # the agent's quorum-relay-taken
        managers = [Manager(f"{n}:1", s.address) for n, s in zip("bcd", shims, strict=True)]
        a = Manager("a:1", a_address)  # A's own replica, through A's shim
        _until(lambda: all(len(m.rounds) >= 5 for m in [a, *managers]))
        assert managers[0].rounds[-1][2] == ["a:1", "b:1", "c:1", "d:1"]
        assert b.relayed >= 5 and b.fallbacks == 0 and d.relayed >= 5 and d.fallbacks == 0
        assert c.batcher.batches >= 5  # C's own replica and D's go in C's batches

        os.killpg(proc.pid, signal.SIGKILL)  # group 0's relay dies mid-run
        proc.wait(5)
        done = {m.rid: len(m.rounds) for m in managers}
        _until(lambda: all(len(m.rounds) >= done[m.rid] + 5 for m in managers))
        assert b.fallbacks >= 1  # B asked directly within its deadline
        assert all(m.error is None for m in managers)  # nobody dropped, nobody refused
        _until(lambda: b.holding, timeout=10)  # the lease lapsed; B took it
        assert redis_client.get(key0) == b.address.encode()
        relayed = b.relayed
        _until(lambda: b.relayed > relayed)  # B's requests go through its own batches now
        for m in managers:  # quorum ids never went back
            assert [r[0] for r in m.rounds] == sorted(r[0] for r in m.rounds)
        assert a.error is not None  # A's replica went with its VM
        assert managers[0].rounds[-1][2] == ["b:1", "c:1", "d:1"]
        assert told["b"] == [True]

        # Group 1's lease taken from C (as a lapse and another member's SET NX would): C
        # stops relaying and says so.
        redis_client.set(lease_key(run_keys, 1), "127.0.0.1:1", px=60_000)
        _until(lambda: not c.holding, timeout=10)
        assert told["c"] == [True, False] and told["d"] == []
    finally:
        for m in managers:
            m.stop.set()
        if "a" in locals():
            a.stop.set()
        for s in shims:
            s.stop(0)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()
