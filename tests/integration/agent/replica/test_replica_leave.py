"""Replica mode's state on disk and the leave on notice, with the Redis quorum, real managers
and Redis: all replicas lost resumes from the last checkpoint; a leaver that is not the last
holder writes nothing and, leaving the quorum explicitly, costs its survivors no heartbeat
timeout; the last holder's leave writes an emergency checkpoint.

Each test prints the figures it measures (``pytest -s ... | grep FIGURE``)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis
from replica_cluster import Cluster, figure, max_gap, wait_for

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import Manifest
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

pytestmark = pytest.mark.slow

ARGS = ("--steps", "100000", "--step-time", "0.03")


def newest(ckpt: Path) -> Manifest | None:
    found = CheckpointDir(ckpt).find_restorable()
    return found.manifest if found is not None else None


def test_all_replicas_lost_resumes_from_the_last_checkpoint(
    cluster: Cluster, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    a = cluster.start("replica-0", *ARGS, "--every-steps", "5", ckpt=ckpt)
    b = cluster.start("replica-1", *ARGS, "--every-steps", "5", ckpt=ckpt)
    wait_for(lambda: (m := newest(ckpt)) is not None and m.step >= 15, 90, "a checkpoint")
    for rep in (a, b):
        os.killpg(rep.proc.pid, signal.SIGKILL)
        rep.proc.wait(timeout=10)
    saved = newest(ckpt)
    assert saved is not None and saved.kind == "periodic"
    assert saved.extra["replica"] in ("replica-0", "replica-1")
    # The state after `saved.step` committed steps, as the replicas recorded it.
    digest = {r["step"] + 1: r["digest"] for rep in (a, b) for r in rep.committed()}

    # A replacement VM boots long after the dead replicas' holder rows went stale (10 s);
    # the test does not wait for that.
    assert cluster.redis_url and cluster.run_id
    redis.Redis.from_url(f"redis://{cluster.redis_url}").delete(
        RunKeys(cluster.run_id).replica_holders
    )
    c = cluster.start("replica-2", *ARGS, "--every-steps", "5", ckpt=ckpt)
    start = wait_for(lambda: c.events("start"), 60, "the new replica to start")[0]
    assert start["step"] == saved.step
    assert start["digest"] == digest[saved.step]  # bitwise the saved state
    wait_for(lambda: c.reached() >= saved.step + 3, 60, "training on from the checkpoint")
    assert c.committed()[0]["step"] == saved.step
    figure("load_s", start["restore_s"])


def _holder(client: redis.Redis, keys: RunKeys, replica: str) -> dict[str, object]:
    raw = client.hget(keys.replica_holders, replica)
    return json.loads(raw) if raw else {}


def test_leave_on_notice_then_the_last_holder_saves(
    cluster: Cluster,
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_keys: RunKeys,
) -> None:
    cluster.redis_url, cluster.run_id = redis_server.endpoint, run_keys.run_id
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    a, b, c = (cluster.start(f"replica-{j}", *ARGS, ckpt=ckpt) for j in range(3))
    names = ("replica-0", "replica-1", "replica-2")
    wait_for(
        lambda: (
            all(_holder(redis_client, run_keys, r).get("state") == "live" for r in names)
            and min(rep.reached() for rep in (a, b, c)) >= 5
        ),
        90,
        "three replicas to hold the state",
    )
    row = _holder(redis_client, run_keys, "replica-0")
    assert {"step", "quorum_id", "participants", "discarded", "at"} <= set(row)

    # A notice (the agent's shim marks the replica leaving, the workers get SIGTERM): not
    # the last holder, so no save. The leaver leaves the quorum once its manager stops, so
    # the survivors' next round forms at once, also from two replicas to one.
    for leaver, left in ((c, 2), (b, 1)):
        noticed_at = time.time()
        cluster.notice(leaver)
        assert leaver.proc.wait(timeout=30) == 0, leaver.tail()
        assert _holder(redis_client, run_keys, leaver.name)["state"] == "leaving"
        wait_for(
            lambda t=noticed_at, n=left: (
                sum(1 for r in a.committed() if r["t"] > t and r["participants"] == n) >= 5
            ),
            60,
            f"the survivors training as {left}",
        )
        assert newest(ckpt) is None  # the leaver was not the last holder
        figure(f"notice_stall_s[{left + 1}->{left}]", max_gap(a.steps(), noticed_at - 0.5))

    # A drain request for the last holder's node: it saves before it leaves.
    request = {"id": 1, "drain": True, "at": time.time(), "deadline": time.time() + 60}
    redis_client.hset(run_keys.ckpt_requests, "node-replica-0", json.dumps(request))
    assert a.proc.wait(timeout=60) == 0, a.tail()
    saved = newest(ckpt)
    assert saved is not None and saved.kind == "emergency"
    assert saved.step == a.reached()  # the state after its last committed step
    assert _holder(redis_client, run_keys, "replica-0")["state"] == "leaving"
