"""Bring your own PyTorch Lightning script, end to end on the local cloud: ``spottrain up`` of
examples/lightning_train.py (a tiny MLP, spottrain's callback, resume call and
``ResumableDataLoader``) through preemptions, against one uninterrupted reference run.

At a fixed size of two nodes (each lost node backfilled), through a notice and a kill, the
final weights equal the reference's bit for bit: Lightning is deterministic on the CPU here
(fixed seed, no dropout, each sample drawn from its own index, gloo's sum of two ranks is
order-free, one thread per worker) and resumes its loops, optimizer, scheduler and the
loader's position exactly. Across a shrink to one node, ``ResumableDataLoader`` keeps the
data position, so every step trains on the reference's samples; only the summation order of
the gradients differs, so the loss curve is compared within a tolerance.

The reference is the same script under a plain torchrun with two workers, started once for
the module, first, so that it overlaps the first fleet's boot. Preemptions are injected when
training has reached a step, never after a delay.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from spottrain.agent.checkpoint.manifest import Manifest, ManifestError

from ._byo import (
    Fleet,
    Reference,
    assert_same_samples,
    assert_same_weights,
    assert_shrunk_on_the_same_samples,
    counted_steps,
    job_spec,
    notice_then_kill,
    shrink,
)

# Mostly waiting (paced steps, notice windows): scripts/test runs it beside the box tests,
# the module's tests on one worker, which holds their shared reference run.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.beside,
    pytest.mark.xdist_group("byo-lightning"),
    pytest.mark.timeout(900),  # several waits of up to TIMEOUT on a loaded machine
]

STEPS = 40
EVERY = 10
# Global batch 8 = 2 per device x 2 ranks x accumulation 2, or x 1 rank x accumulation 4
# after a shrink (SpotTrainCallback sets the accumulation from the world size).
TRAIN_ARGS = ["--steps", str(STEPS), "--global-batch", "8", "--per-device", "2"]
TRAIN_ARGS += ["--every-steps", str(EVERY)]
SCRIPT = "examples/lightning_train.py"
# Seconds slept per micro-batch (two per step at two nodes): a wait sees a step a few steps
# before the next preemption lands, even on a loaded machine; the sleep draws no random
# numbers.
STEP_TIME = "0.12"
# Across the shrink each step trains on the reference's samples at the same global batch:
# only the order of the float32 sums differs (one rank accumulating four micro-batches vs
# two ranks' two, all-reduced), and Adam carries those roundings on. A wrong sample moves a
# step's loss by tens of percent (the per-sample losses spread from 0.01 to 2).
LOSS_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    ref = Reference(tmp_path_factory.mktemp("lightning") / "reference", SCRIPT, TRAIN_ARGS)
    yield ref
    ref.stop()


def fleet(tmp_path: Path, home: Path, nodes_min: int) -> Fleet:
    samples = tmp_path / "samples"
    command = [SCRIPT, *TRAIN_ARGS, "--step-time", STEP_TIME, "--sample-log", str(samples)]
    spec = job_spec(
        "lightning", command, tmp_path / "volume", nodes_min=nodes_min, every_steps=EVERY
    )
    return Fleet(home, spec, tmp_path / "lightning_job.yaml")


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    """The committed checkpoint of step STEPS under ``root`` (its manifest verified):
    Lightning's file's weights."""
    for path in sorted(root.rglob("step-*")):
        try:
            manifest = Manifest.read(path)
        except (ManifestError, OSError):
            continue
        if manifest.step == STEPS:
            ckpt = torch.load(path / "lightning.ckpt", map_location="cpu", weights_only=True)
            return dict(ckpt["state_dict"])
    raise AssertionError(f"no committed checkpoint of step {STEPS} under {root}")


def test_a_lightning_script_survives_a_notice_and_a_kill_and_ends_with_uninterrupted_weights(
    tmp_path: Path, home: Path, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    done = notice_then_kill(fleet(tmp_path, home, nodes_min=2), STEPS)
    assert done["final_step"] == STEPS, done
    assert_same_samples(counted_steps(tmp_path / "samples"), reference.steps(), STEPS)
    want = final_weights(reference.finished())
    assert_same_weights(final_weights(tmp_path / "volume"), want)


def test_a_lightning_script_shrinks_to_one_node_and_trains_on_the_reference_samples(
    tmp_path: Path, home: Path, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning counts a step's micro-batches by the batch's index in the epoch: at world
    size 1 a step takes four where it took two, so after a shrink at an odd step the count
    must be carried over to the new world, or the first step alone is short and every later
    step trains on other samples than the reference's (a shrink at an even step hides it)."""
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    done = shrink(fleet(tmp_path, home, nodes_min=1))
    # Not the preemption count: a fast job can finish inside the notice window, before the
    # VM it drained is gone and counted.
    assert (done["final_step"], done["steps_lost"]) == (STEPS, 0), done
    got = counted_steps(tmp_path / "samples")
    assert_shrunk_on_the_same_samples(got, reference.steps(), STEPS, LOSS_TOLERANCE)
