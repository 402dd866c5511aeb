"""The Redis quorum's basic path: three replicas form a quorum, the next step takes the fast
path under the same id, and the roster travels only when the membership changes."""

from __future__ import annotations

import json

import pytest
import redis
from quorum_harness import wait_until

from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumCorrupt


def test_three_replicas_form_then_fast_path(
    make_fleet, run_keys: RunKeys, redis_client: redis.Redis
) -> None:
    fleet = make_fleet()
    ids = ["r-c", "r-a", "r:b"]  # bytes order: r-a, r-c, r:b
    fleet.add(*ids)
    first = fleet.round({rid: 0 for rid in ids})
    order = sorted(ids)
    assert [first[rid].replica_rank for rid in order] == [0, 1, 2]
    assert {a.replica_count for a in first.values()} == {3}
    qid = first["r-a"].quorum_id
    assert qid >= 1 and {a.quorum_id for a in first.values()} == {qid}
    assert {a.roster_version for a in first.values()} == {qid}
    assert all(a.heal_from is None and a.behind == {} for a in first.values())
    roster = fleet.client.roster()
    assert roster.version == qid
    assert [m.replica_id for m in roster.members] == order
    assert roster.members[0].address == "http://r-a" and roster.members[0].store_address == "r-a:1"

    # The next step: same members, so the fast path keeps the id and the roster untouched.
    poison = json.dumps({"version": -7, "members": []})
    redis_client.set(run_keys.quorum_key("roster"), poison)
    second = fleet.round({rid: 1 for rid in ids})
    assert {a.quorum_id for a in second.values()} == {qid}
    assert {a.max_step for a in second.values()} == {1}
    assert redis_client.get(run_keys.quorum_key("roster")) == poison.encode()  # not rewritten
    assert fleet.client.roster() == roster  # cached: nothing changed, nothing read
    status = fleet.client.status()
    assert (status.qid, status.members, status.heartbeating) == (qid, 3, 3)
    assert status.epoch == first["r-a"].epoch


def test_cached_roster_follows_changes_by_deltas(make_fleet, run_keys, redis_client) -> None:
    fleet = make_fleet()
    fleet.add("a", "b", "c")
    fleet.round({"a": 0, "b": 0, "c": 0})
    assert [m.replica_id for m in fleet.client.roster().members] == ["a", "b", "c"]
    fleet.client.leave("b")
    fleet.round({"a": 1, "c": 1})
    fleet.add("d", "b2")
    early = fleet.ask("d", 0)  # newcomers ask first, so the members' fast path takes them
    late = fleet.ask("b2", 0)
    wait_until(lambda: redis_client.hlen(run_keys.quorum_key("req")) == 2, what="requests")
    answers = fleet.round({"a": 2, "c": 2})
    assert early.result(30).roster_version == late.result(30).roster_version
    version = answers["a"].roster_version
    # A cached roster is brought up to date from the deltas alone: the whole roster is not
    # read (it is spoiled here), while a client without a cache must read it.
    redis_client.set(run_keys.quorum_key("roster"), "{spoiled")
    roster = fleet.client.roster()
    assert roster.version == version
    assert [m.replica_id for m in roster.members] == ["a", "b2", "c", "d"]
    assert roster.members[1].address == "http://b2"
    with pytest.raises(QuorumCorrupt, match="roster"):
        QuorumClient(redis_client, run_keys, fleet.config).roster()
