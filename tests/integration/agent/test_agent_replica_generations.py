"""A replica slot outlives its rendezvous: real agents, real torchrun, real Redis.

A replica that leaves on a notice has its workers exit 0, and torch's elastic agent then
closes the replica's rendezvous for good. The slot's next claimant must start a new
generation of it, not fail with ``RendezvousClosedError`` (the bug a three-replica
``spottrain up`` of examples/local_replica_job.yaml met: every backfilled VM failed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from test_agent_replica_launch import AGENT, dumps, events, finish, start_agents, wait_for

from spottrain.agent.replica_launch import replica_rdzv_id
from spottrain.agent.replica_slots import read_slots
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

# The nodes in $LEAVERS (default "a") train until a drain request appears in Redis, then
# leave and exit 0 as the replica engine's ranks do together (no signal, so torchrun closes
# its rendezvous); any other node dumps its environment and finishes at once.
LEAVE_ON_DRAIN = """
import json, os, pathlib, sys, time
from spottrain.protocol.keys import RunKeys
from spottrain.redis_conn import connect, settings_from_url
node = os.environ["SPOTTRAIN_NODE_ID"]
out = pathlib.Path(os.environ["DUMP_DIR"])
(out / f"{node}-{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
if node not in os.environ.get("LEAVERS", "a").split(","):
    sys.exit(0)
client = connect(settings_from_url(os.environ["SPOTTRAIN_REDIS"]))
requests = RunKeys(os.environ["SPOTTRAIN_RUN_ID"]).ckpt_requests
while not client.hlen(requests):
    time.sleep(0.05)
sys.exit(0)
"""


@pytest.fixture
def run_id(redis_client: redis.Redis) -> Iterator[str]:
    rid = f"gen-{uuid.uuid4().hex[:8]}"
    yield rid
    stale = list(redis_client.scan_iter(match=f"{RunKeys(rid).prefix}:{{{rid}*"))
    if stale:
        redis_client.delete(*stale)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "leave_on_drain.py"
    path.write_text(LEAVE_ON_DRAIN)
    (tmp_path / "dumps").mkdir()
    return path


def notify(redis_server: RedisServer, run_id: str, node: str) -> None:
    subprocess.run(
        [
            *AGENT,
            "notify",
            f"--redis={redis_server.endpoint}",
            f"--run-id={run_id}",
            f"--node-id={node}",
            "--kind=terminate",
            "--in=60",
        ],
        check=True,
        capture_output=True,
    )


def of(client: redis.Redis, run_id: str, type_: str, node: str) -> dict[str, str]:
    [event] = [e for e in events(client, run_id, type_) if e["node"] == node]
    return event


@pytest.mark.slow
def test_a_backfill_of_a_slot_whose_replica_left_starts_a_new_rendezvous(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, script: Path
) -> None:
    keys = RunKeys(run_id)
    # The Redis quorum (the default) needs no lighthouse: each agent serves its own shim;
    # with a relay group, its shim also relays the group's requests.
    flags = ("--fault-tolerance=replica", "--poll-interval=0.2", "--sigterm-grace=60")
    relayed = ("--quorum-relay-group=2",)
    [a] = start_agents(redis_server, run_id, script, ["a"], *flags, *relayed)
    try:
        wait_for("a to join", lambda: redis_client.hget(keys.node("a"), "state") == b"joined")
        notify(redis_server, run_id, "a")
        [(code, out)] = finish([a])
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
    assert code == 0, out
    first = replica_rdzv_id(run_id, "replica-0", 1)
    env = dumps(script)["a-0"]
    assert env["TORCHELASTIC_RUN_ID"] == first
    started = of(redis_client, run_id, "quorum-shim-started", "a")
    shim = started["address"]
    # The one member of relay group 0 took its lease at start and said where it relays.
    taken = of(redis_client, run_id, "quorum-relay-taken", "a")
    assert taken["relay_group"] == started["relay_group"] == "0"
    assert taken["relay"] == started["relay"] and taken["relay"].startswith("127.0.0.1:")
    assert shim.startswith("127.0.0.1:") and env["SPOTTRAIN_QUORUM"] == "redis"
    assert env["TORCHFT_LIGHTHOUSE"] == f"http://{shim}" and env["SPOTTRAIN_LIGHTHOUSE"] == shim
    assert of(redis_client, run_id, "torchrun-exited", "a")["code"] == "0"
    # The drain reports the leave the agent made: the replica's own rendezvous.
    assert of(redis_client, run_id, "drained", "a")["left_rendezvous"] == "true"
    assert redis_client.hexists(RunKeys(first).rdzv_gone, of_member(redis_client, first, "a"))
    assert read_slots(redis_client, keys) == {}

    # The backfill: the same slot, a new generation, a rendezvous that completes.
    [(code, out)] = finish(start_agents(redis_server, run_id, script, ["b"], *flags))
    assert code == 0, out
    second = replica_rdzv_id(run_id, "replica-0", 2)
    env = dumps(script)["b-0"]
    assert env["SPOTTRAIN_REPLICA_ID"] == "replica-0"
    assert env["TORCHELASTIC_RUN_ID"] == second and env["WORLD_SIZE"] == "1"
    started = of(redis_client, run_id, "torchrun-started", "b")
    assert (started["gen"], started["rdzv_id"]) == ("2", second)
    assert f"--rdzv-id={second}" in json.loads(started["command"])
    assert redis_client.hget(keys.replica_generations, "replica-0") == b"2"
    # The closed generation's keys do not pile up: each expires with the rendezvous' TTL.
    old = list(redis_client.scan_iter(match=f"{RunKeys(first).base}:*"))
    assert old and all(redis_client.pttl(k) > 0 for k in old), old


@pytest.mark.slow
def test_a_two_node_replica_left_on_one_nodes_notice_is_refilled_in_a_new_generation(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_id: str,
    script: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One notice, and the whole replica leaves (its ranks agree on the leave): the noticed
    node drains, its peer's torchrun ends too (exit 0, "training finished"); both give the
    slot back, and two backfills start generation 2 and rendezvous as a pair."""
    monkeypatch.setenv("LEAVERS", "a,b")
    keys = RunKeys(run_id)
    redis_client.set(keys.replica_lighthouse, "127.0.0.1:29510")
    flags = (
        "--fault-tolerance=replica",
        "--nodes-per-replica=2",
        "--poll-interval=0.2",
        "--sigterm-grace=60",
    )
    pair = start_agents(redis_server, run_id, script, ["a", "b"], *flags)
    try:
        wait_for(
            "a and b to join",
            lambda: all(redis_client.hget(keys.node(n), "state") == b"joined" for n in "ab"),
        )
        notify(redis_server, run_id, "a")
        results = finish(pair)
    finally:
        for proc in pair:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert [code for code, _ in results] == [0, 0], results
    assert of(redis_client, run_id, "drained", "a")["left_rendezvous"] == "true"
    assert redis_client.hget(keys.node("b"), "state") == b"left"
    assert read_slots(redis_client, keys) == {}

    backfill = finish(start_agents(redis_server, run_id, script, ["c", "d"], *flags))
    assert [code for code, _ in backfill] == [0, 0], backfill
    envs = dumps(script)
    second = replica_rdzv_id(run_id, "replica-0", 2)
    new = [env for name, env in envs.items() if name[0] in "cd"]
    assert len(new) == 2
    assert {(e["TORCHELASTIC_RUN_ID"], e["WORLD_SIZE"]) for e in new} == {(second, "2")}
    assert sorted(e["RANK"] for e in new) == ["0", "1"]


def of_member(client: redis.Redis, rdzv_id: str, node: str) -> str:
    member = client.hget(RunKeys(rdzv_id).rdzv_members, node)
    assert member is not None, f"{node} never joined {rdzv_id}"
    return member.decode()
