"""Accelerate with spottrain's SpotAccelerate: real torchrun with two workers on the CPU
(gloo), a real Redis, and the agent's own notice handler writing the drain request.

Three runs of ``accelerate_worker.py`` (a tiny linear model, 64 shuffled samples, global
batch 8, 12 steps over one and a half epochs) for the whole module: one uninterrupted; one
that a drain request stops (every rank saves with ``accelerator.save_state`` at the same
step, committed as ``step-N`` and reported to Redis); one that resumes it, with a torn newer
checkpoint planted beside it. Each test checks one property of what they left."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from spot_runs import RUN_TIMEOUT, Run, Runs, run_three

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import MANIFEST_NAME, Manifest
from spottrain.controller.run.embedded_redis import RedisServer

WORKER = Path(__file__).with_name("accelerate_worker.py")
GATE = 2  # the request is written at step 2 and acted on at step 4 (see the worker)
DRAIN_STEP = GATE + 2
MAX_STEPS = 12


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Runs]:
    client = redis_server.client()
    root = tmp_path_factory.mktemp("accelerate")
    yield run_three(WORKER, root, redis_server.url, client, GATE)
    client.close()


@pytest.fixture(scope="module")
def shrunk(runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One process (no torchrun) resuming a copy of the drained run's two-rank checkpoint."""
    root = tmp_path_factory.mktemp("shrunk")
    ckpt = root / "ckpt"
    shutil.copytree(runs.drained.ckpt, ckpt)
    run = Run(ckpt, root / "report", "shrunk")
    run.report.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTTRAIN_", "WORLD_"))}
    env.update(SPOTTRAIN_CKPT_DIR=str(ckpt), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(WORKER), str(run.report)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    run.log = done.stdout + done.stderr
    assert done.returncode == 0, run.log[-6000:]
    return run


def test_a_drain_request_makes_every_rank_save_the_same_step(runs: Runs) -> None:
    drained = runs.drained
    assert drained.steps(0) == drained.steps(1) == list(range(1, DRAIN_STEP + 1)), drained.log[
        -4000:
    ]
    assert [r for rank in (0, 1) for r in drained.rows(rank) if "end" in r] == []
    assert runs.drained_listing == [CheckpointDir(runs.drained.ckpt).step_path(DRAIN_STEP).name]


def test_the_drain_checkpoint_is_accelerates_own_state_committed_with_a_manifest(
    runs: Runs,
) -> None:
    path = runs.drained.ckpt / runs.drained_listing[0]
    manifest = Manifest.read(path)
    assert (manifest.step, manifest.kind, manifest.world_size) == (DRAIN_STEP, "emergency", 2)
    assert manifest.extra["drain"] is True and manifest.extra["framework"] == "accelerate"
    assert manifest.extra["global_batch"] == 8
    # Accelerate's format, with both ranks' RNG states: the commit waited for both.
    assert {"model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl"} <= set(manifest.files)
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(manifest.files)
    assert set(manifest.files) == {p.name for p in path.iterdir()} - {MANIFEST_NAME}


def test_the_commit_reaches_redis_and_the_agents_drain_wait(runs: Runs) -> None:
    last = runs.ckpt_last
    assert int(last["step"]) == DRAIN_STEP
    assert last["drain"] == "1" and last["kind"] == "emergency"
    assert int(last["request_id"]) >= 1
    outcome = runs.handler.outcome
    assert outcome is not None and outcome.committed_step == DRAIN_STEP


def test_progress_step_and_loss_reach_redis(runs: Runs) -> None:
    # The drain step's progress goes with the commit's report: rank 0 exits right after.
    assert int(runs.progress["step"]) == DRAIN_STEP
    assert int(runs.progress["world_size"]) == 2
    assert float(runs.progress["loss"]) > 0


def test_the_resume_skips_the_torn_newer_checkpoint_and_reports_the_restored_step(
    runs: Runs,
) -> None:
    assert runs.resumed.rows(0)[0] == runs.resumed.rows(1)[0] == {"resumed": DRAIN_STEP}
    assert runs.restores == [{"step": DRAIN_STEP, "reached": DRAIN_STEP}]
    assert runs.torn in runs.resumed.log  # named as skipped


def test_resuming_ends_with_the_uninterrupted_runs_weights(runs: Runs) -> None:
    assert runs.resumed.steps(0) == list(range(DRAIN_STEP + 1, MAX_STEPS + 1))
    want, got = runs.plain.final(), runs.resumed.final()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_the_resumed_data_position_neither_skips_nor_repeats_a_sample(runs: Runs) -> None:
    for rank in (0, 1):
        uninterrupted = runs.plain.ids(rank)
        assert runs.drained.ids(rank) + runs.resumed.ids(rank) == uninterrupted
    # Over one and a half epochs, every sample of the first epoch exactly once, and then half.
    seen = Counter(runs.plain.ids(0) + runs.plain.ids(1))
    assert sorted(seen.values()).count(2) == 32 and len(seen) == 64


def test_a_resume_at_another_world_size_keeps_the_global_batch_and_the_samples(
    runs: Runs, shrunk: Run
) -> None:
    # One rank with gradient accumulation 8 takes, step by step, the 8 samples two ranks
    # with accumulation 2 took: the same optimisation, no sample skipped or repeated.
    assert shrunk.rows(0)[0] == {"resumed": DRAIN_STEP}
    rows = [[r for r in runs.plain.rows(rank) if "ids" in r] for rank in (0, 1)]
    both = {r["step"]: sorted(r["ids"] + q["ids"]) for r, q in zip(*rows, strict=True)}
    after = {r["step"]: sorted(r["ids"]) for r in shrunk.rows(0) if "ids" in r}
    assert after == {s: ids for s, ids in both.items() if s > DRAIN_STEP}
    want, got = runs.plain.final(), shrunk.final()
    for name in want:
        assert torch.allclose(want[name], got[name], atol=1e-5), name
