"""Quorum relays under torchft's real managers: two replicas in one relay group train
through the relay (the member's requests travel to the relay's shim, which batches them
into one Redis call); the relay's shim stops mid-run and the survivor's requests go to
Redis directly, then it takes the lease and relays its own."""

from __future__ import annotations

import pytest
from replica_cluster import Cluster, wait_for

from spottrain.agent.quorum_shim.member import RelayedQuorum

pytestmark = pytest.mark.slow

ARGS = ("--steps", "100000", "--step-time", "0.03")


def test_replicas_train_through_a_relay_and_outlive_it(cluster: Cluster) -> None:
    cluster.relay_group = 2
    a = cluster.start("replica-0", *ARGS)
    b = cluster.start("replica-1", *ARGS)
    wait_for(lambda: a.reached() >= 10 and b.reached() >= 10, 90, "both replicas to train")
    assert {r["participants"] for r in b.committed()[-3:]} == {2}
    relays = [r.shim.blocking for r in (a, b) if r.shim is not None]
    assert all(isinstance(q, RelayedQuorum) for q in relays) and len(relays) == 2
    holder, member = sorted(relays, key=lambda q: not q.holding)
    assert holder.holding and not member.holding
    # A step's quorum may go direct before the lease is taken: wait for ten relayed rounds.
    wait_for(
        lambda: (
            member.relayed >= 10 and holder.batcher.batches >= 10 and holder.batcher.items >= 20
        ),
        60,
        "ten rounds through the relay",
    )
    assert member.fallbacks == 0

    survivor = b if member is b.shim.blocking else a  # type: ignore[union-attr]
    holder.stop()  # the relay's server and lease go (its own manager keeps its shim)
    done = survivor.reached()
    wait_for(lambda: survivor.reached() >= done + 10, 60, "the survivor to train on")
    assert member.fallbacks >= 1
    wait_for(lambda: member.holding, 10, "the survivor to take the lease")
    relayed = member.relayed
    wait_for(lambda: member.relayed > relayed, 10, "the survivor to relay its own requests")
