"""The Redis quorum's basic path: three replicas form a quorum, the next step takes the fast
path under the same id, and the roster travels only when the membership changes."""

from __future__ import annotations

import json

import redis

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts


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
    redis_client.set(run_keys.quorum_key("roster"), json.dumps({"version": -7, "members": []}))
    second = fleet.round({rid: 1 for rid in ids})
    assert {a.quorum_id for a in second.values()} == {qid}
    assert {a.max_step for a in second.values()} == {1}
    assert fleet.client.roster().version == -7  # not rewritten: nothing changed
    status = fleet.client.status()
    assert (status.qid, status.members, status.heartbeating) == (qid, 3, 3)
    assert status.epoch == first["r-a"].epoch


def test_answer_line_round_trip() -> None:
    line = "12 1 4 100 0 9 2 deadbeef r:x=97 r-y=98"
    a = scripts.parse_answer(line)
    assert (a.quorum_id, a.replica_rank, a.replica_count, a.max_step) == (12, 1, 4, 100)
    assert (a.heal_from, a.roster_version, a.commit_failures, a.epoch) == (0, 9, 2, "deadbeef")
    assert a.behind == {"r:x": 97, "r-y": 98}
    assert scripts.parse_answer("3 0 1 5 -1 3 0 ab").heal_from is None
    assert scripts.split_reply(b"tok " + line.encode()) == ("tok", line)
