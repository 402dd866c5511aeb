"""What the bring-your-own-code end-to-end tests share: the run's events and progress read
from its Redis, the VM of a node, the uninterrupted reference run (the same example script
under a plain torchrun), and the examples' sample log, read back as the steps that counted.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from spottrain.cloud.local.compute import LocalProvider
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

from ._fleet import REPO


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
    root.mkdir()
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
