"""Replica mode's run: three replicas of ``examples/replica_train.py`` (one process each)
on the Redis quorum (a lighthouse shim per replica, as each VM's agent runs it) or beside
the torchft lighthouse started with the controller's own command line
(:func:`spottrain.controller.run.lighthouse.lighthouse_command`), Redis for the holder rows
and drain requests, and the three events done in turn to ``replica-2``, a joiner started
after the first two. The replicas, the lighthouse and their cleanup are the engine tests'
(``tests/integration/agent/replica/replica_cluster.py``), imported."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis

from replica_parts.figures import pause_through, step_time
from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.controller.run.lighthouse import (
    find_lighthouse_binary,
    lighthouse_command,
    serving,
)
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration" / "agent" / "replica"))

from replica_cluster import Cluster, Lighthouse, Replica, wait_for  # noqa: E402

VICTIM = "replica-2"
SURVIVORS_STEPS = 5  # committed steps of the smaller quorum that end an event's window
DRAIN_GRACE_S = 30.0  # the agent's SIGTERM after a notice's grace, if the leave has not ended


class ControllerLighthouse(Lighthouse):
    """The lighthouse as the controller runs it: its command line and flags."""

    def start(self) -> None:
        cmd = lighthouse_command(find_lighthouse_binary(), self.addr, 1)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
        wait_for(lambda: serving(self.addr), 30, "the lighthouse to serve")


@dataclass
class ReplicaRun:
    step_s: float = 0.0
    stalls: dict[str, float | None] = field(default_factory=dict)
    discarded: dict[str, int] = field(default_factory=dict)
    join_s: list[float] = field(default_factory=list)
    fetch_s: list[float] = field(default_factory=list)
    load_s: float | None = None
    state_bytes: int | None = None


def _committed_times(rep: Replica, participants: int | None = None) -> list[float]:
    return [
        r["t"] for r in rep.committed() if participants is None or r["participants"] == participants
    ]


def _after(rep: Replica, t: float, participants: int) -> int:
    return sum(1 for r in rep.committed() if r["t"] > t and r["participants"] == participants)


def _drain(client: redis.Redis, keys: RunKeys, rep: Replica) -> None:
    """A notice as the agent handles it: with the Redis quorum the VM's shim is told the
    replica leaves (the explicit leave), a drain request for the node, SIGTERM after the
    grace if the workers are still there."""
    if rep.shim is not None:
        rep.shim.leave()
    now = time.time()
    request = {"id": 1, "drain": True, "at": now, "deadline": now + 60}
    client.hset(keys.ckpt_requests, f"node-{rep.name}", json.dumps(request))
    try:
        rep.proc.wait(timeout=DRAIN_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(rep.proc.pid, signal.SIGTERM)
        rep.proc.wait(timeout=30)
    client.hdel(keys.ckpt_requests, f"node-{rep.name}")


def _join(cluster: Cluster, args: tuple[str, ...], ckpt: Path, a: Replica, out: ReplicaRun,
          cap: float) -> Replica:  # fmt: skip
    joiner = cluster.start(VICTIM, *args, ckpt=ckpt)
    healed = wait_for(lambda: joiner.events("healed"), cap, "the joiner to heal")[0]
    first = wait_for(lambda: joiner.events("first-step"), cap, "the joiner's first step")[0]
    wait_for(lambda: _after(a, first["t"], 3) >= 3, cap, "three replicas again")
    out.join_s.append(first["t"] - joiner.started_at)
    out.fetch_s.append(healed["heal_s"])
    return joiner


def run(
    workdir: Path, server: RedisServer, args: tuple[str, ...], cap: float, quorum: str = "redis"
) -> ReplicaRun:
    """One repetition; ``args`` are replica_train.py's model and pace flags; ``quorum``:
    "redis" (a shim per replica on the run's Redis, as each VM's agent runs it) or
    "lighthouse" (torchft's, as the controller runs it)."""
    workdir.mkdir(parents=True)
    ckpt = workdir / "ckpt"
    ckpt.mkdir()
    lighthouse = None
    if quorum == "lighthouse":
        lighthouse = ControllerLighthouse(free_port(), workdir / "lighthouse.log")
        lighthouse.start()
    cluster = Cluster(workdir, lighthouse, server.endpoint, f"bench-{uuid.uuid4().hex[:8]}")
    client = server.client()
    keys = RunKeys(cluster.run_id or "")
    out = ReplicaRun()
    try:
        a, _b, victim = (cluster.start(f"replica-{j}", *args, ckpt=ckpt) for j in range(3))
        wait_for(lambda: _after(a, 0.0, 3) >= 10, cap * 2, "three replicas training together")
        out.step_s = step_time(_committed_times(a, 3)[-10:]) or 0.0
        for event in ("notice", "kill", "freeze"):
            t0 = time.time()
            if event == "notice":
                _drain(client, keys, victim)
            elif event == "kill":
                os.killpg(victim.proc.pid, signal.SIGKILL)
            else:
                os.killpg(victim.proc.pid, signal.SIGSTOP)
            done = wait_for(
                lambda t=t0: _after(a, t, 2) >= SURVIVORS_STEPS and time.time(),
                cap,
                f"the survivors to go on after the {event}",
            )
            out.stalls[event] = pause_through(_committed_times(a), t0, done)
            out.discarded[event] = sum(1 for r in a.steps() if r["t"] > t0 and not r["committed"])
            if event == "freeze":
                os.killpg(victim.proc.pid, signal.SIGCONT)
                os.killpg(victim.proc.pid, signal.SIGKILL)
            else:
                victim = _join(cluster, args, ckpt, a, out, cap)
        _measure_load(cluster, args, ckpt, out, cap)
        return out
    finally:
        cluster.stop_all()


def _measure_load(
    cluster: Cluster, args: tuple[str, ...], ckpt: Path, out: ReplicaRun, cap: float
) -> None:
    """A checkpoint load of the same state: every replica stopped, a new one (another run
    id, so no live holder) restores the newest periodic checkpoint from disk."""
    wait_for(lambda: CheckpointDir(ckpt).find_restorable(), cap, "a periodic checkpoint")
    for rep in cluster.replicas:
        if rep.proc.poll() is None:
            os.killpg(rep.proc.pid, signal.SIGKILL)
            rep.proc.wait(timeout=30)
    cluster.run_id = f"bench-load-{uuid.uuid4().hex[:8]}"
    loader = cluster.start("replica-0", *args, ckpt=ckpt)
    start = wait_for(lambda: loader.events("start"), cap, "the loader to restore")[0]
    out.load_s, out.state_bytes = start["restore_s"], start["state_bytes"]


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
