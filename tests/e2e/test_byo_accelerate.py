"""Bring your own Accelerate loop, end to end on the local cloud: ``spottrain up`` of
examples/accelerate_train.py (a small MLP, ``SpotAccelerate`` around an ordinary
``accelerator.accumulate`` loop) at a fixed size of two nodes through a preemption with
notice and a kill without notice, each lost node backfilled; and through a shrink to one
node that cannot be backfilled.

The reference is the same script run uninterrupted by a plain torchrun with two workers,
started once for the module before the first fleet boots. Accelerate is deterministic on the
CPU here: fixed seeds, no dropout, a seedable sampler (an epoch's order from the seed and
the epoch alone), one thread per worker, and a two-rank all-reduce whose sum does not depend
on which node holds which rank. Preemptions are injected when training has reached a step,
never after a delay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import yaml
from safetensors.torch import load_file

from spottrain.agent.checkpoint.manifest import Manifest
from spottrain.cloud.local.compute import LocalProvider
from spottrain.controller.run.records import find_run
from spottrain.controller.run.run_redis import open_redis

from ._byo import (
    assert_same_samples,
    counted_steps,
    events,
    loss_gap,
    progress,
    start_reference,
    training_past,
    vm_of,
)
from ._fleet import REPO, Cli, wait

# Mostly waiting (paced steps, notice windows): scripts/test runs it beside the box tests,
# the module's tests on one worker, which holds their shared reference run.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.beside,
    pytest.mark.xdist_group("byo-accelerate"),
    pytest.mark.timeout(900),  # several waits of up to TIMEOUT on a loaded machine
]

STEPS = 40
SAVE_EVERY = 10
SCRIPT = "examples/accelerate_train.py"
# Global batch 8 = 2 per device x 2 ranks x accumulation 2, or x 1 rank x 4 (the helper
# sets the accumulation at each start). 320 samples make the run exactly one epoch, so a
# sample trained on twice is a fault (assert_same_samples counts over the whole run); the
# integration test covers resuming across an epoch.
TRAIN_ARGS = ["--steps", str(STEPS), "--global-batch", "8", "--per-device", "2"]
TRAIN_ARGS += ["--save-every", str(SAVE_EVERY), "--samples", str(STEPS * 8)]
# Long enough to work (and on a loaded machine) to be a few steps past the step a wait saw
# when the next preemption lands; the pace is a sleep, it draws no random numbers.
STEP_TIME = "0.25"
TIMEOUT = 360.0  # any one wait, on a loaded 2-core machine
# The shrink's loss curve against the reference's: the same samples in the same global
# batch (Accelerate deals batch j of the epoch's order to rank j mod world, and the helper
# resumes after the same number of samples), so only the float32 summation order of the
# gradient differs (4 micro-batches accumulated on one rank against 2 on each of two,
# averaged by an all-reduce). That moves a step's loss by about 1e-7 relative (1.5e-7
# measured over the 40 steps), while one step on other samples moves it by tens of percent.
LOSS_TOLERANCE = 1e-3


def job_spec(volume: Path, samples: Path, *, nodes_min: int) -> dict[str, Any]:
    command = [SCRIPT, *TRAIN_ARGS, "--step-time", STEP_TIME, "--sample-log", str(samples)]
    return {
        "name": "tiny-accelerate",
        "code": {"archive": {"path": str(REPO)}},
        "train": {
            "command": " ".join(command),
            "integration": "accelerate",
            # torchrun sets one thread per worker only when a node runs several; the
            # reference's two workers on one node get it, and the CPU's float sums depend on
            # the thread count.
            "env": {"OMP_NUM_THREADS": "1"},
        },
        "nodes": {"min": nodes_min, "max": 2, "gpus": 0, "workers": 1},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 50},
        "checkpoint": {
            "volume": {"path": str(volume), "write_gbps": 0.5},
            "every_steps": SAVE_EVERY,
            "size_gb": 0.001,
        },
        "local": {
            "zones": {"local-a": {"capacity": 4}, "local-b": {"capacity": 4}},
            "launch_latency_s": 1,
            "notice_s": 20,
        },
    }


class Fleet:
    """One ``spottrain up`` of a job spec: its CLI, run id, Redis and local cloud."""

    def __init__(self, home: Path, spec: dict[str, Any], path: Path) -> None:
        path.write_text(yaml.safe_dump(spec))
        self.cli = Cli(home)
        up = self.cli.run("up", str(path), "--detach", "--interval", "0.5")
        assert up.returncode == 0, up.stdout + up.stderr
        self.run_id = up.stdout.split()[1].rstrip(":")
        info = find_run(self.run_id)
        self.client: redis.Redis = open_redis(info, info.spec())
        self.cloud = LocalProvider.open(home / "local")

    def preempt(self, node: str, *, notice: bool) -> float:
        """Preempt ``node``'s VM; return when (unix time)."""
        at = time.time()
        assert self.cloud.preempt(vm_of(self.cloud, self.run_id, node), notice=notice)
        return at

    def past(self, step: int, world: int = 2) -> None:
        wait(
            lambda: training_past(self.client, self.run_id, step, world),
            f"{world} ranks training past step {step}",
            TIMEOUT,
            0.2,
        )

    def emergency(self) -> int:
        """The step of the first emergency checkpoint, once it committed (a drain's)."""
        found = wait(
            lambda: [
                c
                for c in events(self.client, self.run_id, "checkpoint-committed")
                if c["kind"] == "emergency"
            ],
            "the emergency checkpoint",
            TIMEOUT,
            0.2,
        )
        assert found[0]["drain"] == "1", found
        return int(found[0]["step"])

    def restores_after(self, at: float) -> list[dict[str, str]]:
        return [r for r in events(self.client, self.run_id, "restored") if float(r["at"]) > at]

    def finished(self) -> dict[str, Any]:
        return dict(
            wait(
                lambda: (s := self.cli.status(self.run_id))["final_step"] is not None and s,
                "training to finish",
                TIMEOUT,
            )
        )

    def down(self) -> None:
        self.client.close()
        assert self.cli.run("down", self.run_id, timeout=180).returncode == 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Path]]:
    """The uninterrupted run, shared by the module's tests: a function that waits for it to
    end well and returns its directory (checkpoints, ``samples/``, ``log``)."""
    root = tmp_path_factory.mktemp("accelerate") / "reference"
    proc = start_reference(root, SCRIPT, [*TRAIN_ARGS, "--sample-log", str(root / "samples")])

    def finish() -> Path:
        log = root / "log"
        assert proc.wait(TIMEOUT) == 0, log.read_text(errors="replace")[-4000:]
        return root

    yield finish
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def final_weights(volume: Path) -> dict[str, torch.Tensor]:
    """The model of the committed ``step-STEPS`` under ``volume`` (Accelerate's own
    ``model.safetensors``; a periodic save when ``SAVE_EVERY`` divides ``STEPS``, which
    ``finish(save=True)`` does not repeat), wherever the nodes' volume put it."""
    found = [p for p in volume.rglob("step-*") if (p / "MANIFEST.json").exists()]
    final = [p for p in found if Manifest.read(p).step == STEPS]
    assert final, f"no committed step-{STEPS} under {volume}: {found}"
    return load_file(final[0] / "model.safetensors")


def test_an_accelerate_loop_survives_a_notice_and_a_kill_with_uninterrupted_weights(
    tmp_path: Path, home: Path, reference: Callable[[], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    volume, samples = tmp_path / "volume", tmp_path / "samples"
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    fleet = Fleet(home, job_spec(volume, samples, nodes_min=2), tmp_path / "j.yaml")
    fleet.past(2)
    # A preemption with notice: every rank runs accelerator.save_state at one agreed step,
    # the backfilled node joins, and training resumes at N, the step it had reached.
    noticed = fleet.preempt("n1", notice=True)
    step = fleet.emergency()
    assert 2 < step < STEPS
    restored = wait(
        lambda: fleet.restores_after(noticed), "the restore after the notice", TIMEOUT, 0.2
    )
    assert (restored[0]["step"], restored[0]["reached"]) == (str(step), str(step))
    # A kill without notice, a few steps after the resume: the survivor and the next
    # backfill restore the newest committed checkpoint and redo the steps after it.
    fleet.past(step + 2)
    killed = fleet.preempt("n0", notice=False)
    done = fleet.finished()
    restores = events(fleet.client, fleet.run_id, "restored")
    fleet.down()
    assert done["final_step"] == STEPS and done["preemptions"] == 2, done
    noticed_restores = [r for r in restores if noticed < float(r["at"]) < killed]
    assert all(r["step"] == r["reached"] for r in noticed_restores), noticed_restores
    assert any(float(r["at"]) > killed for r in restores), "no restore after the kill"
    lost = sum(int(r["reached"]) - int(r["step"]) for r in restores)
    assert done["steps_lost"] == lost, (done, restores)
    ref = reference()
    want, got = final_weights(ref), final_weights(volume)
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"final weights differ from the uninterrupted run's: {different}"
    assert_same_samples(counted_steps(samples), counted_steps(ref / "samples"), STEPS)


def test_an_accelerate_loop_shrinks_to_one_node_on_the_same_samples(
    tmp_path: Path, home: Path, reference: Callable[[], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across a shrink from two nodes to one, every step trains on the reference's samples
    (the helper resumes the epoch after the samples consumed, and sets the accumulation
    that keeps the global batch), and the loss curve stays within ``LOSS_TOLERANCE`` of
    the reference's."""
    volume, samples = tmp_path / "volume", tmp_path / "samples"
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    spec = job_spec(volume, samples, nodes_min=1)
    fleet = Fleet(home, spec, tmp_path / "j.yaml")
    fleet.past(2)
    # No zone takes another VM (capacity counts VMs; the two running ones stay): the lost
    # node cannot be backfilled.
    for zone in spec["local"]["zones"]:
        fleet.cloud.set_capacity(zone, 0)
    fleet.preempt("n1", notice=True)
    step = fleet.emergency()
    fleet.past(step + 2, world=1)
    done = fleet.finished()
    assert progress(fleet.client, fleet.run_id)[1] == 1
    fleet.down()
    assert done["final_step"] == STEPS and done["steps_lost"] == 0, done
    want = counted_steps(reference() / "samples")
    got = counted_steps(samples)
    assert_same_samples(got, want, STEPS)
    assert {got[k].world for k in got} == {1, 2}, {k: got[k].world for k in got}
    gap = loss_gap(got, want)
    print(f"shrink: largest relative loss gap to the reference {gap:.3g}")
    assert gap < LOSS_TOLERANCE
