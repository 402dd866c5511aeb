"""End to end: `spottrain-agent run` nodes training examples/gpt_train.py under real torchrun,
preempted the ways a spot fleet preempts them. Progress lost must be exactly zero."""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.testing.local_launcher import LocalAgentJob
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.notices import inject_notice

from .agent_job import (
    RECOVER_TIMEOUT,
    START_TIMEOUT,
    assert_no_progress_lost,
    emergency_commit,
    events,
    make_job,
    states,
    wait_drained,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def job(redis_server: RedisServer, tmp_path: Path) -> Iterator[LocalAgentJob]:
    j = make_job(redis_server, tmp_path)
    yield j
    j.close(redis_server.client())


def test_a_notice_at_a_random_step_loses_no_progress(
    job: LocalAgentJob, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    job.start_node("a")
    job.start_node("b")
    job.wait_for_world(2, START_TIMEOUT, steps=3)
    rng = random.Random()
    delay = rng.uniform(0.2, 2.0)
    time.sleep(delay)
    noticed = time.time()
    inject_notice(client, RunKeys(job.run_id), "b", "terminate", 60)
    job.wait_for_world(1, RECOVER_TIMEOUT, since=noticed, steps=3)
    wait_drained(job, "b")

    last = emergency_commit(client, job.run_id)
    assert last["kind"] == "emergency" and last["drain"] == "1", last
    step = int(last["step"])
    assert_no_progress_lost(job, noticed, step)
    # Every rank wrote its part of that one checkpoint, and it verifies.
    found = CheckpointDir(job.ckpt).find_restorable()
    assert found is not None and found.manifest.step >= step
    committed = CheckpointDir(job.ckpt).step_path(step)
    manifest = json.loads((committed / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 2
    assert {n for n in manifest["files"] if n.endswith(".distcp")} >= {
        "__0_0.distcp",
        "__1_0.distcp",
    }
    assert states(client, job.run_id, "b") == ["healthy", "joined", "draining", "left"]
    kinds = [e["type"] for e in events(client, job.run_id, "b")]
    for want in ("notice", "checkpoint-requested", "checkpoint-seen", "drained"):
        assert want in kinds, kinds
    drained = next(e for e in events(client, job.run_id, "b") if e["type"] == "drained")
    assert drained["left_rendezvous"] == "true" and int(drained["committed_step"]) == step
    # The node is out of the fleet view at once: its heartbeat key is gone.
    assert client.exists(RunKeys(job.run_id).heartbeat("b")) == 0
    record = client.hgetall(RunKeys(job.run_id).node("b"))
    assert record[b"state"] == b"left" and record[b"cloud"] == b"local"
    assert record[b"run_id"] == job.run_id.encode() and record[b"node_id"] == b"b"
    assert {b"zone", b"instance_type", b"gpus", b"address"} <= record.keys()
    assert client.sismember(RunKeys(job.run_id).nodes, "b")


def test_sigterm_to_the_whole_node_loses_no_progress(
    job: LocalAgentJob, redis_server: RedisServer
) -> None:
    """systemd at shutdown (KillMode=control-group): SIGTERM to the agent, torchrun and every
    worker at once. Workers join the emergency save instead of dying."""
    client = redis_server.client()
    job.start_node("a")
    job.start_node("b")
    job.wait_for_world(2, START_TIMEOUT, steps=3)
    time.sleep(random.uniform(0.2, 2.0))
    stopped = time.time()
    job.nodes["b"].signal_group(signal.SIGTERM)
    job.wait_for_world(1, RECOVER_TIMEOUT, since=stopped, steps=3)
    wait_drained(job, "b")
    last = emergency_commit(client, job.run_id)
    assert last["kind"] == "emergency" and last["drain"] == "1", last
    assert_no_progress_lost(job, stopped, int(last["step"]))
    assert states(client, job.run_id, "b")[-2:] == ["draining", "left"]
    notice = next(e for e in events(client, job.run_id, "b") if e["type"] == "notice")
    assert notice["kind"] == "sigterm"
    assert not job.nodes["b"].leftover_pids()


def test_two_workers_per_node_all_save_at_one_step(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    job = make_job(redis_server, tmp_path, agent_args=["--nproc-per-node=2"])
    client = redis_server.client()
    try:
        job.start_node("a")
        job.start_node("b")
        job.wait_for_world(4, START_TIMEOUT, steps=3)
        noticed = time.time()
        inject_notice(client, RunKeys(job.run_id), "a", "terminate", 60)
        job.wait_for_world(2, RECOVER_TIMEOUT, since=noticed, steps=3)
        wait_drained(job, "a")
        step = int(emergency_commit(client, job.run_id)["step"])
        recs = job.records()
        at_four = [r for r in recs if r.world == 4]
        # All four ranks reached that step and none went past it.
        assert {r.rank for r in at_four if r.step == step} == {0, 1, 2, 3}
        assert max(r.step for r in at_four) == step
        assert min(r.step for r in recs if r.t >= noticed and r.world == 2) == step + 1
        manifest = json.loads(
            (CheckpointDir(job.ckpt).step_path(step) / "MANIFEST.json").read_text()
        )
        assert manifest["world_size"] == 4
    finally:
        job.close(client)


def test_a_rebalance_recommendation_checkpoints_early_and_keeps_training(
    job: LocalAgentJob, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    job.start_node("a")
    job.start_node("b")
    job.wait_for_world(2, START_TIMEOUT, steps=3)
    asked = time.time()
    inject_notice(client, RunKeys(job.run_id), "b", "rebalance", 0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(e["type"] == "early-checkpoint" for e in events(client, job.run_id, "b")):
            break
        time.sleep(0.2)
    last = emergency_commit(client, job.run_id)
    assert last["kind"] == "requested" and last["drain"] == "0", last
    # Both nodes keep training at world size 2, past the early checkpoint.
    step = int(last["step"])
    job.wait_for(
        lambda recs: any(r.world == 2 and r.step > step + 5 for r in recs),
        30,
        "training to go on at world size 2",
    )
    assert job.nodes["b"].alive()
    assert all(r.world == 2 for r in job.records() if r.t >= asked)
    assert states(client, job.run_id, "b") == ["healthy", "joined", "checkpointing", "joined"]


def test_training_finishes_and_agents_exit_zero(redis_server: RedisServer, tmp_path: Path) -> None:
    job = make_job(redis_server, tmp_path, steps=30, step_time=0.0)
    client = redis_server.client()
    try:
        job.start_node("a")
        job.start_node("b")
        for n in ("a", "b"):
            assert job.nodes[n].wait(START_TIMEOUT) == 0, job.diagnose()
        for n in ("a", "b"):
            assert states(client, job.run_id, n)[-1] == "left"
        found = CheckpointDir(job.ckpt).find_restorable()
        assert found is not None and found.manifest.step == 30 and found.manifest.kind == "final"
    finally:
        job.close(client)


def test_a_notice_during_a_redis_outage_still_loses_no_progress(tmp_path: Path) -> None:
    """Redis is down when the VM is told to go (SIGTERM to the agent alone, as systemd's
    KillMode=mixed does): the agent cannot write a request, so it stops its workers itself;
    they save at one step with every other rank; the agent finds the commit on disk. When
    Redis is back, the survivor re-forms and resumes from exactly that step."""
    server = RedisServer().start()
    job = make_job(server, tmp_path)
    try:
        job.start_node("a")
        job.start_node("b")
        job.wait_for_world(2, START_TIMEOUT, steps=3)
        server.stop()
        time.sleep(0.5)
        stopped = time.time()
        agent_b = job.nodes["b"].proc
        assert agent_b is not None
        agent_b.send_signal(signal.SIGTERM)
        assert job.nodes["b"].wait(90) == 0, job.diagnose()
        server.start()
        job.wait_for_world(1, RECOVER_TIMEOUT, since=stopped, steps=3)
        manifest = CheckpointDir(job.ckpt).newest_manifest()
        assert manifest is not None
        emergency = [
            m
            for _, p in CheckpointDir(job.ckpt).committed()
            if (m := json.loads((p / "MANIFEST.json").read_text()))["kind"] == "emergency"
        ]
        assert emergency, "no emergency checkpoint was committed"
        assert_no_progress_lost(job, stopped, emergency[-1]["step"])
        log = job.nodes["b"].log_text()
        assert "could not ask for a checkpoint through Redis" in log
    finally:
        job.close(server.client())
        server.close()
