"""``wait_replicas`` and ``min-replicas-to-write`` against real Redis primaries and replicas: an
answer no Redis replica acknowledged is never returned (directly or through a relay), a
replica that attaches while the request waits lets it through, and a primary refusing writes
for want of a replica (NOREPLICAS) is ridden out until the deadline, then named."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future

import pytest
from quorum_harness import Fleet, connect_to, joined, wait_until

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumNotReplicated
from spottrain.quorum.model import Answer, BatchItem, QuorumConfig

# A heartbeat timeout far beyond each test: no replica is dropped while Redis refuses the
# heartbeats (or the test waits on a replica's sync).
CONFIG = QuorumConfig(heartbeat_timeout_ms=5000, join_timeout_ms=150, min_replicas=1)
KEYS = RunKeys("wait-replicas-test")
SLACK_S = 5.0  # a loaded machine's margin past a request's own deadline; never a speed claim


def _client(port: int, wait_replicas: int) -> QuorumClient:
    return QuorumClient(connect_to(port), KEYS, CONFIG, wait_replicas=wait_replicas)


def _attach(replica: RedisServer, primary: RedisServer) -> None:
    replica.client().execute_command("REPLICAOF", "127.0.0.1", str(primary.port))


def _waiting_in(primary: RedisServer, command: str) -> bool:
    return any(c.get("cmd") == command for c in primary.client().client_list())


def _raises_in_time(call: Future[object], timeout: float) -> QuorumNotReplicated:
    """The QuorumNotReplicated ``call`` raised, before its deadline plus the slack."""
    with pytest.raises(QuorumNotReplicated) as err:
        call.result(timeout + SLACK_S)
    return err.value


def test_an_answer_no_redis_replica_acknowledged_is_not_returned(primary, pool) -> None:
    client = joined(_client(primary.port, wait_replicas=1), "a")
    err = _raises_in_time(pool.submit(client.request, "a", 0, timeout=1.5), 1.5)
    message = str(err)
    assert message.startswith("quorum 1 for replica a formed, but only 0 of the 1 Redis ")
    assert "the primary has 0 connected" in message
    for fix in ("INFO replication", "master_link_status", "wait_replicas (--quorum-wait-"):
        assert fix in message
    # The unconfirmed id is held all the same: the next request floors the counter past it.
    assert client._held["a"] == 1


def test_a_replica_that_stopped_acknowledging_does_not_confirm(primary, standby, pool) -> None:
    # A replica still connected but silent (its link hung): a WAIT on a connection that wrote
    # nothing would count it at once, one after the quorum's own write counts 0.
    _attach(standby, primary)
    wait_until(lambda: standby.client().info("replication")["master_link_status"] == "up")
    client = joined(_client(primary.port, wait_replicas=1), "a")
    os.kill(standby.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        err = _raises_in_time(pool.submit(client.request, "a", 0, timeout=1.5), 1.5)
    finally:
        os.kill(standby.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
    assert "only 0 of the 1 Redis replicas" in str(err)
    assert "the primary has 1 connected" in str(err)


def test_a_replica_attaching_while_the_request_waits_lets_the_answer_through(
    primary, standby, pool
) -> None:
    client = joined(_client(primary.port, wait_replicas=1), "a")
    call = pool.submit(client.request, "a", 0, timeout=3.0)
    wait_until(lambda: _waiting_in(primary, "wait"), 3.0, "the client waiting in WAIT")
    _attach(standby, primary)
    answer = call.result(3.0 + SLACK_S)
    assert isinstance(answer, Answer) and answer.quorum_id == 1
    # Returned only once the replica held the round it came from.
    assert int(standby.client().hget(KEYS.quorum_key("state"), "qid")) == answer.quorum_id


def test_a_relay_batch_no_redis_replica_acknowledged_fails_every_member(primary) -> None:
    ids = ["m0", "m1", "m2"]
    client = joined(_client(primary.port, wait_replicas=1), *ids)
    started = time.monotonic()
    out = client.request_batch("relay", [BatchItem(rid, 0) for rid in ids], timeout=1.5)
    assert time.monotonic() - started < 1.5 + SLACK_S
    assert sorted(out) == ids
    for rid, got in out.items():
        assert isinstance(got, QuorumNotReplicated), got
        assert str(got).startswith(f"replica {rid}: quorum 1 for relay batch relay:")
        assert "only 0 of the 1 Redis replicas" in str(got)
    assert len({id(e) for e in out.values()}) == len(ids)  # one error object each


def _refusing(primary: RedisServer, *ids: str) -> None:
    joined(_client(primary.port, wait_replicas=0), *ids)
    primary.client().config_set("min-replicas-to-write", 1)


def test_a_primary_refusing_writes_for_want_of_a_replica_is_named(primary, pool) -> None:
    _refusing(primary, "a")
    client = _client(primary.port, wait_replicas=0)
    err = _raises_in_time(pool.submit(client.request, "a", 0, timeout=1.5), 1.5)
    message = str(err)
    assert message.startswith(
        "the run's Redis refuses the quorum's writes (NOREPLICAS Not enough good replicas "
        "to write.): it has min-replicas-to-write set"
    )
    assert "reconnect the missing replica" in message and "script:" not in message
    # Outside a request (no deadline to wait for) the refusal is named at once.
    with pytest.raises(QuorumNotReplicated, match="min-replicas-to-write"):
        client.heartbeat(["a"])


def test_a_relay_batch_refused_writes_fails_every_member(primary) -> None:
    _refusing(primary, "m0", "m1")
    client = _client(primary.port, wait_replicas=1)
    out = client.request_batch("relay", [BatchItem("m0", 0), BatchItem("m1", 0)], timeout=1.5)
    for rid, got in out.items():
        assert isinstance(got, QuorumNotReplicated), got
        assert str(got).startswith(f"replica {rid}: the run's Redis refuses the quorum's ")


def test_a_replica_attaching_before_the_deadline_ends_the_refusal(primary, standby, pool) -> None:
    _refusing(primary, "a")
    client = _client(primary.port, wait_replicas=1)  # the README's setup: both
    errors = primary.client().info("stats")["total_error_replies"]
    call = pool.submit(client.request, "a", 0, timeout=3.0)
    wait_until(
        lambda: primary.client().info("stats")["total_error_replies"] > errors,
        3.0,
        "a refused write",
    )
    _attach(standby, primary)
    answer = call.result(3.0 + SLACK_S)
    assert answer.quorum_id == 1 and answer.replica_count == 1
    assert int(standby.client().hget(KEYS.quorum_key("state"), "qid")) == 1


def test_wait_replicas_zero_never_waits_on_a_replica(primary) -> None:
    client = joined(_client(primary.port, wait_replicas=0), "a")
    assert client.request("a", 0, timeout=1.5).quorum_id == 1
    assert primary.client().exists(KEYS.quorum_key("waited")) == 0


def test_a_wait_cut_off_by_a_lost_connection_is_sent_again(primary, pool) -> None:
    # The WAIT's connection killed mid-wait: the client reconnects and waits again, and still
    # names the missing replica at the deadline rather than the lost connection.
    client = joined(_client(primary.port, wait_replicas=1), "a")
    call = pool.submit(client.request, "a", 0, timeout=2.0)
    wait_until(lambda: _waiting_in(primary, "wait"), 2.0, "the client waiting in WAIT")
    admin = primary.client()
    for c in admin.client_list():
        if c.get("cmd") == "wait":
            admin.client_kill_filter(_id=c["id"])
    err = _raises_in_time(call, 2.0)
    assert "only 0 of the 1 Redis replicas" in str(err)


def test_refused_writes_longer_than_the_heartbeat_timeout_drop_nobody(
    primary, standby, pool
) -> None:
    # Redis takes no heartbeat while it refuses writes: like a stall, that costs nobody its
    # place once a replica is back (the heartbeats resume, as the shim's do).
    fast = QuorumConfig(heartbeat_timeout_ms=600, join_timeout_ms=150, min_replicas=1)
    fleet = Fleet(QuorumClient(connect_to(primary.port), KEYS, fast), fast)
    try:
        fleet.add("a", "b")
        primary.client().config_set("min-replicas-to-write", 1)
        wait_until(lambda: len(fleet.hb.errors) >= 2, 3.0, "refused heartbeats")
        time.sleep(2 * fast.heartbeat_timeout_ms / 1000)
        calls = [fleet.ask(rid, 0, timeout=3.0) for rid in ("a", "b")]
        _attach(standby, primary)
        answers = [c.result(3.0 + SLACK_S) for c in calls]
    finally:
        fleet.close()
    assert [a.replica_count for a in answers] == [2, 2]
    assert isinstance(fleet.hb.errors[0], QuorumNotReplicated)
    assert primary.client().hlen(KEYS.quorum_key("gone")) == 0
