"""What the bring-your-own-code end-to-end tests share: the example's job spec, a fleet
brought up by ``spottrain up`` (its events and progress read from its Redis, its nodes
preempted on the local cloud), the two journeys every framework makes (a notice then a kill
at a fixed size; a shrink), the uninterrupted reference run (the same example script under a
plain torchrun), and the examples' sample log, read back as the steps that counted.

The sample log (each example's ``--sample-log DIR``): every rank appends one JSON line per
optimizer step it finished to a file of its own under DIR::

    {"step": k, "rank": r, "world": W, "samples": [i, ...], "loss": x, "t": unix time}

``samples`` are the dataset indices that rank trained on in step ``k`` (every micro-batch),
``loss`` its mean loss over them. A step redone after a restore is logged again; the attempt
that counted is the newest one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch
import yaml

from spottrain.cloud.local.compute import LocalProvider
from spottrain.controller.run.records import find_run
from spottrain.controller.run.run_redis import open_redis
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

from ._fleet import REPO, Cli, wait

TIMEOUT = 360.0  # any one wait, on a loaded 2-core machine


def events(client: redis.Redis, run_id: str, kind: str) -> list[dict[str, str]]:
    """The run's events of one type, oldest first, decoded."""
    out = []
    for _, fields in client.xrange(RunKeys(run_id).events):
        row = {k.decode(): v.decode() for k, v in fields.items()}
        if row.get("type") == kind:
            out.append(row)
    return out


def progress(client: redis.Redis, run_id: str) -> tuple[int, int]:
    """The run's (step, world size), as its rank 0 reported them."""
    raw = client.hgetall(RunKeys(run_id).progress)
    return int(float(raw.get(b"step", 0))), int(float(raw.get(b"world_size", 0)))


def training_past(client: redis.Redis, run_id: str, step: int, world: int = 2) -> bool:
    """``world`` ranks train (after any restore) and have passed ``step``."""
    now, size = progress(client, run_id)
    return size == world and now > step


def vm_of(cloud: LocalProvider, run_id: str, node: str) -> str:
    """The live VM of ``node`` in ``run_id`` (a backfill reuses the node's name)."""
    for rec in cloud.store.all():
        tags = rec.get("tags", {})
        if tags.get("spottrain-job") == run_id and tags.get("spottrain-node") == node:
            return str(rec["id"])
    raise AssertionError(f"no VM of node {node} in run {run_id}")


def start_reference(
    root: Path, script: str, args: Sequence[str], *, workers: int = 2
) -> subprocess.Popen[bytes]:
    """The uninterrupted run: ``script ARGS`` under a plain torchrun with ``workers`` workers
    on one node and no Redis, checkpoints in ``root``, output in ``root/log``."""
    root.mkdir(parents=True)
    env = {
        **os.environ,
        "SPOTTRAIN_CKPT_DIR": str(root),
        "SPOTTRAIN_REDIS": "",
        # torchrun sets one thread per worker only when a node runs several; the fleet's
        # nodes run one each, and the CPU's float sums depend on the thread count.
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1"]
    cmd += [f"--nproc-per-node={workers}", "--rdzv-backend=c10d"]
    cmd += [f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", script, *args]
    with open(root / "log", "wb") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


class Reference:
    """The uninterrupted run of ``script ARGS --sample-log ROOT/samples``, started at once
    (a module's tests share it: it overlaps their fleets' boots)."""

    def __init__(self, root: Path, script: str, args: Sequence[str]) -> None:
        self.root = root
        self.proc = start_reference(root, script, [*args, "--sample-log", str(root / "samples")])

    def finished(self) -> Path:
        """Its directory (checkpoints, ``samples/``, ``log``), once it ended well."""
        log = self.root / "log"
        assert self.proc.wait(TIMEOUT) == 0, log.read_text(errors="replace")[-4000:]
        return self.root

    def steps(self) -> dict[int, Step]:
        """Its counted steps, once it ended well."""
        return counted_steps(self.finished() / "samples")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def job_spec(
    integration: str, command: Sequence[str], volume: Path, *, nodes_min: int, every_steps: int
) -> dict[str, Any]:
    """A two-node job of the example ``command`` on the local cloud, one worker per node,
    with room in both zones for backfills."""
    return {
        "name": f"tiny-{integration}",
        "code": {"archive": {"path": str(REPO)}},
        "train": {
            "command": " ".join(command),
            "integration": integration,
            # The reference's two workers on one node get one thread each from torchrun; the
            # fleet's single worker per node would not, and the CPU's float sums depend on it.
            "env": {"OMP_NUM_THREADS": "1"},
        },
        "nodes": {"min": nodes_min, "max": 2, "gpus": 0, "workers": 1},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 50},
        "checkpoint": {
            "volume": {"path": str(volume), "write_gbps": 0.5},
            "every_steps": every_steps,
            "size_gb": 0.001,
        },
        "local": {
            "zones": {"local-a": {"capacity": 4}, "local-b": {"capacity": 4}},
            "launch_latency_s": 1,
            "notice_s": 20,
        },
    }


class Fleet:
    """One ``spottrain up`` (detached) of a job spec in ``home`` (which SPOTTRAIN_HOME must
    name): its CLI, run id, Redis and local cloud."""

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

    def stockout(self) -> None:
        """No zone takes another VM (capacity limits launches; the running VMs stay)."""
        for zone in self.cloud.settings.zones:
            self.cloud.set_capacity(zone, 0)

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
            lambda: [c for c in self.events("checkpoint-committed") if c["kind"] == "emergency"],
            "the emergency checkpoint",
            TIMEOUT,
            0.2,
        )
        assert found[0]["drain"] == "1", found
        return int(found[0]["step"])

    def restored_after(self, at: float, step: int) -> None:
        """The first restore after ``at`` went back to ``step`` and no further."""
        restored = wait(
            lambda: [r for r in self.events("restored") if float(r["at"]) > at],
            "the restore after the notice",
            TIMEOUT,
            0.2,
        )
        assert (restored[0]["step"], restored[0]["reached"]) == (str(step), str(step)), restored

    def events(self, kind: str) -> list[dict[str, str]]:
        return events(self.client, self.run_id, kind)

    def finished(self) -> dict[str, Any]:
        """The run's status once training ended."""
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


def notice_then_kill(fleet: Fleet, steps: int) -> dict[str, Any]:
    """At two nodes: a notice on n1 (every rank saves one agreed step, the backfill joins,
    training resumes at that step: nothing lost), then, a few steps later, a kill of n0
    without notice (the newest committed checkpoint restored, the steps after it redone);
    training finishes, and ``steps lost`` is only what the kill cost. Ends the run; returns
    its final status (the caller checks the final step)."""
    fleet.past(2)
    noticed = fleet.preempt("n1", notice=True)
    step = fleet.emergency()
    assert 2 < step < steps, step
    fleet.restored_after(noticed, step)
    fleet.past(step + 2)
    killed = fleet.preempt("n0", notice=False)
    restores: list[dict[str, str]] = []

    def ended() -> Any:
        # Read with each poll, before the status: once training ends the controller may stop
        # the run's Redis before a read after the wait.
        restores[:] = fleet.events("restored")
        status = fleet.cli.status(fleet.run_id)
        return status["final_step"] is not None and status

    done = dict(wait(ended, "training to finish", TIMEOUT))
    fleet.down()
    assert done["preemptions"] == 2, done
    between = [r for r in restores if noticed < float(r["at"]) < killed]
    assert all(r["step"] == r["reached"] for r in between), between
    assert any(float(r["at"]) > killed for r in restores), "no restore after the kill"
    lost = sum(int(r["reached"]) - int(r["step"]) for r in restores)
    assert done["steps_lost"] == lost, (done, restores)
    return done


def shrink(fleet: Fleet) -> dict[str, Any]:
    """From two nodes to one: a stockout everywhere, then a notice on n1; the survivor trains
    on alone from the emergency checkpoint and finishes. Ends the run; returns its final
    status (the caller checks the final step and that nothing was lost)."""
    fleet.past(2)
    fleet.stockout()
    noticed = fleet.preempt("n1", notice=True)
    step = fleet.emergency()
    fleet.restored_after(noticed, step)
    fleet.past(step + 2, world=1)
    done = fleet.finished()
    fleet.down()
    return done


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"final weights differ from the uninterrupted run's: {different}"


def assert_shrunk_on_the_same_samples(
    got: dict[int, Step], want: dict[int, Step], steps: int, tolerance: float
) -> None:
    """A shrunk run trained every step on the reference's samples, its last steps at world
    size 1, and its loss curve is within ``tolerance`` (relative) of the reference's."""
    assert_same_samples(got, want, steps)
    alone = [k for k, s in got.items() if s.world == 1]
    assert alone and max(alone) == steps, f"steps at world size 1: {alone}"
    gap = loss_gap(got, want)
    print(f"loss gap across the shrink: {gap:.3g} (tolerance {tolerance})")
    assert gap < tolerance, gap


@dataclass(frozen=True)
class Step:
    """One optimizer step as it counted: its world size, the samples of all its ranks (a
    sample twice in one step stays twice) and the mean of the ranks' losses."""

    world: int
    samples: tuple[int, ...]
    loss: float


def counted_steps(log_dir: Path) -> dict[int, Step]:
    """The sample log's steps, each from its newest attempt: walking a step's lines from the
    newest back, the first line fixes the world size W and the newest line of each of ranks
    0..W-1 at that size is the attempt's.

    Raises:
        AssertionError: a step's newest attempt lacks a rank.
    """
    lines: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(log_dir.glob("*.jsonl")):
        for raw in path.read_text().splitlines():
            if raw.strip():
                row = json.loads(raw)
                lines.setdefault(int(row["step"]), []).append(row)
    steps = {}
    for step, rows in lines.items():
        rows.sort(key=lambda r: float(r["t"]))
        world = int(rows[-1]["world"])
        ranks: dict[int, dict[str, Any]] = {}
        for row in reversed(rows):
            if int(row["world"]) == world:
                ranks.setdefault(int(row["rank"]), row)
        missing = set(range(world)) - ranks.keys()
        assert not missing, f"step {step} at world size {world} has no line of ranks {missing}"
        picked = [ranks[r] for r in range(world)]
        samples = tuple(sorted(i for row in picked for i in row["samples"]))
        loss = sum(float(row["loss"]) for row in picked) / world
        steps[step] = Step(world, samples, loss)
    return steps


def assert_same_samples(
    got: dict[int, Step], want: dict[int, Step], steps: int, epoch_steps: int | None = None
) -> None:
    """Every step 1..``steps`` trained on exactly the reference's samples, whatever world
    size each step ran at: none skipped, none seen twice within an epoch of
    ``epoch_steps`` steps (default: the whole run is one epoch)."""
    assert sorted(want) == list(range(1, steps + 1)), f"reference logged {sorted(want)}"
    assert sorted(got) == list(range(1, steps + 1)), f"the run logged {sorted(got)}"
    wrong = [k for k in want if got[k].samples != want[k].samples]
    assert not wrong, f"steps that trained on other samples than the reference's: {wrong}"
    per = epoch_steps or steps
    for first in range(1, steps + 1, per):
        epoch = [i for k in range(first, min(first + per, steps + 1)) for i in got[k].samples]
        assert len(epoch) == len(set(epoch)), f"a sample of the epoch from step {first} twice"


def loss_gap(got: dict[int, Step], want: dict[int, Step]) -> float:
    """The largest relative difference between the two loss curves, step by step."""
    return max(abs(got[k].loss - want[k].loss) / max(abs(want[k].loss), 1e-12) for k in want)
