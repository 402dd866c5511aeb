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
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import yaml

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

# Each test's waits are bounded one by one (TIMEOUT); pytest-timeout's default would cut a
# loaded machine's run short of them.
# Mostly waiting (paced steps, notice windows): scripts/test runs it beside the box tests,
# the module's tests on one worker, which holds their shared reference run.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.beside,
    pytest.mark.xdist_group("byo-plain"),
    pytest.mark.timeout(900),
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
TIMEOUT = 360.0  # any one wait, on a loaded 2-core machine
# The shrink's loss curve against the reference's: the same samples in the same global
# batch, so only the float32 summation order differs (4 micro-batches accumulated on one
# rank against 2 on each of two, averaged by an all-reduce); that moves a step's loss by
# about 1e-7 relative (2e-7 measured over the 40 steps: Adam on this smooth problem does not
# amplify it), while one step on other samples moves it by tens of percent.
LOSS_TOLERANCE = 1e-4


def job_spec(
    volume: Path, command: list[str], *, nodes_min: int, capacity: int = 4
) -> dict[str, Any]:
    return {
        "name": "tiny-plain",
        "code": {"archive": {"path": str(REPO)}},
        "train": {
            "command": " ".join(command),
            "integration": "plain",
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
            "zones": {"local-a": {"capacity": capacity}, "local-b": {"capacity": capacity}},
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


def spawn(root: Path, script: str, args: list[str]) -> subprocess.Popen[bytes]:
    return start_reference(root, script, [*args, "--sample-log", str(root / "samples")])


def finish(proc: subprocess.Popen[bytes], root: Path) -> Path:
    """Wait for a reference run to end well; return its directory."""
    log = root / "log"
    assert proc.wait(TIMEOUT) == 0, log.read_text(errors="replace")[-4000:]
    return root


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def spot_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The uninterrupted SpotCheckpoints run, shared by the module's tests: a function
    that waits for it and returns its directory."""
    root = tmp_path_factory.mktemp("spot") / "reference"
    proc = spawn(root, SPOT, SPOT_ARGS)
    yield lambda: finish(proc, root)
    stop(proc)


def spot_final(volume: Path) -> dict[str, torch.Tensor]:
    """The weights of the committed ``step-STEPS`` under ``volume`` (its manifest read)."""
    found = [p for p in volume.rglob("step-*") if (p / "MANIFEST.json").exists()]
    final = [p for p in found if Manifest.read(p).step == STEPS]
    assert final, f"no committed step-{STEPS} under {volume}: {found}"
    state = torch.load(final[0] / "state.pt", weights_only=True)
    assert state["step"] == STEPS
    return dict(state["model"])


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"final weights differ from the uninterrupted run's: {different}"


def spot_command(samples: Path) -> list[str]:
    return [SPOT, *SPOT_ARGS, "--step-time", STEP_TIME, "--sample-log", str(samples)]


def test_a_spot_checkpoints_script_survives_a_notice_and_a_kill_with_uninterrupted_weights(
    tmp_path: Path, home: Path, spot_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    volume, samples = tmp_path / "volume", tmp_path / "samples"
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    fleet = Fleet(home, job_spec(volume, spot_command(samples), nodes_min=2), tmp_path / "j.yaml")
    fleet.past(2)
    # A preemption with notice: the agent SIGTERMs n1's worker, every rank saves step-N at
    # one agreed step, the backfilled node joins, and training resumes at N.
    noticed = fleet.preempt("n1", notice=True)
    step = fleet.emergency()
    assert 2 < step < STEPS
    restored = wait(
        lambda: [
            r for r in events(fleet.client, fleet.run_id, "restored") if float(r["at"]) > noticed
        ],
        "the restore after the notice",
        TIMEOUT,
        0.2,
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
    reference = spot_reference()
    assert_same_weights(spot_final(volume), spot_final(reference))
    assert_same_samples(counted_steps(samples), counted_steps(reference / "samples"), STEPS)


def test_a_spot_checkpoints_script_shrinks_to_one_node_on_the_same_samples(
    tmp_path: Path, home: Path, spot_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across a shrink from two nodes to one, every step trains on the reference's samples
    (the example's global batch is a fixed slice of the step's epoch order, dealt to
    whatever ranks there are), and the loss curve stays within ``LOSS_TOLERANCE`` of it."""
    volume, samples = tmp_path / "volume", tmp_path / "samples"
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    spec = job_spec(volume, spot_command(samples), nodes_min=1)
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
    want = counted_steps(spot_reference() / "samples")
    got = counted_steps(samples)
    assert_same_samples(got, want, STEPS)
    assert {got[k].world for k in got} == {1, 2}, {k: got[k].world for k in got}
    gap = loss_gap(got, want)
    print(f"shrink: largest relative loss gap to the reference {gap:.3g}")
    assert gap < LOSS_TOLERANCE


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
    reference = spawn(tmp_path / "reference", PLAIN, PLAIN_ARGS)
    try:
        volume, samples = tmp_path / "volume", tmp_path / "samples"
        monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
        command = [PLAIN, *PLAIN_ARGS, "--step-time", STEP_TIME, "--sample-log", str(samples)]
        fleet = Fleet(home, job_spec(volume, command, nodes_min=2), tmp_path / "j.yaml")
        first = wait(
            lambda: (seen := logged(samples)) and min(s[-1] for s in seen.values()) > 2 and seen,
            "two ranks training past step 2",
            TIMEOUT,
            0.2,
        )
        fleet.preempt("n1", notice=True)
        wait(
            lambda: (s := plain_state(volume)) is not None and s["step"] == STEPS,
            "the script's checkpoint of the last step",
            TIMEOUT,
            0.2,
        )
        final = plain_state(volume)
        done = fleet.finished()
        fleet.down()
        assert done["preemptions"] == 1, done
        assert final is not None
        finish(reference, tmp_path / "reference")
    finally:
        stop(reference)
    runs = logged(samples)
    before = {name: runs[name] for name in first}
    after = {name: s for name, s in runs.items() if name not in first}
    stopped = max(s[-1] for s in before.values())
    assert all(s == list(range(1, stopped + 1)) for s in before.values()), before
    # Every later worker resumed right after the step the ranks stopped at: nothing redone.
    assert after and all(s[0] == stopped + 1 for s in after.values()), (stopped, after)
    assert_same_samples(
        counted_steps(samples), counted_steps(tmp_path / "reference/samples"), STEPS
    )
    want = torch.load(tmp_path / "reference/plain/state.pt", weights_only=True)
    assert_same_weights(dict(final["model"]), dict(want["model"]))
