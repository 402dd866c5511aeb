"""PyTorch Lightning with spottrain's callback: real torchrun with two workers on the CPU
(gloo, Lightning's DDP strategy on torchrun's environment), a real Redis, and the agent's
own notice handler writing the checkpoint requests.

Four runs of ``lightning_worker.py`` (a tiny regression, 12 optimizer steps of global batch
8 = 2 per device x 2 ranks x accumulate 2, across an epoch's end) for the whole module, the
first three side by side: one that an early checkpoint request (an AWS rebalance
recommendation, as the agent handles it) makes save at one step and then trains on to the
end, uninterrupted; one drained by a termination notice; one stopped by a SIGTERM with no
notice; then one that resumes the first's checkpoint with ``last_checkpoint()``, past a
newer torn one, committing every 5 steps and at the end. Each test checks one property of
what they left."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import spot_runs
import torch
from spot_runs import RUN_TIMEOUT, finish, notice_handler, torchrun, wait_for

from spottrain.agent.checkpoint.manifest import MANIFEST_NAME, Manifest
from spottrain.agent.notices.handler import NoticeHandler
from spottrain.agent.notices.notice import Notice, NoticeKind
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

WORKER = Path(__file__).with_name("lightning_worker.py")
GATE = 3  # the request is written at step 3 and acted on at step 5 (see lightning_worker.py)
SAVE_STEP = GATE + 2
TORN_STEP = 8
MAX_STEPS = 12
SAMPLES_PER_STEP_PER_RANK = 4  # 2 per batch x accumulate 2


class Run(spot_runs.Run):
    def seen(self, rank: int) -> list[int]:
        return json.loads((self.report / f"seen{rank}.json").read_text())  # type: ignore[no-any-return]


def start(
    root: Path, name: str, redis_url: str, *args: str, ckpt: str = "ckpt", workers: int = 2
) -> Run:
    run = Run(root / ckpt, root / f"report-{name}", f"pl-{uuid.uuid4().hex[:8]}")
    run.ckpt.mkdir(exist_ok=True)
    run.report.mkdir()
    run.proc = torchrun(
        WORKER,
        [str(run.report), *args],
        ckpt=run.ckpt,
        redis_url=redis_url,
        node=f"node-{name}",
        run_id=run.run_id,
        workers=workers,
        env={"PL_DISABLE_FORK": "1"},
    )
    return run


def at_gate(client: redis.Redis, run: Run) -> NoticeHandler:
    keys = RunKeys(run.run_id)
    wait_for(lambda: int(client.hget(keys.progress, "step") or 0) >= GATE, run, "the gate")
    return notice_handler(client, run, run.run_id, f"node-{run.report.name}")


def plant_torn(root: Path) -> None:
    """A newer checkpoint whose file changed after its commit, and a save that died staged."""
    good = root / f"step-{SAVE_STEP:09d}"
    torn = root / f"step-{TORN_STEP:09d}"
    shutil.copytree(good, torn)
    manifest = Manifest.read(torn)
    (torn / MANIFEST_NAME).write_bytes(
        Manifest(**{**manifest.__dict__, "step": TORN_STEP}).to_bytes()
    )
    with open(torn / "lightning.ckpt", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    shutil.copytree(good, root / f".tmp-step-{TORN_STEP + 1:09d}-e3")


@dataclass(frozen=True)
class Runs:
    requested: Run
    resumed: Run
    drained: Run
    drain: NoticeHandler
    killed: Run
    progress: dict[str, str]  # the requested run's progress hash, as it ended
    ckpt_last: dict[str, str]
    restores: list[dict[str, int]]  # the resumed run's restores, as Redis has them
    shrunk: Run  # the requested run's step-5 checkpoint resumed by one worker instead of two


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("lightning")
    (root / "ckpt").mkdir()
    client = redis_server.client()
    url = redis_server.url
    requested = start(root, "requested", url, "--gate-step", str(GATE))
    drained = start(root, "drained", url, "--gate-step", str(GATE), ckpt="ckpt-drained")
    killed = start(root, "killed", url, "--sigterm-step", str(GATE), ckpt="ckpt-killed")
    now = time.time()
    at_gate(client, requested).submit(Notice("test", NoticeKind.REBALANCE, None, now))
    drain = at_gate(client, drained)
    drain.submit(Notice("test", NoticeKind.TERMINATE, now + 120, now))
    assert finish(requested) == 0, requested.log[-6000:]
    assert drain.done.wait(RUN_TIMEOUT), "the agent's drain did not end"
    finish(drained)
    finish(killed)
    keys = RunKeys(requested.run_id)
    progress = {k.decode(): v.decode() for k, v in client.hgetall(keys.progress).items()}
    ckpt_last = {k.decode(): v.decode() for k, v in client.hgetall(keys.ckpt_last).items()}
    # The resume, from step 5 (as after a preemption there), with a newer torn checkpoint;
    # beside it, the same checkpoint resumed at half the world size (an odd step: Lightning's
    # batch count of the old world is not a multiple of the new accumulation).
    shutil.copytree(requested.ckpt, root / "ckpt-shrunk")
    plant_torn(requested.ckpt)
    resumed = start(root, "resumed", url, "--resume", "--every-steps", "5")
    shrunk = start(root, "shrunk", url, "--resume", ckpt="ckpt-shrunk", workers=1)
    assert finish(resumed) == 0, resumed.log[-6000:]
    assert finish(shrunk) == 0, shrunk.log[-6000:]
    restores = [json.loads(r) for r in client.lrange(RunKeys(resumed.run_id).restores, 0, -1)]
    yield Runs(requested, resumed, drained, drain, killed, progress, ckpt_last, restores, shrunk)
    client.close()


def test_a_checkpoint_request_makes_every_rank_save_the_same_step(runs: Runs) -> None:
    run = runs.requested
    assert run.saves(0) == run.saves(1) == [SAVE_STEP], run.log[-4000:]
    assert [r["end"] for rank in (0, 1) for r in run.rows(rank) if "end" in r] == [MAX_STEPS] * 2


def test_the_checkpoint_is_lightnings_own_file_committed_with_a_manifest(runs: Runs) -> None:
    path = runs.requested.ckpt / f"step-{SAVE_STEP:09d}"
    manifest = Manifest.read(path)
    assert (manifest.step, manifest.kind, manifest.world_size) == (SAVE_STEP, "requested", 2)
    assert manifest.extra["framework"] == "lightning" and manifest.extra["drain"] is False
    assert manifest.extra["global_batch"] == 8
    assert (
        set(manifest.files)
        == {"lightning.ckpt"}
        == {p.name for p in path.iterdir()} - {MANIFEST_NAME}
    )
    ckpt = torch.load(path / "lightning.ckpt", weights_only=False)
    assert ckpt["global_step"] == SAVE_STEP
    # The data position is in Lightning's own checkpoint: 5 steps x 8 samples.
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] == 40


def test_the_commit_and_progress_reach_redis(runs: Runs) -> None:
    last = runs.ckpt_last
    assert int(last["step"]) == SAVE_STEP and last["kind"] == "requested"
    assert int(last["request_id"]) >= 1
    # Rank 0's reporter publishes the newest step every poll: the last ones may fold into
    # the end of training's record.
    assert int(runs.progress["step"]) >= GATE and int(runs.progress["final_step"]) == MAX_STEPS
    assert int(runs.progress["world_size"]) == 2
    assert float(runs.progress["loss"]) > 0


def test_the_resumed_run_reports_the_step_lightning_restored(runs: Runs) -> None:
    assert runs.restores == [{"step": SAVE_STEP, "reached": SAVE_STEP}]
    assert runs.resumed.rows(0)[0] == {"start": SAVE_STEP, "accumulate": 2}


def test_resuming_ends_with_the_uninterrupted_runs_weights(runs: Runs) -> None:
    want, got = runs.requested.final(), runs.resumed.final()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_the_resumed_run_trains_on_exactly_the_samples_not_yet_seen(runs: Runs) -> None:
    done = SAVE_STEP * SAMPLES_PER_STEP_PER_RANK
    for rank in (0, 1):
        assert runs.resumed.seen(rank) == runs.requested.seen(rank)[done:]


def test_a_run_resumed_at_half_the_world_size_trains_on_the_samples_not_yet_seen(
    runs: Runs,
) -> None:
    # One rank now takes both ranks' share, in steps of the same global batch: the same
    # samples as the uninterrupted run's steps 6-12, none skipped, none twice.
    done = SAVE_STEP * SAMPLES_PER_STEP_PER_RANK
    want = sorted(runs.requested.seen(0)[done:] + runs.requested.seen(1)[done:])
    assert sorted(runs.shrunk.seen(0)) == want
    assert runs.shrunk.rows(0)[-1] == {"end": MAX_STEPS}


def test_a_torn_newer_checkpoint_is_skipped(runs: Runs) -> None:
    torn = f"step-{TORN_STEP:09d}"
    assert (runs.resumed.ckpt / torn).is_dir()
    assert f"skipping checkpoint {torn}" in runs.resumed.log


def test_a_notice_makes_every_rank_save_at_one_step_and_stop_there(runs: Runs) -> None:
    run = runs.drained
    assert run.saves(0) == run.saves(1) == [SAVE_STEP], run.log[-4000:]
    # No rank trained past it: one exited after the commit, the other held until the
    # agent stopped the workers (Lightning's own SIGTERM handling did not end fit first).
    assert [r for rank in (0, 1) for r in run.rows(rank) if "end" in r] == []
    manifest = Manifest.read(run.ckpt / f"step-{SAVE_STEP:09d}")
    assert (manifest.kind, manifest.extra["drain"]) == ("emergency", True)
    outcome = runs.drain.outcome
    assert outcome is not None and outcome.committed_step == SAVE_STEP


def test_a_sigterm_without_notice_makes_every_rank_save_at_one_step(runs: Runs) -> None:
    # Lightning's own SIGTERM handling (a broadcast in the handler, then the end of fit
    # with no checkpoint) is set aside while spottrain's session runs.
    run = runs.killed
    assert run.saves(0) == run.saves(1) == [SAVE_STEP], run.log[-4000:]
    assert [r for rank in (0, 1) for r in run.rows(rank) if "end" in r] == []
    manifest = Manifest.read(run.ckpt / f"step-{SAVE_STEP:09d}")
    assert (manifest.kind, manifest.extra["drain"], manifest.world_size) == ("emergency", True, 2)


def test_periodic_and_final_checkpoints_are_committed_every_n_steps(runs: Runs) -> None:
    assert runs.resumed.saves(0) == runs.resumed.saves(1) == [10, MAX_STEPS]
    for step, kind in ((10, "periodic"), (MAX_STEPS, "final")):
        manifest = Manifest.read(runs.resumed.ckpt / f"step-{step:09d}")
        assert (manifest.step, manifest.kind, manifest.extra["drain"]) == (step, kind, False)
