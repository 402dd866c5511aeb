"""The Hugging Face Trainer with spottrain's callback: real torchrun with two workers on the
CPU (gloo), a real Redis, and the agent's own notice handler writing the request.

Three runs of ``hf_worker.py`` (a tiny GPT-2 built from a config, 12 steps, global batch 8)
for the whole module: one uninterrupted; one that a drain request stops (every rank saves
``checkpoint-N`` at the same step, committed with a manifest, reported to Redis, and the
agent's drain wait sees it); one that resumes it with ``last_checkpoint``. Each test checks
one property of what they left."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

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

WORKER = Path(__file__).with_name("hf_worker.py")
GATE = 2  # the request is written at step 2, and acted on at step 4 (see hf_worker.py)
DRAIN_STEP = GATE + 2
MAX_STEPS = 12


class Run(spot_runs.Run):
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.rows(0) if "loss" in r}


def start(
    root: Path,
    name: str,
    redis_url: str,
    *args: str,
    output: Path | None = None,
    workers: int = 2,
) -> Run:
    run = Run(output or root / "ckpt" / name, root / f"report-{name}", f"hf-{uuid.uuid4().hex[:8]}")
    run.ckpt.parent.mkdir(parents=True, exist_ok=True)
    run.report.mkdir()
    run.proc = torchrun(
        WORKER,
        [str(run.ckpt), str(run.report), *args],
        ckpt=root / "ckpt",
        redis_url=redis_url,
        node=f"node-{name}",
        run_id=run.run_id,
        workers=workers,
        env={
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        },
    )
    return run


@dataclass
class Agent:
    """The agent's notice handler of one node, stopping torchrun when its drain is done."""

    handler: NoticeHandler
    stopped: list[float]


def agent_for(client: redis.Redis, run: Run, node: str) -> Agent:
    stopped: list[float] = []
    return Agent(notice_handler(client, run, run.run_id, node, stopped), stopped)


@dataclass(frozen=True)
class Runs:
    plain: Run
    drained: Run
    resumed: Run
    agent: Agent
    progress: dict[str, str]  # the drained run's progress hash, as the drain left it
    ckpt_last: dict[str, str]
    restores: list[dict[str, int]]  # the resumed run's restores, as Redis has them
    drained_listing: list[str]  # the drained run's output directory, before the resume
    shrunk: Run  # the drained run resumed by one worker instead of two


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("hf")
    (root / "ckpt").mkdir()
    client = redis_server.client()
    url = redis_server.url
    plain = start(root, "plain", url)
    assert finish(plain) == 0, plain.log[-6000:]

    drained = start(root, "drained", url, "--gate-step", str(GATE))
    keys = RunKeys(drained.run_id)
    wait_for(lambda: int(client.hget(keys.progress, "step") or 0) >= GATE, drained, f"step {GATE}")
    agent = agent_for(client, drained, "node-drained")
    now = time.time()
    agent.handler.submit(Notice("test", NoticeKind.TERMINATE, now + 60, now))
    assert agent.handler.done.wait(RUN_TIMEOUT), "the agent's drain did not end"
    finish(drained)
    progress = {k.decode(): v.decode() for k, v in client.hgetall(keys.progress).items()}
    ckpt_last = {k.decode(): v.decode() for k, v in client.hgetall(keys.ckpt_last).items()}
    listing = sorted(p.name for p in drained.ckpt.iterdir())
    shrunk_output = root / "ckpt" / "shrunk"
    shutil.copytree(drained.ckpt, shrunk_output)

    resumed = start(root, "resumed", url, "--resume", output=drained.ckpt)
    assert finish(resumed) == 0, resumed.log[-6000:]
    restores = [json.loads(r) for r in client.lrange(RunKeys(resumed.run_id).restores, 0, -1)]
    shrunk = start(root, "shrunk", url, "--resume", output=shrunk_output, workers=1)
    assert finish(shrunk) == 0, shrunk.log[-6000:]
    yield Runs(plain, drained, resumed, agent, progress, ckpt_last, restores, listing, shrunk)
    client.close()


def test_a_drain_request_makes_every_rank_save_the_same_step(runs: Runs) -> None:
    drained = runs.drained
    assert drained.saves(0) == drained.saves(1) == [DRAIN_STEP], drained.log[-4000:]
    # Neither rank trained past the drain checkpoint: one exited, the other held until the
    # agent's stop, and no rank ended its training.
    assert [r for rank in (0, 1) for r in drained.rows(rank) if "end" in r] == []
    assert runs.drained_listing == [f"checkpoint-{DRAIN_STEP}"]


def test_the_drain_checkpoint_is_committed_with_a_manifest_of_every_ranks_files(
    runs: Runs,
) -> None:
    path = runs.drained.ckpt / f"checkpoint-{DRAIN_STEP}"
    manifest = Manifest.read(path)
    assert (manifest.step, manifest.kind, manifest.world_size) == (DRAIN_STEP, "emergency", 2)
    assert manifest.extra["drain"] is True and manifest.extra["framework"] == "hf"
    assert manifest.extra["global_batch"] == 8
    assert manifest.epoch >= 0
    # The Trainer's own format, with both ranks' RNG states: the commit waited for both.
    assert {"trainer_state.json", "optimizer.pt", "scheduler.pt", "model.safetensors"} <= set(
        manifest.files
    )
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(manifest.files)
    assert set(manifest.files) == {p.name for p in path.iterdir()} - {MANIFEST_NAME}


def test_the_commit_reaches_redis_and_the_agents_drain_wait(runs: Runs) -> None:
    last = runs.ckpt_last
    assert int(last["step"]) == DRAIN_STEP
    assert last["drain"] == "1" and last["kind"] == "emergency"
    assert int(last["request_id"]) >= 1
    outcome = runs.agent.handler.outcome
    assert outcome is not None and outcome.committed_step == DRAIN_STEP
    assert runs.agent.stopped, "the agent never got to stop the workers"


def test_progress_step_and_loss_reach_redis(runs: Runs) -> None:
    assert int(runs.progress["step"]) == DRAIN_STEP
    assert int(runs.progress["world_size"]) == 2
    assert float(runs.progress["loss"]) > 0


def test_the_resumed_run_reports_the_step_the_trainer_restored(runs: Runs) -> None:
    assert runs.restores == [{"step": DRAIN_STEP, "reached": DRAIN_STEP}]


def test_resuming_with_last_checkpoint_ends_with_the_uninterrupted_runs_weights(
    runs: Runs,
) -> None:
    assert runs.resumed.saves(0) == runs.resumed.saves(1) == [5, 10, MAX_STEPS]
    assert runs.plain.saves(0) == [5, 10, MAX_STEPS]
    want, got = runs.plain.final(), runs.resumed.final()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_run_resumed_at_half_the_world_size_trains_on_the_same_samples_per_step(
    runs: Runs,
) -> None:
    """accumulation_steps keeps the global batch (8) when the world shrinks from 2 to 1, so
    the Trainer's resumed data position and every step's samples are the uninterrupted
    run's: the same loss at every step, to float rounding (the sums run in another order)."""
    want, got = runs.plain.losses(), runs.shrunk.losses()
    assert sorted(got) == list(range(DRAIN_STEP + 1, MAX_STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-4), step
    final, plain = runs.shrunk.final(), runs.plain.final()
    for name in plain:
        torch.testing.assert_close(final[name], plain[name], rtol=1e-4, atol=1e-5)


def test_the_trainers_own_periodic_saves_are_committed(runs: Runs) -> None:
    for step, kind in ((5, "periodic"), (10, "periodic"), (MAX_STEPS, "final")):
        manifest = Manifest.read(runs.plain.ckpt / f"checkpoint-{step}")
        assert (manifest.step, manifest.kind, manifest.extra["drain"]) == (step, kind, False)


def test_a_torn_checkpoint_is_skipped_where_transformers_would_pick_it(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    transformers_pick = cast(Callable[[str], str | None], get_last_checkpoint)

    from spottrain.agent.sdk.integrations.hf import last_checkpoint

    out = tmp_path / "out"
    shutil.copytree(runs.plain.ckpt, out)
    # A save that died before its manifest, and one whose file changed after its commit.
    shutil.copytree(out / "checkpoint-12", out / "checkpoint-14")
    (out / "checkpoint-14" / MANIFEST_NAME).unlink()
    shutil.copytree(out / "checkpoint-12", out / "checkpoint-13")
    manifest = Manifest.read(out / "checkpoint-12")
    (out / "checkpoint-13" / MANIFEST_NAME).write_bytes(
        Manifest(**{**manifest.__dict__, "step": 13}).to_bytes()
    )
    with open(out / "checkpoint-13" / "optimizer.pt", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setenv("SPOTTRAIN_CKPT_DIR", str(tmp_path))

    assert transformers_pick(str(out)) == str(out / "checkpoint-14")
    assert last_checkpoint(out) == str(out / "checkpoint-12")
    names = sorted(p.name for p in out.iterdir())
    assert [n.rsplit("-", 1)[0] for n in names[:2]] == [
        ".torn-checkpoint-13",
        ".torn-checkpoint-14",
    ]
    assert names[2:] == ["checkpoint-10", "checkpoint-12", "checkpoint-5"]
    # Set aside, transformers' own choice is now the complete one too.
    assert transformers_pick(str(out)) == str(out / "checkpoint-12")


def test_an_output_dir_outside_the_checkpoint_volume_is_refused_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spottrain.agent.sdk.integrations.core import CheckpointPathError
    from spottrain.agent.sdk.integrations.hf import last_checkpoint

    (tmp_path / "vol").mkdir()
    monkeypatch.setenv("SPOTTRAIN_CKPT_DIR", str(tmp_path / "vol"))
    with pytest.raises(
        CheckpointPathError,
        match=r"set TrainingArguments\(output_dir=\.\.\.\) to a directory under",
    ):
        last_checkpoint(tmp_path / "elsewhere")


def one_process_trainer(output_dir: Path, *callbacks: Any) -> Any:
    from hf_worker import Tokens, tiny_gpt2
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        max_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=list(callbacks))


def test_the_callback_attached_twice_is_an_error_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spottrain.agent.sdk.integrations.hf import CallbackAttachedTwiceError, SpotTrainCallback

    monkeypatch.setenv("SPOTTRAIN_CKPT_DIR", str(tmp_path))
    monkeypatch.setenv("SPOTTRAIN_REDIS", "")
    spot = SpotTrainCallback(install_signal_handlers=False)
    trainer = one_process_trainer(tmp_path / "out", spot)
    trainer.add_callback(SpotTrainCallback(install_signal_handlers=False))
    with pytest.raises(CallbackAttachedTwiceError, match=r"attached to this Trainer twice.*once"):
        trainer.train()
    assert spot.session is not None and spot.session.phase == "closed"


def test_a_trainer_output_dir_outside_the_volume_stops_training_before_its_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spottrain.agent.sdk.integrations.core import CheckpointPathError
    from spottrain.agent.sdk.integrations.hf import SpotTrainCallback

    (tmp_path / "vol").mkdir()
    monkeypatch.setenv("SPOTTRAIN_CKPT_DIR", str(tmp_path / "vol"))
    monkeypatch.setenv("SPOTTRAIN_REDIS", "")
    spot = SpotTrainCallback(install_signal_handlers=False)
    trainer = one_process_trainer(tmp_path / "out", spot)
    with pytest.raises(CheckpointPathError, match=r"TrainingArguments\(output_dir=\.\.\.\)"):
        trainer.train()
    assert trainer.state.global_step == 0 and spot.session is None


def test_accumulation_keeps_the_global_batch_or_names_the_figures() -> None:
    from spottrain.agent.sdk.integrations.hf import accumulation_steps

    assert [accumulation_steps(32, 4, world) for world in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(
        ValueError, match=r"global batch 32 is not a multiple of .* 4 x world size 3 = 12"
    ):
        accumulation_steps(32, 4, 3)
