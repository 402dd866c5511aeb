"""A node's torchrun and workers log in to Redis as a user of their run's own, made by the
agent: they reach their run's keys (its replicas' rendezvous too) and nothing else, and can
neither flush, reconfigure, list nor rewrite what other runs hold. A real Redis 7 with a
password; a Redis that refuses ACL SETUSER leaves the workers the run's password, said."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from spottrain.agent.known_secrets import KnownSecrets
from spottrain.agent.worker_acl import WorkerAcl, worker_credentials
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

PASSWORD = "run-pa55word-for-acl-tests"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as s:
        yield s


def _as(server: RedisServer, username: str, password: str) -> redis.Redis:
    return redis.Redis(host=server.host, port=server.port, username=username, password=password)


def test_the_workers_reach_their_runs_keys_only_and_no_admin_command(server: RedisServer) -> None:
    admin = server.client()
    keys, other = RunKeys("job-1795000000"), RunKeys("other-1795000001")
    admin.set(f"{other.base}:ctl", "theirs")
    creds = WorkerAcl(admin, keys, PASSWORD).ensure(0.0)
    assert creds == worker_credentials(keys, PASSWORD) and creds.password != PASSWORD
    worker = _as(server, creds.username, creds.password)
    # What the rendezvous and the SDK do: the run's keys, a replica's rendezvous, a script.
    worker.hset(f"{keys.base}:rdzv", "state", "1")
    worker.set(f"{RunKeys(keys.run_id + '.r0.g2').base}:rdzv", "1")
    assert worker.eval("return redis.call('INCR', KEYS[1])", 1, f"{keys.base}:n") == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.get(f"{other.base}:ctl")
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.set(f"{other.base}:ctl", "mine")
    for command in (
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "SET", "requirepass", "x"),
        ("KEYS", "*"),
        ("ACL", "SETUSER", creds.username, "~*"),
        ("SCRIPT", "FLUSH"),
        ("FUNCTION", "FLUSH"),
        ("SHUTDOWN", "NOSAVE"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.execute_command(*command)
    assert admin.get(f"{other.base}:ctl") == b"theirs"
    # A Redis that restarted without its ACLs gets the user back at the next check.
    admin.execute_command("ACL", "DELUSER", creds.username)
    acl = WorkerAcl(admin, keys, PASSWORD)
    assert acl.ensure(100.0) == creds
    assert _as(server, creds.username, creds.password).ping()


def test_the_workers_password_is_redacted_like_the_runs(server: RedisServer) -> None:
    keys = RunKeys("job-1795000000")
    creds = worker_credentials(keys, PASSWORD)
    known = KnownSecrets(environ={"SPOTTRAIN_REDIS_PASSWORD": PASSWORD}, run_keys=keys)
    said = known.redact(f"env: A={PASSWORD} B={creds.password}")
    assert PASSWORD not in said and creds.password not in said


def test_a_redis_that_cannot_make_the_user_leaves_the_run_password_and_says_why(
    server: RedisServer,
) -> None:
    admin = server.client()
    # A password that may not manage ACLs (as on a managed Redis).
    admin.execute_command("ACL", "SETUSER", "limited", "on", ">limited-pw", "~*", "+@all", "-acl")
    limited = _as(server, "limited", "limited-pw")
    acl = WorkerAcl(limited, RunKeys("job-1795000000"), "limited-pw")
    assert acl.ensure(0.0) is None and acl.ensure(50.0) is None
    assert "Redis refused to make the workers' user" in acl.problem
    assert "ACL SETUSER" in acl.problem and "limited-pw" not in acl.problem
    # Without a password there is nothing to limit.
    assert WorkerAcl(admin, RunKeys("job-1795000000"), None).ensure(0.0) is None
