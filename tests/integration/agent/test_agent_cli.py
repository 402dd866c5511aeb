"""`spottrain-agent run`, `notify` and `watch` as a user calls them: bad input gets a plain
error and a documented exit code, and the node's record says what happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fakes.metadata_server import MetadataServer

from spottrain.agent.notices.injected import parse_injected
from spottrain.agent.notices.notice import NoticeKind
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

AGENT = [sys.executable, "-m", "spottrain.agent.cli"]
FAILING_SCRIPT = "import sys; sys.exit(7)"


def agent(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPOTTRAIN_")}
    return subprocess.run(
        [*AGENT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.fixture
def run_id(redis_client: redis.Redis) -> Iterator[str]:
    rid = f"cli-{uuid.uuid4().hex[:8]}"
    yield rid
    keys = list(redis_client.scan_iter(match=RunKeys(rid).pattern))
    if keys:
        redis_client.delete(*keys)


def node_state(client: redis.Redis, run_id: str, node: str) -> str | None:
    raw = client.hget(RunKeys(run_id).node(node), "state")
    return raw.decode() if raw else None


def test_run_without_redis_names_the_option_and_the_variable() -> None:
    res = agent("run", "--run-id", "x-1", "--", "train.py")
    assert res.returncode == 2
    assert "--redis" in res.stderr and "SPOTTRAIN_REDIS" in res.stderr


def test_run_with_unreachable_redis_says_so(tmp_path: Path) -> None:
    res = agent(
        "run", f"--redis=127.0.0.1:{free_port()}", "--run-id=x-1", "--no-health-check", "--", "t.py"
    )
    assert res.returncode == 2
    assert "127.0.0.1" in res.stderr and "Redis" in res.stderr
    assert "Traceback" not in res.stderr


def test_run_without_a_training_command_says_how_to_give_one(redis_server: RedisServer) -> None:
    res = agent("run", f"--redis={redis_server.endpoint}", "--run-id=x-1")
    assert res.returncode == 2
    assert "SPOTTRAIN_TRAIN_CMD" in res.stderr and "--" in res.stderr


@pytest.mark.parametrize("nnodes", ["x", "0:2", "2:", "3:2"])
def test_run_with_bad_nnodes_is_refused(redis_server: RedisServer, nnodes: str) -> None:
    res = agent(
        "run",
        f"--redis={redis_server.endpoint}",
        "--run-id=x-1",
        f"--nnodes={nnodes}",
        "--",
        "t.py",
    )
    assert res.returncode == 2
    assert "nnodes" in res.stderr


def test_run_with_a_missing_checkpoint_directory_fails_plainly(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, tmp_path: Path
) -> None:
    missing = tmp_path / "not-mounted"
    res = agent(
        "run",
        f"--redis={redis_server.endpoint}",
        f"--run-id={run_id}",
        "--node-id=n1",
        f"--ckpt-dir={missing}",
        "--no-health-check",
        "--",
        "t.py",
    )
    assert res.returncode == 2, res.stderr
    assert str(missing) in res.stderr and "does not exist" in res.stderr
    assert node_state(redis_client, run_id, "n1") == "failed"
    assert not missing.exists(), "the agent must not create a directory where a mount belongs"


def test_a_node_without_the_gpus_it_expects_fails_its_health_check(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    res = agent(
        "run",
        f"--redis={redis_server.endpoint}",
        f"--run-id={run_id}",
        "--node-id=n1",
        "--expect-gpus=8",
        "--",
        "t.py",
    )
    assert res.returncode == 3, res.stderr
    assert "expected 8 GPUs" in res.stderr
    assert node_state(redis_client, run_id, "n1") == "failed"
    health = [f for _, f in redis_client.xrange(RunKeys(run_id).events) if f[b"type"] == b"health"]
    assert health and health[0][b"ok"] == b"false"


def test_a_healthy_cpu_node_runs_the_job_and_a_failing_script_fails_the_node(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, tmp_path: Path
) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    res = agent(
        "run",
        f"--redis={redis_server.endpoint}",
        f"--run-id={run_id}",
        "--node-id=n1",
        "--max-restarts=0",
        "--",
        str(script),
    )
    assert res.returncode == 1, res.stderr
    states = [
        f[b"state"].decode()
        for _, f in redis_client.xrange(RunKeys(run_id).events)
        if f[b"type"] == b"state"
    ]
    # It may or may not have joined a round before its worker failed.
    assert states in (["healthy", "failed"], ["healthy", "joined", "failed"])
    assert redis_client.exists(RunKeys(run_id).heartbeat("n1")) == 0


@pytest.mark.parametrize("key", ["password", "Password"])
def test_run_refuses_a_password_in_rdzv_conf_before_anything_starts(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, tmp_path: Path, key: str
) -> None:
    """torchrun would carry the password on its command line, and the torchrun-started
    event (which `spottrain logs` prints) would store it: nothing may start."""
    secret = f"hunter2-{uuid.uuid4().hex}"
    script = tmp_path / "ok.py"
    script.write_text("pass")
    res = agent(
        "run",
        f"--redis={redis_server.endpoint}",
        f"--run-id={run_id}",
        "--node-id=n1",
        "--no-health-check",
        f"--rdzv-conf=timeout=30,{key}={secret}",
        "--",
        str(script),
    )
    assert res.returncode == 2, res.stderr
    assert key in res.stderr and "SPOTTRAIN_REDIS_PASSWORD" in res.stderr
    assert secret not in res.stderr + res.stdout
    # Not even the node's registration reached Redis, let alone a torchrun-started event.
    assert list(redis_client.scan_iter(match=RunKeys(run_id).pattern)) == []


def test_notify_queues_a_notice_the_agent_understands(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    res = agent(
        "notify",
        f"--redis={redis_server.endpoint}",
        f"--run-id={run_id}",
        "--node-id=n1",
        "--kind=terminate",
        "--in=30",
    )
    assert res.returncode == 0, res.stderr
    raw = redis_client.lpop(RunKeys(run_id).notices("n1"))
    assert isinstance(raw, bytes)
    notice = parse_injected(raw)
    assert notice.kind is NoticeKind.TERMINATE and notice.drains
    assert notice.deadline is not None and 25 < notice.deadline - notice.seen_at <= 30


@pytest.mark.parametrize(
    "raw", [b"[1]", b"not json", b'{"kind": "explode"}', b'{"kind": "terminate", "in": "x"}']
)
def test_a_malformed_injected_notice_is_refused(raw: bytes) -> None:
    with pytest.raises((ValueError, TypeError)):
        parse_injected(raw)


def test_watch_is_wired_into_the_agent_command() -> None:
    with MetadataServer() as fake:
        fake.set_spot_action("terminate", "2030-01-01T00:00:00Z")
        res = agent("watch", "--cloud=aws", f"--endpoint={fake.url}", "--once", timeout=30)
    assert res.returncode == 0, res.stderr
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["source"] == "aws-imds:spot" and line["kind"] == "terminate"
    assert line["deadline"] == pytest.approx(1893456000.0)


@pytest.mark.parametrize("key", ["password", "TOKEN"])
def test_an_agent_built_in_code_refuses_a_password_in_its_rdzv_conf(key: str) -> None:
    """Not only the command line: an Agent configured in code refuses it before it touches
    Redis or starts anything."""
    from spottrain.agent.agent import Agent
    from spottrain.agent.config import AgentConfig, AgentConfigError

    cfg = AgentConfig(
        redis_url="redis://127.0.0.1:1/0",  # never reached
        run_id="run-1",
        node_id="n0",
        train_cmd=["train.py"],
        rdzv_conf={key: "hunter2-secret"},
    )
    with pytest.raises(AgentConfigError, match=f"rdzv_conf {key} is refused") as err:
        Agent(cfg)
    assert "hunter2-secret" not in str(err.value)


def test_an_injected_notice_is_identified_by_its_body() -> None:
    one = parse_injected(b'{"kind": "terminate", "in": 60}')
    again = parse_injected(b'{"in": 60, "kind": "terminate"}')
    other = parse_injected(b'{"kind": "terminate", "in": 30}')
    assert one.source == "redis" and one.dedup_key == again.dedup_key
    assert other.dedup_key != one.dedup_key
