"""The dead man's switch on the local cloud, with real agents, torchrun and an embedded
Redis: once its controller is killed (SIGKILL, nobody runs ``resume``), a fleet whose
training goes on keeps training, through a Redis outage too, and a fleet whose training has
stalled ends itself, each VM after its emergency checkpoint.

The orphan timeout is 3 s (``controller.orphan_timeout_minutes: 0.05``); every wait is for
a condition (steps trained, keys gone, VMs ended), never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from spottrain.controller.run.records import RunInfo
from spottrain.controller.run.run_redis import (
    open_redis,
    restart_embedded_redis,
    stop_embedded_redis,
)
from spottrain.protocol.keys import RunKeys

from ._fleet import REPO, cli, wait

pytestmark = [pytest.mark.slow, pytest.mark.waits]

TIMEOUT_S = 3.0
STEP_S = 0.05
# Steps that take well over twice the orphan timeout at STEP_S a step.
MANY_STEPS = int(4 * TIMEOUT_S / STEP_S)


@pytest.fixture
def home(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    return home


def _vms(home: Path, run_id: str) -> list[dict[str, Any]]:
    out = []
    for p in (home / "local" / "instances").glob("vm-*.json"):
        rec = json.loads(p.read_text())
        if rec.get("tags", {}).get("spottrain-job") == run_id:
            out.append(rec)
    return out


def _trained(progress: Path) -> int:
    lines = progress.read_text().split() if progress.exists() else []
    return int(lines[-1]) if lines else 0


def _events(client: redis.Redis, keys: RunKeys) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.events)]


def test_a_fleet_without_its_controller_trains_on_and_ends_itself_once_training_stalls(
    tmp_path: Path, home: Path
) -> None:
    stall, progress = tmp_path / "stall", tmp_path / "progress"
    spec = {
        "name": "orphan",
        "code": {"archive": {"path": str(REPO)}},
        "train": {
            "command": f"tests/e2e/stall_train.py --stall-file {stall} --progress {progress} "
            f"--step-time {STEP_S}"
        },
        "nodes": {"min": 1, "max": 2, "gpus": 0, "workers": 1},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 50},
        "checkpoint": {
            "volume": {"path": str(tmp_path / "volume"), "write_gbps": 1},
            "every_steps": 100_000,
        },
        "local": {"zones": {"local-a": {"capacity": 2}}, "notice_s": 30},
        "controller": {"orphan_timeout_minutes": TIMEOUT_S / 60},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    up = cli(home, "up", str(path), "--detach", "--interval", "0.5")
    assert up.returncode == 0, up.stderr
    run_id = up.stdout.split()[1].rstrip(":")
    info = RunInfo.load(run_id)
    client = open_redis(info)  # the embedded Redis has a per-run password
    keys = RunKeys(run_id)

    def joined() -> bool:
        states = [client.hget(keys.node(n), "state") for n in ("n0", "n1")]
        return states == [b"joined", b"joined"] and _trained(progress) >= 20

    wait(joined, "two joined nodes training", 300, poll=0.5)
    os.kill(info.controller_pid, signal.SIGKILL)
    wait(
        lambda: not client.exists(keys.ctl_alive), "the controller heartbeat to lapse", 60, poll=0.5
    )

    # Its Redis goes away too, while the training goes on: nothing ends.
    stop_embedded_redis(info)
    at = _trained(progress)
    wait(lambda: _trained(progress) >= at + MANY_STEPS, "steps trained without Redis", poll=0.5)
    assert all(v["state"] == "running" for v in _vms(home, run_id))
    restart_embedded_redis(info)

    # Redis is back, the controller is still gone, the training goes on: nothing ends.
    at = _trained(progress)
    wait(
        lambda: _trained(progress) >= at + MANY_STEPS, "steps trained without controller", poll=0.5
    )
    assert all(v["state"] == "running" for v in _vms(home, run_id))
    assert not [e for e in _events(client, keys) if e["type"] == "orphaned"]

    # The training stalls (a step now takes longer than the orphan timeout): each VM drains,
    # its workers save an emergency checkpoint at their next step, and the VM ends itself.
    stall.touch()
    stalled_at = _trained(progress)
    wait(
        lambda: all(v["state"] == "terminated" for v in _vms(home, run_id)),
        "every VM to end itself",
        poll=0.5,
    )
    vms = _vms(home, run_id)
    assert len(vms) == 2 and all(v["reason"] == "shut down by its agent" for v in vms), vms
    events = _events(client, keys)
    for vm in vms:
        node = vm["tags"]["spottrain-node"]
        mine = [e for e in events if e["node"] == node]
        kinds = [e["type"] for e in mine]
        assert "orphaned" in kinds and "self-terminate" in kinds, kinds
        drained = next(e for e in mine if e["type"] == "drained")
        assert drained["source"] == "orphan"
        assert json.loads(drained["committed_step"]) >= stalled_at, drained
        assert kinds.index("drained") < kinds.index("self-terminate")
        assert float(drained["at"]) <= float(vm["ended_at"])
    last = {k.decode(): v.decode() for k, v in client.hgetall(keys.ckpt_last).items()}
    assert last["drain"] == "1" and int(last["step"]) >= stalled_at
