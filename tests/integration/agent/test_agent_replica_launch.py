"""Real agents in replica mode on the local cloud, against real Redis: each replica runs its
own torchrun over its own scoped rendezvous, and its workers get the replica's variables.
Elastic mode is checked to stay as it was."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from spottrain.agent.replica_launch import replica_rdzv_id
from spottrain.agent.replica_slots import read_slots
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

AGENT = [sys.executable, "-m", "spottrain.agent.cli"]
# The training command: every worker writes its environment and exits.
DUMP_ENV = """
import json, os, pathlib
out = pathlib.Path(os.environ["DUMP_DIR"])
(out / f"{os.environ['SPOTTRAIN_NODE_ID']}-{os.environ['RANK']}.json").write_text(
    json.dumps(dict(os.environ)))
"""
TIMEOUT_S = 120


@pytest.fixture
def run_id(redis_client: redis.Redis) -> Iterator[str]:
    rid = f"rep-{uuid.uuid4().hex[:8]}"
    yield rid
    # The replicas' rendezvous keys hang under their own ids ("<run>.replica-<j>").
    stale = list(redis_client.scan_iter(match=f"{RunKeys(rid).prefix}:{{{rid}*"))
    if stale:
        redis_client.delete(*stale)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "dump_env.py"
    path.write_text(DUMP_ENV)
    (tmp_path / "dumps").mkdir()
    return path


def start_agents(
    redis_server: RedisServer, run_id: str, script: Path, nodes: list[str], *flags: str
) -> list[subprocess.Popen[str]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTTRAIN_", "TORCHFT_"))}
    env = {**clean, "OMP_NUM_THREADS": "1", "DUMP_DIR": str(script.parent / "dumps")}
    return [
        subprocess.Popen(
            [
                *AGENT,
                "run",
                f"--redis={redis_server.endpoint}",
                f"--run-id={run_id}",
                f"--node-id={node}",
                "--no-health-check",
                "--max-restarts=0",
                *flags,
                "--",
                str(script),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in nodes
    ]


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    """Each agent's exit code and output; every process group is ended even on failure."""
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def dumps(script: Path) -> dict[str, dict[str, str]]:
    return {p.stem: json.loads(p.read_text()) for p in (script.parent / "dumps").glob("*.json")}


def events(client: redis.Redis, run_id: str, type_: str) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode() for k, v in fields.items()}
        for _, fields in client.xrange(RunKeys(run_id).events)
        if fields[b"type"] == type_.encode()
    ]


@pytest.mark.slow
def test_one_node_replicas_train_apart_with_the_replica_variables(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, script: Path
) -> None:
    keys = RunKeys(run_id)
    redis_client.set(keys.replica_lighthouse, "127.0.0.1:29510")
    procs = start_agents(
        redis_server,
        run_id,
        script,
        ["a", "b"],
        "--fault-tolerance=replica",
        "--quorum=lighthouse",
        "--min-replicas=2",
    )
    results = finish(procs)
    assert [code for code, _ in results] == [0, 0], results
    envs = dumps(script)
    assert sorted(envs) == ["a-0", "b-0"]
    replicas = {envs[w]["SPOTTRAIN_REPLICA_ID"] for w in envs}
    assert replicas == {"replica-0", "replica-1"}
    for env in envs.values():
        # Each replica is its own one-node world: they did not rendezvous together.
        assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0"
        assert env["SPOTTRAIN_LIGHTHOUSE"] == "127.0.0.1:29510"
        assert env["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:29510"
        assert env["SPOTTRAIN_MIN_REPLICAS"] == "2"
        assert env["SPOTTRAIN_NODES_PER_REPLICA"] == "1"
        assert env["SPOTTRAIN_FAULT_TOLERANCE"] == "replica"
        assert env["TORCHFT_MANAGER_PORT"] == env["SPOTTRAIN_MANAGER_PORT"]
        # torchft's manager logs warnings only, unless the operator set RUST_LOG.
        assert env["RUST_LOG"] == os.environ.get("RUST_LOG", "warn")
    # The local cloud's "VMs" share a host: each manager gets a port of its own.
    assert envs["a-0"]["SPOTTRAIN_MANAGER_PORT"] != envs["b-0"]["SPOTTRAIN_MANAGER_PORT"]
    for node in ("a", "b"):
        slot = envs[f"{node}-0"]["SPOTTRAIN_REPLICA_ID"]
        scoped = RunKeys(replica_rdzv_id(run_id, slot))
        assert list(redis_client.hkeys(scoped.rdzv_members)) == [node.encode()]
        assert redis_client.hget(keys.node(node), "replica") == slot.encode()
    assert not redis_client.exists(keys.rdzv_members), "the run's own rendezvous stays unused"
    started = {e["node"]: e for e in events(redis_client, run_id, "torchrun-started")}
    for node in ("a", "b"):
        assert started[node]["replica"] == envs[f"{node}-0"]["SPOTTRAIN_REPLICA_ID"]
        assert f"--rdzv-id={run_id}.{started[node]['replica']}" in started[node]["command"]
    assert read_slots(redis_client, keys) == {}, "a clean exit gives the slot back"


@pytest.mark.slow
def test_two_nodes_of_one_replica_rendezvous_together(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, script: Path
) -> None:
    # The agent's own lighthouse wins over the controller's.
    redis_client.set(RunKeys(run_id).replica_lighthouse, "127.0.0.1:1")
    procs = start_agents(
        redis_server,
        run_id,
        script,
        ["a", "b"],
        "--fault-tolerance=replica",
        "--quorum=lighthouse",
        "--nodes-per-replica=2",
        "--lighthouse=10.1.2.3:29510",
    )
    results = finish(procs)
    assert [code for code, _ in results] == [0, 0], results
    envs = dumps(script)
    assert sorted(envs) in (["a-0", "b-1"], ["a-1", "b-0"])
    for env in envs.values():
        assert env["SPOTTRAIN_REPLICA_ID"] == "replica-0"
        assert env["WORLD_SIZE"] == "2"
        assert env["SPOTTRAIN_LIGHTHOUSE"] == "10.1.2.3:29510"
    assert len({env["MASTER_PORT"] for env in envs.values()}) == 1


@pytest.mark.slow
def test_elastic_mode_is_unchanged(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, script: Path
) -> None:
    procs = start_agents(redis_server, run_id, script, ["a"], "--nodes-per-replica=4")
    [(code, out)] = finish(procs)
    assert code == 0, out
    [env] = dumps(script).values()
    assert not {k for k in env if k.startswith("TORCHFT_")}
    for name in ("REPLICA_ID", "MANAGER_PORT", "LIGHTHOUSE", "FAULT_TOLERANCE"):
        assert f"SPOTTRAIN_{name}" not in env
    [started] = events(redis_client, run_id, "torchrun-started")
    assert "replica" not in started
    assert f"--rdzv-id={run_id}" in json.loads(started["command"])
    assert "--nnodes=1:1" in json.loads(started["command"])
    assert not redis_client.exists(RunKeys(run_id).replica_slots)
    assert redis_client.hkeys(RunKeys(run_id).rdzv_members) == [b"a"]


def test_a_replica_without_a_lighthouse_fails_plainly(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, script: Path
) -> None:
    procs = start_agents(
        redis_server,
        run_id,
        script,
        ["a"],
        "--fault-tolerance=replica",
        "--quorum=lighthouse",
        "--lighthouse-wait=0",
    )
    [(code, out)] = finish(procs)
    assert code == 2, out
    keys = RunKeys(run_id)
    assert f"no lighthouse address in Redis key {keys.replica_lighthouse}" in out
    assert redis_client.hget(keys.node("a"), "state") == b"failed"
    assert read_slots(redis_client, keys) == {}, "the slot is given back"


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--fault-tolerance=replicas", "SPOTTRAIN_FAULT_TOLERANCE) must be elastic or replica"),
        ("--nodes-per-replica=two", "--nodes-per-replica 'two'"),
        ("--min-replicas=0", "min-replicas 0 (SPOTTRAIN_MIN_REPLICAS) must be at least 1"),
        ("--lighthouse=nowhere", "--lighthouse, SPOTTRAIN_LIGHTHOUSE) 'nowhere' is not HOST:PORT"),
    ],
)
def test_bad_replica_flags_get_one_line(
    redis_server: RedisServer, run_id: str, script: Path, flag: str, says: str
) -> None:
    [(code, out)] = finish(start_agents(redis_server, run_id, script, ["a"], flag))
    assert code == 2
    assert says in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


# A worker that trains until it is told to stop.
RUN_UNTIL_TERM = (
    DUMP_ENV
    + """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
"""
)


def wait_for(what: str, cond: object, timeout: float = TIMEOUT_S) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_drained_replica_leaves_only_its_own_rendezvous(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, script: Path
) -> None:
    script.write_text(RUN_UNTIL_TERM)
    keys = RunKeys(run_id)
    redis_client.set(keys.replica_lighthouse, "127.0.0.1:29510")
    procs = start_agents(
        redis_server,
        run_id,
        script,
        ["a", "b"],
        "--fault-tolerance=replica",
        "--poll-interval=0.2",
        "--sigterm-grace=7",
    )
    try:
        wait_for("both replicas' workers", lambda: len(dumps(script)) == 2)
        slot = {n: dumps(script)[f"{n}-0"]["SPOTTRAIN_REPLICA_ID"] for n in ("a", "b")}
        scoped = {n: RunKeys(replica_rdzv_id(run_id, slot[n])) for n in ("a", "b")}
        wait_for(
            "a and b to join",
            lambda: all(redis_client.hget(keys.node(n), "state") == b"joined" for n in ("a", "b")),
        )
        round_b = redis_client.hget(scoped["b"].rdzv_view, "round")
        subprocess.run(
            [
                *AGENT,
                "notify",
                f"--redis={redis_server.endpoint}",
                f"--run-id={run_id}",
                "--node-id=a",
                "--kind=terminate",
                "--in=6",
            ],
            check=True,
            capture_output=True,
        )
        [(code, out)] = finish(procs[:1])
        assert code == 0, out
        assert redis_client.hget(keys.node("a"), "state") == b"left"
        # a left its replica's rendezvous; b's replica never saw it and kept its round.
        gone_a = redis_client.hgetall(scoped["a"].rdzv_gone)
        assert b"left" in gone_a.values()
        assert redis_client.hlen(scoped["b"].rdzv_gone) == 0
        assert redis_client.hget(scoped["b"].rdzv_view, "round") == round_b
        assert procs[1].poll() is None and redis_client.hget(keys.node("b"), "state") == b"joined"
        assert read_slots(redis_client, keys) == {slot["b"]: ["b"]}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        finish(procs)


def test_leave_finds_a_replica_nodes_own_rendezvous(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    from spottrain.agent.replica_slots import claim_slot

    keys = RunKeys(run_id)
    slot = claim_slot(redis_client, keys, "a", 1).slot
    scoped = RunKeys(replica_rdzv_id(run_id, slot))
    redis_client.hset(scoped.rdzv_members, "a", "a-member-1")
    res = subprocess.run(
        [*AGENT, "leave", f"--redis={redis_server.endpoint}", f"--run-id={run_id}", "--node-id=a"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert res.returncode == 0, res.stderr
    assert redis_client.hget(scoped.rdzv_gone, "a-member-1") == b"left"
    assert not redis_client.exists(keys.rdzv_gone)
