"""Bring your own Hugging Face ``Trainer`` script, end to end on the local cloud: ``spottrain
up`` of examples/hf_trainer_train.py (a tiny GPT-2 built from a config, no download) at a
fixed size of two nodes, through a preemption with notice and a kill without notice, each
lost node backfilled.

The reference is the same script run uninterrupted by a plain torchrun at the same world
size (the Trainer is deterministic on the CPU with its fixed seed: dropout, data order and
the resumed RNG states included), started first so that it overlaps the fleet's boot.
Preemptions are injected when training has reached a step, never after a delay.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
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
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

from ._fleet import REPO, Cli, wait

pytestmark = pytest.mark.slow

STEPS = 40
SAVE_STEPS = 10
# Global batch 8 = 2 per device x 2 ranks x accumulation 2 (one torchrun worker per node).
TRAIN_ARGS = ["--steps", str(STEPS), "--global-batch", "8", "--per-device", "2"]
TRAIN_ARGS += ["--save-steps", str(SAVE_STEPS)]
SCRIPT = "examples/hf_trainer_train.py"
# Long enough to work (and on a loaded machine) to be a few steps past the step a wait saw
# when the next preemption lands; the pace is a sleep, it draws no random numbers.
STEP_TIME = "0.25"
TIMEOUT = 360.0  # any one wait, on a loaded 2-core machine


def job_spec(volume: Path) -> dict[str, Any]:
    return {
        "name": "tiny-hf",
        "code": {"archive": {"path": str(REPO)}},
        "train": {
            "command": " ".join([SCRIPT, *TRAIN_ARGS, "--step-time", STEP_TIME]),
            "integration": "hf",
            # torchrun sets one thread per worker only when a node runs several; the
            # reference's two workers on one node get it, and the CPU's float sums depend on
            # the thread count.
            "env": {"OMP_NUM_THREADS": "1"},
        },
        "nodes": {"min": 2, "max": 2, "gpus": 0, "workers": 1},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 50},
        "checkpoint": {
            "volume": {"path": str(volume), "write_gbps": 0.5},
            "every_steps": SAVE_STEPS,
            "size_gb": 0.01,
        },
        "local": {
            "zones": {"local-a": {"capacity": 4}, "local-b": {"capacity": 4}},
            "launch_latency_s": 1,
            "notice_s": 20,
        },
    }


def start_reference(root: Path) -> subprocess.Popen[bytes]:
    """The uninterrupted run: the same script under a plain torchrun with two workers, no
    Redis; its final checkpoint is ``root/checkpoint-STEPS``, its output ``root/log``."""
    root.mkdir()
    env = {
        **os.environ,
        "SPOTTRAIN_CKPT_DIR": str(root),
        "SPOTTRAIN_REDIS": "",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    cmd += ["--max-restarts=0", SCRIPT, *TRAIN_ARGS]
    with open(root / "log", "wb") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


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


def training_past(client: redis.Redis, run_id: str, step: int) -> bool:
    """Both ranks train (after any restore) and have passed ``step``."""
    now, world = progress(client, run_id)
    return world == 2 and now > step


def vm_of(cloud: LocalProvider, run_id: str, node: str) -> str:
    for rec in cloud.store.all():
        tags = rec.get("tags", {})
        if tags.get("spottrain-job") == run_id and tags.get("spottrain-node") == node:
            return str(rec["id"])
    raise AssertionError(f"no VM of node {node} in run {run_id}")


def final_weights(volume: Path) -> dict[str, torch.Tensor]:
    """The committed final checkpoint's weights (the manifest verifies it), wherever the
    nodes' volume put it."""
    found = [p for p in volume.rglob(f"checkpoint-{STEPS}") if (p / "MANIFEST.json").exists()]
    assert found, f"no committed checkpoint-{STEPS} under {volume}"
    manifest = Manifest.read(found[0])
    assert (manifest.step, manifest.kind) == (STEPS, "final")
    return load_file(found[0] / "model.safetensors")


@pytest.fixture
def reference(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = start_reference(tmp_path / "reference")
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_trainer_script_survives_a_notice_and_a_kill_and_ends_with_uninterrupted_weights(
    tmp_path: Path, home: Path, reference: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    volume = tmp_path / "volume"
    path = tmp_path / "hf_job.yaml"
    path.write_text(yaml.safe_dump(job_spec(volume)))
    cli = Cli(home)
    up = cli.run("up", str(path), "--detach", "--interval", "0.5")
    assert up.returncode == 0, up.stdout + up.stderr
    run_id = up.stdout.split()[1].rstrip(":")
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    info = find_run(run_id)
    client = open_redis(info, info.spec())
    cloud = LocalProvider.open(home / "local")
    try:
        wait(lambda: training_past(client, run_id, 2), "two nodes training", TIMEOUT, 0.2)
        # A preemption with notice: every rank saves checkpoint-N at one agreed step, the
        # backfilled node joins, and training resumes at N, the step it had reached.
        noticed = time.time()
        assert cloud.preempt(vm_of(cloud, run_id, "n1"), notice=True)
        emergency = wait(
            lambda: [
                c
                for c in events(client, run_id, "checkpoint-committed")
                if c["kind"] == "emergency"
            ],
            "the emergency checkpoint",
            TIMEOUT,
            0.2,
        )
        step = int(emergency[0]["step"])
        assert 2 < step < STEPS and emergency[0]["drain"] == "1"
        restored = wait(
            lambda: [r for r in events(client, run_id, "restored") if float(r["at"]) > noticed],
            "the restore after the notice",
            TIMEOUT,
            0.2,
        )
        assert (restored[0]["step"], restored[0]["reached"]) == (str(step), str(step))
        # A kill without notice, a few steps after the resume: the survivor and the next
        # backfill restore the newest committed checkpoint and redo the steps after it.
        wait(
            lambda: training_past(client, run_id, step + 2),
            "training past the notice",
            TIMEOUT,
            0.2,
        )
        killed = time.time()
        assert cloud.preempt(vm_of(cloud, run_id, "n0"), notice=False)
        done = wait(
            lambda: (s := cli.status(run_id))["final_step"] is not None and s,
            "training to finish",
            TIMEOUT,
        )
        restores = events(client, run_id, "restored")
    finally:
        client.close()
    assert done["final_step"] == STEPS and done["preemptions"] == 2, done
    # Every restore between the notice and the kill went back no step.
    noticed_restores = [r for r in restores if noticed < float(r["at"]) < killed]
    assert all(r["step"] == r["reached"] for r in noticed_restores), noticed_restores
    assert any(float(r["at"]) > killed for r in restores), "no restore after the kill"
    # steps lost, as the run counts them: only what the kill cost.
    lost = sum(int(r["reached"]) - int(r["step"]) for r in restores)
    assert done["steps_lost"] == lost, (done, restores)
    log = tmp_path / "reference" / "log"
    assert reference.wait(TIMEOUT) == 0, log.read_text(errors="replace")[-4000:]
    want = load_file(tmp_path / "reference" / f"checkpoint-{STEPS}" / "model.safetensors")
    got = final_weights(volume)
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"final weights differ from the uninterrupted run's: {different}"
    assert cli.run("down", run_id, timeout=180).returncode == 0
