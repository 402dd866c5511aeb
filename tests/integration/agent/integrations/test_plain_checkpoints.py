"""A plain torchrun script (DDP on gloo, its own save and load) with spottrain's
SpotCheckpoints: real torchrun with two workers on the CPU, a real Redis, and the agent's
own notice handler writing the drain request. Three runs of ``plain_worker.py`` for the
module (uninterrupted, drained, resumed past a torn newer checkpoint), as in
test_accelerate_helper.py."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from spot_runs import Run, Runs, finish, run_three, start, wait_for

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import Manifest
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

WORKER = Path(__file__).with_name("plain_worker.py")
GATE = 2
DRAIN_STEP = GATE + 2
MAX_STEPS = 12


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Runs]:
    client = redis_server.client()
    root = tmp_path_factory.mktemp("plain")
    yield run_three(WORKER, root, redis_server.url, client, GATE)
    client.close()


@pytest.fixture(scope="module")
def signalled(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Run:
    """A run whose torchrun gets SIGTERM at step GATE, as the agent sends it for
    ``train.integration: plain``: no request in Redis, only the signal."""
    client: redis.Redis = redis_server.client()
    root = tmp_path_factory.mktemp("plain-sigterm")
    run = start(WORKER, root, "signalled", redis_server.url, "--sigterm-gate", str(GATE))
    keys = RunKeys(run.run_id)
    wait_for(lambda: int(client.hget(keys.progress, "step") or 0) >= GATE, run, f"step {GATE}")
    assert run.proc is not None
    run.proc.send_signal(signal.SIGTERM)  # torchrun passes it on to every worker
    finish(run)
    client.close()
    return run


def test_a_drain_request_makes_every_rank_save_the_same_step_and_commit_it(runs: Runs) -> None:
    drained = runs.drained
    assert drained.steps(0) == drained.steps(1) == list(range(1, DRAIN_STEP + 1)), drained.log[
        -4000:
    ]
    path = CheckpointDir(drained.ckpt).step_path(DRAIN_STEP)
    assert runs.drained_listing == [path.name]
    manifest = Manifest.read(path)
    assert (manifest.step, manifest.kind, manifest.world_size) == (DRAIN_STEP, "emergency", 2)
    assert manifest.extra["framework"] == "plain" and set(manifest.files) == {"state.pt"}


def test_the_commit_and_progress_reach_redis(runs: Runs) -> None:
    assert int(runs.ckpt_last["step"]) == DRAIN_STEP and runs.ckpt_last["drain"] == "1"
    outcome = runs.handler.outcome
    assert outcome is not None and outcome.committed_step == DRAIN_STEP
    # The drain step's progress goes with the commit's report: rank 0 exits right after.
    assert int(runs.progress["step"]) == DRAIN_STEP and float(runs.progress["loss"]) > 0
    assert int(runs.progress["world_size"]) == 2


def test_the_resume_skips_the_torn_checkpoint_and_reports_the_step_load_restored(
    runs: Runs,
) -> None:
    assert runs.resumed.rows(0)[0] == runs.resumed.rows(1)[0] == {"resumed": DRAIN_STEP}
    assert runs.restores == [{"step": DRAIN_STEP, "reached": DRAIN_STEP}]
    assert runs.torn in runs.resumed.log


def test_resuming_ends_with_the_uninterrupted_runs_weights_and_samples(runs: Runs) -> None:
    want, got = runs.plain.final(), runs.resumed.final()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    for rank in (0, 1):
        assert runs.drained.ids(rank) + runs.resumed.ids(rank) == runs.plain.ids(rank)


def test_a_sigterm_makes_every_rank_save_one_step_commit_and_exit(signalled: Run) -> None:
    # Each rank got the signal at the gate; the next agreement made it one emergency save.
    steps = signalled.steps(0)
    assert steps == signalled.steps(1) and steps[-1] > GATE, signalled.log[-4000:]
    assert [r for rank in (0, 1) for r in signalled.rows(rank) if "end" in r] == []
    (committed,) = CheckpointDir(signalled.ckpt).committed()
    manifest = Manifest.read(committed[1])
    assert (manifest.step, manifest.kind, manifest.extra["drain"]) == (steps[-1], "emergency", True)
