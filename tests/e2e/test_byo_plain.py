"""Bring your own plain torchrun script, end to end on the local cloud: ``spottrain up`` of
examples/plain_spot_train.py (its own loop, save and load inside spottrain's
``SpotCheckpoints``) at a fixed size through a preemption with notice and a kill without
notice, and through a shrink to one node; and of examples/plain_train.py (which imports
nothing of spottrain's and saves on the agent's SIGTERM) through a notice.

The references are the same scripts run uninterrupted by a plain torchrun with two workers
(deterministic on the CPU: fixed seeds, no dropout, the data order a function of the step,
one thread per worker), started before the fleets boot. Preemptions are injected when
training has reached a step, never after a delay.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spottrain.agent.checkpoint.manifest import Manifest

from ._byo import (
    TIMEOUT,
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
from ._fleet import wait

# Mostly waiting (paced steps, notice windows): scripts/test runs it beside the box tests,
# the module's tests on one worker, which holds their shared reference run.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.beside,
    pytest.mark.xdist_group("byo-plain"),
    pytest.mark.timeout(900),  # several waits of up to TIMEOUT on a loaded machine
]

STEPS = 40
SAVE_EVERY = 10
SPOT = "examples/plain_spot_train.py"
# Global batch 8 = 2 per micro-batch x 2 ranks x accumulation 2, or x 1 rank x 4. 512
# samples: the 40 steps stay in one epoch, so a sample seen twice is a step trained twice.
SPOT_ARGS = ["--steps", str(STEPS), "--global-batch", "8", "--per-device", "2"]
SPOT_ARGS += ["--save-every", str(SAVE_EVERY), "--samples", "512"]
PLAIN = "examples/plain_train.py"
PLAIN_ARGS = ["--steps", str(STEPS), "--batch", "4", "--save-every", str(SAVE_EVERY)]
PLAIN_ARGS += ["--samples", "512"]
# Long enough to work (and on a loaded machine) to be a few steps past the step a wait saw
# when the next preemption lands; the pace is a sleep, it draws no random numbers.
STEP_TIME = "0.25"
# The shrink's loss curve against the reference's: the same samples in the same global
# batch, so only the float32 summation order differs (4 micro-batches accumulated on one
# rank against 2 on each of two, averaged by an all-reduce); that moves a step's loss by
# about 1e-7 relative (2e-7 measured over the 40 steps: Adam on this smooth problem does not
# amplify it), while one step on other samples moves it by tens of percent.
LOSS_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def spot_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """The uninterrupted SpotCheckpoints run, shared by the module's tests."""
    ref = Reference(tmp_path_factory.mktemp("spot") / "reference", SPOT, SPOT_ARGS)
    yield ref
    ref.stop()


def fleet(tmp_path: Path, home: Path, command: list[str], nodes_min: int) -> Fleet:
    samples = tmp_path / "samples"
    command = [*command, "--step-time", STEP_TIME, "--sample-log", str(samples)]
    spec = job_spec(
        "plain", command, tmp_path / "volume", nodes_min=nodes_min, every_steps=SAVE_EVERY
    )
    return Fleet(home, spec, tmp_path / "plain_job.yaml")


def spot_final(volume: Path) -> dict[str, torch.Tensor]:
    """The weights of the committed ``step-STEPS`` under ``volume`` (its manifest read)."""
    found = [p for p in volume.rglob("step-*") if (p / "MANIFEST.json").exists()]
    final = [p for p in found if Manifest.read(p).step == STEPS]
    assert final, f"no committed step-{STEPS} under {volume}: {found}"
    state = torch.load(final[0] / "state.pt", weights_only=True)
    assert state["step"] == STEPS
    return dict(state["model"])


def test_a_spot_checkpoints_script_survives_a_notice_and_a_kill_with_uninterrupted_weights(
    tmp_path: Path, home: Path, spot_reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    done = notice_then_kill(fleet(tmp_path, home, [SPOT, *SPOT_ARGS], nodes_min=2), STEPS)
    assert done["final_step"] == STEPS, done
    assert_same_samples(counted_steps(tmp_path / "samples"), spot_reference.steps(), STEPS)
    want = spot_final(spot_reference.finished())
    assert_same_weights(spot_final(tmp_path / "volume"), want)


def test_a_spot_checkpoints_script_shrinks_to_one_node_on_the_same_samples(
    tmp_path: Path, home: Path, spot_reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across a shrink from two nodes to one, every step trains on the reference's samples
    (the example's global batch is a fixed slice of the step's epoch order, dealt to
    whatever ranks there are), and the loss curve stays within ``LOSS_TOLERANCE`` of it."""
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    done = shrink(fleet(tmp_path, home, [SPOT, *SPOT_ARGS], nodes_min=1))
    # Not the preemption count: a fast job can finish inside the notice window, before the
    # VM it drained is gone and counted.
    assert (done["final_step"], done["steps_lost"]) == (STEPS, 0), done
    got = counted_steps(tmp_path / "samples")
    assert_shrunk_on_the_same_samples(got, spot_reference.steps(), STEPS, LOSS_TOLERANCE)


def logged(samples: Path) -> dict[str, list[int]]:
    """The sample log's steps per file (one file per worker process), in order."""
    out = {}
    for path in sorted(samples.glob("*.jsonl")):
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        out[path.name] = [int(r["step"]) for r in rows]
    return out


def plain_state(volume: Path) -> dict[str, Any] | None:
    """The plain script's own checkpoint (``plain/state.pt``) under ``volume``, if any."""
    found = list(volume.rglob("plain/state.pt"))
    return torch.load(found[0], weights_only=True) if found else None


def test_a_script_without_spottrain_stops_at_a_notice_and_resumes_where_it_stopped(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/plain_train.py imports nothing of spottrain's: no progress, commit or
    restore reaches Redis, so the test reads the script's own sample log and state file.
    Through a notice (the agent SIGTERMs n1's worker; the ranks agree to stop, rank 0
    saves and both exit), no step is trained twice: the checkpoint after the notice is the
    step the ranks stopped at, and the final weights are the uninterrupted run's.

    Its end is its workers all returning 0, which the agent reports to the run: the run
    finishes by itself once the script's state file holds the last step.
    """
    reference = Reference(tmp_path / "reference", PLAIN, PLAIN_ARGS)
    try:
        monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
        samples, volume = tmp_path / "samples", tmp_path / "volume"
        plain = fleet(tmp_path, home, [PLAIN, *PLAIN_ARGS], nodes_min=2)
        first = wait(
            lambda: (seen := logged(samples)) and min(s[-1] for s in seen.values()) > 2 and seen,
            "two ranks training past step 2",
            TIMEOUT,
            0.2,
        )
        plain.preempt("n1", notice=True)
        wait(
            lambda: (s := plain_state(volume)) is not None and s["step"] == STEPS,
            "the script's checkpoint of the last step",
            TIMEOUT,
            0.2,
        )
        final = plain_state(volume)
        done = plain.finished()
        plain.down()
        assert done["preemptions"] == 1, done
        assert final is not None
        root = reference.finished()
    finally:
        reference.stop()
    runs = logged(samples)
    before = {name: runs[name] for name in first}
    after = {name: s for name, s in runs.items() if name not in first}
    stopped = max(s[-1] for s in before.values())
    assert all(s == list(range(1, stopped + 1)) for s in before.values()), before
    # Every later worker resumed right after the step the ranks stopped at: nothing redone.
    assert after and all(s[0] == stopped + 1 for s in after.values()), (stopped, after)
    assert_same_samples(counted_steps(samples), counted_steps(root / "samples"), STEPS)
    want = torch.load(root / "plain/state.pt", weights_only=True)
    assert_same_weights(dict(final["model"]), dict(want["model"]))
