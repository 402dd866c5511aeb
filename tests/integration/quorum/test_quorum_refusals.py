"""A Redis that refuses the quorum's writes for a reason of its own, against real redis-server
processes: a replica (READONLY), a demoted primary behind the run's address (a failover), a
full memory (OOM), a disk error (MISCONF), a long script (BUSY) and a load after a restart
(LOADING). Each is ridden out until the request's deadline, then named with its fix; none is
reported as a corrupt key to delete."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import redis
from quorum_harness import CutProxy, connect_to, joined, wait_until

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumRedisRefused
from spottrain.quorum.model import Member, QuorumConfig

# A heartbeat timeout far beyond each test: nobody is dropped while Redis refuses.
CONFIG = QuorumConfig(heartbeat_timeout_ms=30_000, join_timeout_ms=150, min_replicas=1)
KEYS = RunKeys("refusals-test")
SLACK_S = 5.0  # a loaded machine's margin past a request's own deadline; never a speed claim


@pytest.fixture
def primary() -> Iterator[RedisServer]:
    """The conftest's primary, but with protected configs (the MISCONF test points ``dir`` at
    a folder it then removes) and no AOF."""
    args = ["--enable-protected-configs", "yes", "--appendonly", "no"]
    with RedisServer(extra_args=args) as server:
        server.client().config_set("repl-diskless-sync-delay", 0)  # no 5 s wait to sync
        yield server


def _client(port: int) -> QuorumClient:
    return QuorumClient(connect_to(port), KEYS, CONFIG)


def _replica_of(replica: RedisServer, primary: RedisServer) -> None:
    replica.client().execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
    wait_until(lambda: replica.client().info("replication")["master_link_status"] == "up")


def _refused(call: Future[object], timeout: float, cause: str) -> str:
    """The message of the QuorumRedisRefused ``call`` raised by its deadline (plus slack)."""
    with pytest.raises(QuorumRedisRefused) as err:
        call.result(timeout + SLACK_S)
    assert err.value.cause == cause, err.value
    message = str(err.value)
    for wrong in ("not what spottrain", "delete the keys", "QCORRUPT", "script:"):
        assert wrong not in message
    return message


def _errors(server: RedisServer) -> int:
    return int(server.client().info("stats")["total_error_replies"])


def test_a_replica_refuses_and_the_request_names_the_failover_fix(primary, standby, pool) -> None:
    joined(_client(primary.port), "a")
    _replica_of(standby, primary)
    client = _client(standby.port)
    message = _refused(pool.submit(client.request, "a", 0, timeout=1.0), 1.0, "READONLY")
    assert message.startswith(
        f"the run's Redis at 127.0.0.1:{standby.port} is a read-only replica, not the primary"
    )
    assert "Point the run's Redis address at the new primary" in message
    # Without a deadline (a heartbeat, a join without a timeout) it is named at once.
    with pytest.raises(QuorumRedisRefused, match="read-only replica"):
        client.heartbeat(["a"])
    # The scripts pass Redis's own reply on (redis-py maps it), not a QCORRUPT.
    with pytest.raises(redis.ReadOnlyError):
        client._scripts["JOIN"](keys=client._keys_list, args=[*client._config_args, "b", "[]"])


def test_a_failover_behind_the_runs_address_is_ridden_out(primary, standby, pool) -> None:
    # The run's address (a proxy, as a DNS name would) moves to the promoted replica; the
    # client's connections to the demoted primary get UNBLOCKED, then READONLY, and new ones
    # follow the address.
    proxy = CutProxy(primary.port)
    client = joined(QuorumClient(connect_to(proxy.port), KEYS, CONFIG), "a", "b")
    first = [pool.submit(client.request, rid, 0, timeout=5.0) for rid in ("a", "b")]
    assert [f.result(5.0 + SLACK_S).quorum_id for f in first] == [1, 1]
    _replica_of(standby, primary)
    waiting = pool.submit(client.request, "a", 1, timeout=10.0)
    wait_until(lambda: any(c.get("cmd") == "blpop" for c in primary.client().client_list()))
    primary.client().execute_command("WAIT", 1, 5000)  # a's request is on the standby
    standby.client().execute_command("REPLICAOF", "NO", "ONE")
    proxy.target_port = standby.port
    primary.client().execute_command("REPLICAOF", "127.0.0.1", str(standby.port))
    other = client.request("b", 1, timeout=10.0)
    answer = waiting.result(10.0 + SLACK_S)
    assert (answer.max_step, answer.replica_count) == (other.max_step, other.replica_count)
    assert (answer.max_step, answer.replica_count) == (1, 2)
    # The round formed on the promoted replica (the demoted primary took no write since).
    assert int(standby.client().hget(KEYS.quorum_key("state"), "max_step")) == 1


def test_a_full_memory_is_named_and_ridden_out_once_freed(primary, pool) -> None:
    client = joined(_client(primary.port), "a")
    admin = primary.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    message = _refused(pool.submit(client.request, "a", 0, timeout=1.0), 1.0, "OOM")
    assert message.startswith(
        f"the run's Redis at 127.0.0.1:{primary.port} refuses the quorum's writes because its "
        "memory is full (OOM command not allowed when used memory > 'maxmemory'.)"
    )
    assert "Raise maxmemory" in message and "keep maxmemory-policy noeviction" in message
    # Reads in a transaction are refused too (OOM refuses all of MULTI): named, not corrupt.
    with pytest.raises(QuorumRedisRefused, match="memory is full"):
        client.roster()
    errors = _errors(primary)
    call = pool.submit(client.request, "a", 0, timeout=10.0)
    wait_until(lambda: _errors(primary) > errors, 10.0, "a refused write")
    admin.config_set("maxmemory", 0)
    assert call.result(10.0 + SLACK_S).quorum_id == 1


def _break_disk(server: RedisServer) -> str:
    """Make ``server`` refuse writes with MISCONF: a snapshot into a removed folder fails."""
    admin = server.client()
    gone = tempfile.mkdtemp(prefix="spottrain-misconf-")
    admin.config_set("dir", gone)
    admin.config_set("save", "3600 1")
    shutil.rmtree(gone)
    admin.bgsave()
    wait_until(lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "err")
    return gone


def test_a_disk_error_is_named_and_ridden_out_once_fixed(primary, pool) -> None:
    client = joined(_client(primary.port), "a")
    _break_disk(primary)
    message = _refused(pool.submit(client.request, "a", 0, timeout=1.0), 1.0, "MISCONF")
    assert message.startswith(
        f"the run's Redis at 127.0.0.1:{primary.port} refuses writes because it cannot "
        "persist to disk (MISCONF Redis is configured to save RDB snapshots"
    )
    assert "rdb_last_bgsave_status" in message and "writes resume once a save" in message
    errors = _errors(primary)
    call = pool.submit(client.request, "a", 0, timeout=10.0)
    wait_until(lambda: _errors(primary) > errors, 10.0, "a refused write")
    fixed = tempfile.mkdtemp(prefix="spottrain-misconf-")
    try:
        admin = primary.client()
        admin.config_set("dir", fixed)
        admin.bgsave()
        assert call.result(10.0 + SLACK_S).quorum_id == 1
        admin.config_set("save", "")  # its shutdown saves nothing into a removed folder
    finally:
        shutil.rmtree(fixed, ignore_errors=True)


def test_a_long_script_is_waited_out(primary, pool) -> None:
    client = joined(_client(primary.port), "a")
    primary.client().config_set("busy-reply-threshold", 50)
    spin = (  # a script of someone else's, 1.5 s long: Redis answers BUSY meanwhile
        "local t = redis.call('TIME'); local s = t[1] * 1e6 + t[2]; "
        "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - s > 1.5e6; return 1"
    )
    spinning = pool.submit(primary.client().eval, spin, 0)
    busy = redis.Redis(port=primary.port, retry=None)
    wait_until(lambda: _busy(busy), 5.0, "Redis busy with the script")
    answer = client.request("a", 0, timeout=15.0)
    assert answer.quorum_id == 1 and spinning.result(5.0) == 1
    assert _errors(primary) > 0


def _busy(client: redis.Redis) -> bool:
    try:
        client.ping()
    except redis.ResponseError as e:
        return str(e).startswith("BUSY ")
    return False


def test_a_redis_loading_its_data_is_named_then_waited_out(pool) -> None:
    server = RedisServer()
    try:
        server.start()
        joined(_client(server.port), "a")
        filler = server.client().pipeline(transaction=False)
        for i in range(4000):
            filler.set(f"filler:{i}", "x" * 100)
        filler.execute()
        server.client().bgrewriteaof()  # an RDB base: its load is slowed below
        wait_until(lambda: server.client().info("persistence")["aof_rewrite_in_progress"] == 0)
        server.stop()
        # 4000 keys at 0.5 ms each: two seconds of LOADING replies (longer on a slow box).
        server.extra_args = [
            "--key-load-delay", "500", "--loading-process-events-interval-bytes", "1024",
        ]  # fmt: skip
        starting = threading.Thread(target=server.start, kwargs={"timeout": 60}, daemon=True)
        starting.start()
        wait_until(lambda: _loading(server.port), 10.0, "Redis loading")
        client = _client(server.port)
        message = _refused(pool.submit(client.request, "a", 0, timeout=0.5), 0.5, "LOADING")
        assert message.startswith(
            f"the run's Redis at 127.0.0.1:{server.port} is loading its data into memory"
        )
        assert "Wait for the load" in message
        assert client.request("a", 0, timeout=30.0).quorum_id == 1
        starting.join(30)
    finally:
        server.close()


def _loading(port: int) -> bool:
    try:
        redis.Redis(port=port, retry=None, socket_timeout=1).ping()
    except redis.BusyLoadingError:
        return True
    except redis.RedisError:
        pass
    return False


def test_a_join_with_a_timeout_rides_out_refused_writes(primary, standby) -> None:
    joined(_client(primary.port), "a")
    primary.client().config_set("min-replicas-to-write", 1)
    client = _client(primary.port)
    with pytest.raises(QuorumRedisRefused):  # no timeout: named at once
        client.join(Member("b"))
    attach = threading.Timer(0.5, _replica_of, (standby, primary))
    attach.start()
    try:
        client.join(Member("b"), timeout=10.0)
    finally:
        attach.join()
    assert primary.client().hexists(KEYS.quorum_key("info"), "b")
