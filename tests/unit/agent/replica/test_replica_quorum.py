"""A quorum is its id and its members; the watchdog's reading of the lighthouse's page and
of the Redis quorum."""

from __future__ import annotations

from spottrain.agent.replica.quorum import QuorumView, membership_digest, salted_store
from spottrain.agent.replica.watchdog import Watchdog, heartbeat_ages, lost_peers, redis_ages

# The heartbeat list of torchft 0.2.0's lighthouse status page, as served.
PAGE = """
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat
  ">
    replica-0:bd07e2c6-af18-4cde-afab-39cb53a021d6: seen 0.003372199s ago
  </li>
  <li class="heartbeat
  ">
    replica-1:0c1e0000-af18-4cde-afab-39cb53a021d6: seen 2.5s ago
  </li>
  <li class="heartbeat">replica-2:x: seen 12.5ms ago</li>
</ul>
"""


def view(ids: tuple[str, ...], *, participants: int = 2, failures: int = 0) -> QuorumView:
    return QuorumView(
        quorum_id=1,
        replica_ids=ids,
        replica_rank=0,
        replica_world_size=len(ids),
        participant_rank=0,
        participants=participants,
        heal=False,
        max_step=9,
        commit_failures=failures,
    )


def test_the_members_digest_ignores_their_order() -> None:
    assert membership_digest(["a:1", "b:2"]) == membership_digest(["b:2", "a:1"])
    assert membership_digest(["a:1", "b:2"]) != membership_digest(["a:1", "b:3"])


def test_the_store_prefix_names_members_and_the_step_the_quorum_formed_at() -> None:
    v = view(("a:1", "b:2"))
    assert salted_store("h:1/torchft/1/0", v.salt).startswith("h:1/torchft/1/0/m")
    assert v.salt != view(("a:1", "b:3")).salt


def test_a_quorum_with_someone_behind_or_a_discarded_step_is_unsettled() -> None:
    assert not view(("a:1", "b:2")).unsettled
    assert view(("a:1", "b:2"), participants=1).unsettled
    assert view(("a:1", "b:2"), failures=1).unsettled


def test_heartbeat_ages_are_read_from_the_status_page() -> None:
    ages = heartbeat_ages(PAGE)
    assert ages["replica-0:bd07e2c6-af18-4cde-afab-39cb53a021d6"] < 0.01
    assert ages["replica-1:0c1e0000-af18-4cde-afab-39cb53a021d6"] == 2.5
    assert ages["replica-2:x"] == 0.0125


def test_a_peer_is_lost_when_its_heartbeat_is_old_or_missing() -> None:
    ages = {"me:1": 5.0, "p:2": 0.2, "q:3": 1.5}
    assert lost_peers(("me:1", "p:2", "q:3", "r:4"), "me:1", ages, 1.0) == ["q:3", "r:4"]


def test_with_the_redis_quorum_the_watchdog_reads_redis_and_its_own_drop() -> None:
    """Ages come from the quorum client (None: no heartbeat, or gone); a replica that finds
    itself dropped mid-collective aborts its own group (woken after a freeze)."""
    import threading

    class Client:
        def __init__(self) -> None:
            self.ages: dict[str, float | None] = {"me:1": 0.1, "p:2": 0.2}

        def heartbeat_ages(self, ids: list[str]) -> dict[str, float | None]:
            return {i: self.ages.get(i) for i in ids}

    class Group:
        def __init__(self) -> None:
            self.aborted = threading.Event()

        def abort_now(self) -> None:
            self.aborted.set()

    class Recorder:
        configured_digest: str | None = "x"

    client, group = Client(), Group()
    read = redis_ages(client)
    assert read(("me:1", "p:2", "q:3")) == {"me:1": 0.1, "p:2": 0.2}
    dog = Watchdog(read, group, Recorder(), poll_s=0.01)
    try:
        assert dog.check_self
        dog.me = "me:1"
        dog.watch(view(("me:1", "p:2")))
        wake = threading.Event()
        dog.enter(wake)
        client.ages["me:1"] = None  # the quorum dropped this replica while it was frozen
        assert wake.wait(10) and group.aborted.wait(10) and dog.lost_during(wake)
    finally:
        dog.stop()
