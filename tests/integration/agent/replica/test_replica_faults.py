"""Replica mode under faults, with real torchft managers on the Redis quorum (a lighthouse
shim per replica): a peer killed, a joiner healing from a live peer, the run's Redis
restarted (AOF); a peer frozen mid all-reduce, then woken after it was dropped (refused
under its old id, it exits at once and its restart joins under a new one). torchft's own
lighthouse, kept for comparison: restarted mid-run.

Each test prints the figures it measures (``pytest -s ... | grep FIGURE``)."""

from __future__ import annotations

import itertools
import os
import signal
import time

import pytest
from replica_cluster import Cluster, Replica, figure, max_gap, wait_for

from spottrain.agent.quorum_shim.server import LighthouseShim
from spottrain.agent.replica.refusal import EXIT_REPLICA_GONE

pytestmark = pytest.mark.slow

GLOBAL = 32
ARGS = ("--steps", "100000", "--step-time", "0.03", "--global-batch", str(GLOBAL))


def together(*replicas: Replica, steps: int, after_t: float = 0.0) -> bool:
    """Every replica committed ``steps`` steps with all of them taking part."""
    n = len(replicas)
    return all(
        sum(1 for r in rep.committed() if r["participants"] == n and r["t"] >= after_t) >= steps
        for rep in replicas
    )


def assert_no_step_lost(rep: Replica) -> None:
    """The replica's committed steps only go up, one at a time, except where it healed from
    a peer that had gone on (it then resumes at the peer's step): no step is lost or redone
    after a commit."""
    steps = [r["step"] for r in rep.committed()]
    healed = {r["step"] for r in rep.events("healed")}
    for before, after in itertools.pairwise(steps):
        assert after == before + 1 or (after > before and after in healed), steps


def assert_quorum_ids_never_go_back(rep: Replica) -> None:
    ids = [r["quorum_id"] for r in rep.steps()]
    assert ids == sorted(ids), ids


def test_peer_killed_then_joiner_heals_bitwise_then_redis_restarted(cluster: Cluster) -> None:
    a = cluster.start("replica-0", *ARGS)
    b = cluster.start("replica-1", *ARGS)
    wait_for(lambda: together(a, b, steps=5), 90, "both replicas training together")

    killed_at = time.time()
    os.killpg(b.proc.pid, signal.SIGKILL)
    wait_for(
        lambda: (
            sum(1 for r in a.committed() if r["t"] > killed_at and r["participants"] == 1) >= 10
        ),
        60,
        "the survivor training alone",
    )
    assert a.proc.poll() is None, a.tail()
    assert_no_step_lost(a)
    figure("kill_stall_s", max_gap(a.steps(), killed_at - 0.5))

    c = cluster.start("replica-1", *ARGS)
    joined = wait_for(lambda: c.events("healed"), 90, "the joiner to heal")[0]
    wait_for(lambda: together(a, c, steps=5, after_t=joined["t"]), 60, "the joiner training")
    mine = {r["step"]: r["digest"] for r in c.committed()}
    theirs = {r["step"]: r["digest"] for r in a.committed()}
    common = sorted(set(mine) & set(theirs))
    assert len(common) >= 5
    # Bitwise: the same parameters after every common step (same members, same sums).
    assert [mine[s] for s in common] == [theirs[s] for s in common]
    assert_no_step_lost(a)
    # From the joiner's launch (Python and torch imports included) to its first step taken
    # part in, and to its heal (the live state fetched and loaded).
    figure("join_s", c.events("first-step")[0]["t"] - c.started_at)
    figure("join_heal_s", joined["t"] - c.started_at)

    # The run's Redis restarted (SIGTERM flushes its append-only file): training goes on
    # with both replicas, no step lost, no quorum id handed out again.
    assert cluster.redis is not None
    down_at = time.time()
    cluster.redis.restart()
    up_at = time.time()
    wait_for(lambda: together(a, c, steps=5, after_t=up_at), 60, "training after the restart")
    assert a.proc.poll() is None and c.proc.poll() is None, a.tail() + c.tail()
    for rep in (a, c):
        assert_no_step_lost(rep)
        assert_quorum_ids_never_go_back(rep)
    figure("redis_down_s", up_at - down_at)
    figure("redis_restart_stall_s", max_gap(a.steps(), down_at - 0.5))


@pytest.mark.parametrize("path", ["grads", "ddp"])
def test_peer_frozen_during_allreduce_discards_and_redoes_the_step(
    cluster: Cluster, path: str
) -> None:
    # "grads": the plain reduction of a model not wrapped in DDP (the path FSDP2/HSDP
    # shards take); "ddp": our comm hook inside DDP's backward.
    extra = ("--ddp",) if path == "ddp" else ()
    a = cluster.start("replica-0", *ARGS, *extra)
    b = cluster.start("replica-1", *ARGS, *extra, "--freeze-after-steps", "8")
    frozen = wait_for(lambda: b.events("freezing"), 90, "the peer to freeze")[0]
    s = frozen["step"]
    wait_for(lambda: a.reached() >= s + 10, 60, "the survivor to go on")
    assert a.proc.poll() is None, a.tail()  # torchft's own DDP hook crashes here

    attempts = [r for r in a.steps() if r["step"] == s]
    discarded = [r for r in attempts if not r["committed"]]
    redone = [r for r in attempts if r["committed"]]
    assert discarded and len(redone) == 1, attempts
    assert discarded[0]["discarded"] >= 1 and redone[0]["participants"] == 1
    # The redo consumes the same step's samples: all of them now, the survivor alone.
    step_samples = list(range(s * GLOBAL, (s + 1) * GLOBAL))
    assert redone[0]["samples"] == step_samples
    assert set(discarded[0]["samples"]) < set(step_samples)
    assert_no_step_lost(a)
    before = max(r["t"] for r in a.committed() if r["step"] == s - 1)
    figure(f"freeze_stall_s[{path}]", redone[0]["t"] - before)
    if path == "ddp":
        return
    # Woken long after Redis dropped it: its manager is refused under its old id, and its
    # worker exits at once for torchrun to restart (torchft alone would retry the refused
    # quorum for its 120 s quorum timeout); the survivor never trains with the old id again
    # (no split brain: the quorum holds one member until the restart joins).
    shim = b.shim
    assert shim is not None and a.shim is not None
    woken_at = time.time()
    os.killpg(b.proc.pid, signal.SIGCONT)
    (old_id,) = wait_for(lambda: set(shim.refused), 30, "the woken replica to be refused")
    # The guard: well inside the 120 s quorum timeout (a guard, not a speed check).
    wait_for(lambda: b.proc.poll() is not None, 60, "the refused worker to exit")
    assert b.proc.returncode == EXIT_REPLICA_GONE, b.tail()
    assert f"replica {old_id} was refused by the quorum" in b.tail()
    # It may still finish the step it froze in (with the collective the survivor set
    # aside), never a later one.
    assert all(r["step"] == s for r in b.committed() if r["t"] > woken_at), b.committed()[-3:]
    assert all(r["participants"] == 1 for r in a.committed() if r["t"] > woken_at)
    assert old_id not in _roster_ids(shim)

    # torchrun's restart, on the same VM (the same shim): a new manager id joins, heals
    # from the survivor and trains with it.
    restarted_at = time.time()
    c = cluster.start("replica-1", *ARGS, *extra, shim=shim)
    healed = wait_for(lambda: c.events("healed"), 90, "the restarted replica to heal")[0]
    wait_for(lambda: together(a, c, steps=3, after_t=healed["t"]), 60, "both training again")
    (new_id,) = [i for i in _roster_ids(shim) if i.startswith("replica-1:")]
    assert new_id != old_id and old_id.startswith("replica-1:")
    assert shim.refused_why(new_id) is None and shim.refused_why(old_id)
    # The order: refused, exited, restarted, trained together, never under the old id.
    first_together = min(
        r["t"] for r in a.committed() if r["participants"] == 2 and r["t"] > restarted_at
    )
    assert woken_at < restarted_at < first_together
    assert a.proc.poll() is None and c.proc.poll() is None, a.tail() + c.tail()
    assert_no_step_lost(a)
    assert_quorum_ids_never_go_back(a)
    figure("refused_to_exit_s", restarted_at - woken_at)


def _roster_ids(shim: LighthouseShim) -> list[str]:
    """The replica ids of the quorum Redis holds now."""
    return [m.replica_id for m in shim.control.roster().members]


def test_lighthouse_restarted_mid_run(lighthouse_cluster: Cluster) -> None:
    cluster = lighthouse_cluster
    assert cluster.lighthouse is not None
    a = cluster.start("replica-0", *ARGS)
    b = cluster.start("replica-1", *ARGS)
    wait_for(lambda: together(a, b, steps=5), 90, "both replicas training together")

    down_at = time.time()
    cluster.lighthouse.kill()
    cluster.lighthouse.start()  # the same port, a fresh in-memory state (quorum ids from 1)
    up_at = time.time()
    wait_for(lambda: together(a, b, steps=10, after_t=up_at), 90, "training after the restart")
    assert a.proc.poll() is None and b.proc.poll() is None, a.tail() + b.tail()
    for rep in (a, b):
        assert_no_step_lost(rep)
    mine = {r["step"]: r["digest"] for r in a.committed() if r["t"] > up_at}
    theirs = {r["step"]: r["digest"] for r in b.committed() if r["t"] > up_at}
    common = sorted(set(mine) & set(theirs))
    assert common and [mine[s] for s in common] == [theirs[s] for s in common]
    figure("lighthouse_down_s", up_at - down_at)
    figure("lighthouse_restart_stall_s", max_gap(a.steps(), down_at - 0.5))
