"""HSDP under faults: two replicas of TWO ranks each, every replica an FSDP2 model sharded
over its own ranks (gloo, CPU), gradient shards summed across replicas rank by rank through
the Redis quorum (a lighthouse shim per replica) and real torchft managers (:mod:`hsdp_worker`).

Each test prints the figures it measures (``pytest -s ... | grep FIGURE``)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from replica_cluster import Cluster, Replica, figure, max_gap, wait_for

from spottrain.ports import free_port
from spottrain.protocol.env import (
    ENV_MANAGER_PORT,
    ENV_MIN_REPLICAS,
    ENV_REPLICA_ID,
)

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("hsdp_worker.py")
RANKS = 2
GLOBAL = 16
ARGS = ("--global-batch", str(GLOBAL), "--step-time", "0.03")
# The summed gradient against an unsharded model's on the step's samples: float32 sums of
# the same terms in another order differ by a few ulps of the gradient's size (about 1).
GRAD_TOL = 1e-5


@dataclass
class HsdpReplica:
    """One replica: its ranks as processes in ONE process group (rank 0 leads it), so a
    signal to the group reaches the whole replica, as a lost VM would."""

    name: str
    ranks: list[Replica]

    @property
    def pgid(self) -> int:
        return self.ranks[0].proc.pid

    def reached(self) -> int:
        return min(r.reached() for r in self.ranks)

    def events(self, name: str) -> list[dict[str, Any]]:
        return self.ranks[0].events(name)

    def tail(self) -> str:
        return "\n".join(r.tail() for r in self.ranks)


def start_replica(cluster: Cluster, name: str, *args: str) -> HsdpReplica:
    """``RANKS`` worker processes forming one replica: its own store (rank 0's), its own
    manager port, the cluster's quorum. Registered with ``cluster`` so they are killed
    after the test, even on failure."""
    launch = len(cluster.replicas)
    store_port, manager_port = free_port(), free_port()
    quorum = cluster.quorum_env(name)  # one shim per replica: its ranks share one manager
    ranks: list[Replica] = []
    for rank in range(RANKS):
        env = dict(os.environ)
        env.update(
            {
                ENV_REPLICA_ID: name,
                **quorum,
                ENV_MIN_REPLICAS: "1",
                ENV_MANAGER_PORT: str(manager_port),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(RANKS),
                "LOCAL_RANK": str(rank),
                "OMP_NUM_THREADS": "1",
                "RUST_LOG": "warn",
            }
        )
        progress = cluster.tmp / f"{name}-{launch}-rank{rank}.jsonl"
        log = cluster.tmp / f"{name}-{launch}-rank{rank}.log"
        cmd = [sys.executable, str(WORKER), "--progress", str(progress), *args]
        # Rank 0 leads a new process group in the test's session; the other ranks join it.
        group = 0 if rank == 0 else ranks[0].proc.pid
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=group
            )
        ranks.append(Replica(name, proc, progress, log))
        cluster.replicas.append(ranks[-1])
    return HsdpReplica(name, ranks)


def together(*replicas: HsdpReplica, steps: int, after_t: float = 0.0) -> bool:
    """Every rank of every replica committed ``steps`` steps with all replicas taking part."""
    n = len(replicas)
    return all(
        sum(1 for r in rank.committed() if r["participants"] == n and r["t"] >= after_t) >= steps
        for rep in replicas
        for rank in rep.ranks
    )


def attempts(rank: Replica) -> list[tuple[int, bool]]:
    return [(r["step"], r["committed"]) for r in rank.steps()]


def assert_consistent(rep: HsdpReplica) -> None:
    """Every rank of the replica made the same decision at every attempt (no half-stepped
    replica), no committed step is lost or redone (except where it healed to a peer's
    step), and every committed step's gradient is the whole step's."""
    first, *others = (attempts(r) for r in rep.ranks)
    for other in others:
        common = min(len(first), len(other))
        assert first[:common] == other[:common], (first, other)
    healed = {r["step"] for r in rep.events("healed")}
    for rank in rep.ranks:
        steps = [r["step"] for r in rank.committed()]
        for before, after in itertools.pairwise(steps):
            assert after == before + 1 or (after > before and after in healed), steps
        worst = max((r["grad_err"] for r in rank.committed()), default=0.0)
        assert worst < GRAD_TOL, f"{rep.name} rank gradient off by {worst}"


def digests(rep: HsdpReplica, after_t: float = 0.0) -> dict[int, str]:
    return {r["step"]: r["digest"] for r in rep.ranks[0].committed() if r["t"] >= after_t}


def test_hsdp_replica_killed_survivor_goes_on_and_joiner_heals_bitwise(cluster: Cluster) -> None:
    a = start_replica(cluster, "replica-0", *ARGS)
    b = start_replica(cluster, "replica-1", *ARGS)
    wait_for(lambda: together(a, b, steps=5), 90, "both HSDP replicas training together")

    killed_at = time.time()
    os.killpg(b.pgid, signal.SIGKILL)  # both its ranks, at whatever point of the step
    wait_for(
        lambda: all(
            sum(1 for r in rank.committed() if r["t"] > killed_at and r["participants"] == 1) >= 8
            for rank in a.ranks
        ),
        60,
        "the survivor training alone",
    )
    assert all(r.proc.poll() is None for r in a.ranks), a.tail()
    assert_consistent(a)
    figure("hsdp_kill_stall_s", max_gap(a.ranks[0].steps(), killed_at - 0.5))

    c = start_replica(cluster, "replica-1", *ARGS)
    joined = wait_for(lambda: c.events("healed"), 90, "the joiner to heal")[0]
    wait_for(lambda: together(a, c, steps=5, after_t=joined["t"]), 60, "the joiner training")
    assert_consistent(a)
    assert_consistent(c)
    # Bitwise: the gathered full parameters after every common step (each rank fetched its
    # own shards from the same rank of the survivor, then both summed the same shards).
    mine, theirs = digests(c), digests(a)
    common = sorted(set(mine) & set(theirs))
    assert len(common) >= 5, (mine, theirs)
    assert [mine[s] for s in common] == [theirs[s] for s in common]
    figure("hsdp_join_s", joined["t"] - c.ranks[0].started_at)


def test_hsdp_replica_frozen_mid_shard_reduction_discards_on_every_rank(
    cluster: Cluster,
) -> None:
    a = start_replica(cluster, "replica-0", *ARGS)
    b = start_replica(cluster, "replica-1", *ARGS, "--freeze-at-step", "6")
    frozen = wait_for(lambda: b.events("freezing"), 90, "the peer to freeze")[0]
    s = frozen["step"]
    wait_for(lambda: a.reached() >= s + 8, 60, "the survivor to go on")
    assert all(r.proc.poll() is None for r in a.ranks), a.tail()

    for rank in a.ranks:
        tried = [r for r in rank.steps() if r["step"] == s]
        discarded = [r for r in tried if not r["committed"]]
        redone = [r for r in tried if r["committed"]]
        assert discarded and len(redone) == 1, tried
        assert redone[0]["participants"] == 1
        # The redo consumes the same step's samples: all of them now, this replica alone.
        assert set(discarded[0]["samples"]) < set(redone[0]["samples"]), (discarded, redone)
    # Half the replica's shards crossed (rank 1 summed with the frozen peer's rank 1 before
    # it stopped), the other half did not: both ranks still discarded the step.
    first_try = [next(r for r in rank.steps() if r["step"] == s) for rank in a.ranks]
    assert [r["reduced"] for r in first_try] == [False, True], first_try
    assert_consistent(a)
    # The stall, from the survivor's last commit before the frozen step; a survivor whose
    # ranks started late (the peer trained alone meanwhile) joined at that very step by
    # healing from the peer, so its stall runs from the heal.
    rank0 = a.ranks[0]
    earlier = [r["t"] for r in rank0.committed() if r["step"] < s]
    before = max(earlier) if earlier else max(r["t"] for r in rank0.events("healed"))
    redone_t = next(r["t"] for r in rank0.committed() if r["step"] == s)
    figure("hsdp_freeze_stall_s", redone_t - before)
