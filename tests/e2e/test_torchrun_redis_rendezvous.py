"""End to end: real `torchrun --rdzv-backend=redis` nodes training on the CPU, and what a spot
fleet does to them."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys, make_run_id

from .elastic_job import ElasticJob

pytestmark = pytest.mark.slow

# 5 s without a heartbeat is death (the defaults); a round completes once all live nodes join.
START_TIMEOUT = 90
RECOVER_TIMEOUT = 60


@pytest.fixture
def job(redis_server: RedisServer, tmp_path: Path) -> Iterator[ElasticJob]:
    j = ElasticJob(tmp_path, redis_server.endpoint, f"e2e-{uuid.uuid4().hex[:8]}")
    yield j
    j.close(redis_server.client())


def start_three(job: ElasticJob) -> None:
    for n in ("a", "b", "c"):
        job.start_node(n)
    job.wait_for_world(3, START_TIMEOUT)


def test_survivors_go_on_when_nodes_are_killed_and_a_new_node_restores_full_size(
    job: ElasticJob,
) -> None:
    """One job through three changes (one start-up instead of three): a node without rank 0
    is killed, a new node joins, then the node holding rank 0 is killed."""
    start_three(job)
    victim = next(n for n in ("a", "b", "c") if n != job.rank0_node())
    before = max(r.step for r in job.records())
    job.nodes[victim].kill()
    killed_at = time.time()
    job.wait_for_world(2, RECOVER_TIMEOUT, since=killed_at)
    after = [r for r in job.records() if r.t >= killed_at and r.world == 2]
    assert {r.node for r in after} == {"a", "b", "c"} - {victim}
    # Training resumed from its checkpoint: no going back more than one step.
    assert min(r.step for r in after) >= before - 1
    assert max(r.step for r in after) > before

    # A new node joins and the job returns to full size.
    joined_at = time.time()
    job.start_node("d")
    job.wait_for_world(3, RECOVER_TIMEOUT, since=joined_at)
    assert "d" in {r.node for r in job.records() if r.t >= joined_at and r.world == 3}

    # The node holding rank 0 is killed: the other two go on, as ranks 0 and 1.
    victim = job.rank0_node()
    job.nodes[victim].kill()
    killed_at = time.time()
    job.wait_for_world(2, RECOVER_TIMEOUT, since=killed_at)
    after = [r for r in job.records() if r.t >= killed_at and r.world == 2]
    assert victim not in {r.node for r in after}
    assert {r.rank for r in after} == {0, 1}


def test_frozen_node_is_dropped_then_rejoins_as_a_new_member_without_split_brain(
    job: ElasticJob, redis_client: redis.Redis
) -> None:
    start_three(job)
    frozen_round = max(r.round for r in job.records() if r.world == 3)
    job.nodes["c"].freeze()
    frozen_at = time.time()
    first_w2 = job.wait_for_world(2, RECOVER_TIMEOUT, since=frozen_at)
    # Dropped within the heartbeat timeout (5 s) plus a restart, not gloo's 30 minutes.
    assert first_w2 - frozen_at < 40
    member_before = redis_client.hget(RunKeys(job.run_id).rdzv_members, "c")

    job.nodes["c"].thaw()
    thawed_at = time.time()
    job.wait_for_world(3, RECOVER_TIMEOUT * 2, since=thawed_at)
    recs = job.records()
    # The woken node never trained on in its old round, alone or with anyone.
    assert not [r for r in recs if r.t >= thawed_at and r.round <= frozen_round]
    # Every round has one world size: no two groups trained under one round.
    sizes: dict[int, set[int]] = {}
    for r in recs:
        sizes.setdefault(r.round, set()).add(r.world)
    assert all(len(s) == 1 for s in sizes.values()), sizes
    back = [r for r in recs if r.t >= thawed_at and r.world == 3]
    assert "c" in {r.node for r in back}
    member_after = redis_client.hget(RunKeys(job.run_id).rdzv_members, "c")
    assert member_after != member_before  # a new member, not the old one resurrected


def test_node_that_leaves_explicitly_is_not_waited_for(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # A 60 s heartbeat timeout: if the survivors waited for it, this test would time out.
    job = ElasticJob(
        tmp_path,
        redis_server.endpoint,
        f"e2e-{uuid.uuid4().hex[:8]}",
        rdzv_conf={"keep_alive_max_attempt": 60},
    )
    try:
        start_three(job)
        left_at = time.time()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "spottrain.agent.cli",
                "leave",
                "--redis",
                redis_server.endpoint,
                "--run-id",
                job.run_id,
                "--node-id",
                "c",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        first_w2 = job.wait_for_world(2, 45, since=left_at)
        assert first_w2 - left_at < 45
        # The node that left stops by itself.
        assert job.nodes["c"].wait(timeout=60) is not None
    finally:
        job.close(redis_server.client())


def test_redis_restart_does_not_stop_training(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path / "redis") as server:
        job = ElasticJob(tmp_path / "job", server.endpoint, "e2e-restart")
        try:
            job.start_node("a")
            job.start_node("b")
            job.wait_for_world(2, START_TIMEOUT)
            round_before = max(r.round for r in job.records())
            server.restart(down_for=3.0)  # longer than a heartbeat interval, persistence on
            restarted_at = time.time()
            job.wait_for(
                lambda rs: len({r.step for r in rs if r.t > restarted_at + 8}) >= 5,
                60,
                "training well past the restart",
            )
            recs = job.records()
            # Same round, same world size throughout: nobody restarted.
            assert {r.round for r in recs if r.t > restarted_at} == {round_before}
            assert {r.world for r in recs} == {2}
        finally:
            job.close(server.client())


def test_relaunch_under_the_same_job_name_starts_cleanly(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    first = ElasticJob(
        tmp_path / "one",
        redis_server.endpoint,
        make_run_id("relaunch", 1_800_000_000),
        nnodes="1:1",
        steps=5,
        step_time=0.01,
    )
    second = ElasticJob(
        tmp_path / "two",
        redis_server.endpoint,
        make_run_id("relaunch", 1_800_000_100),
        nnodes="1:1",
        steps=5,
        step_time=0.01,
    )
    try:
        assert first.start_node("a").wait(timeout=120) == 0, first.diagnose()
        # The finished run is closed; a relaunch gets a new run id and fresh keys.
        state = redis_server.client().hget(RunKeys(first.run_id).rdzv_state, "state")
        assert state is not None
        assert second.start_node("a").wait(timeout=120) == 0, second.diagnose()
        assert max(r.step for r in second.records()) == 5
    finally:
        first.close(redis_server.client())
        second.close(redis_server.client())
