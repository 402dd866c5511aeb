"""The Redis quorum's rules, each against a real Redis with replicas on threads: the join
timeout, min_replicas and the split-brain guard, leave and silent loss, when the quorum id
changes, healing as torchft computes it, and idempotent retries."""

from __future__ import annotations

import dataclasses

import pytest
import redis
from quorum_harness import FAST, wait_until

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.errors import QuorumGone, QuorumTimeout


def _req_len(r: redis.Redis, keys: RunKeys) -> int:
    return int(r.hlen(keys.quorum_key("req")))


def test_join_timeout_min_replicas_and_split_brain(make_fleet, run_keys, redis_client) -> None:
    fleet = make_fleet(dataclasses.replace(FAST, min_replicas=2))
    fleet.add("a", "b", "c", "d", "e")
    # min_replicas: one alone never forms, however long it waits.
    with pytest.raises(QuorumTimeout):
        fleet.ask("a", 0, timeout=1.0).result(30)
    # Split brain: 2 of 5 heartbeating is not more than half, even past the join timeout.
    for f in [fleet.ask("a", 0, timeout=1.0), fleet.ask("b", 0, timeout=1.0)]:
        with pytest.raises(QuorumTimeout):
            f.result(30)
    assert _req_len(redis_client, run_keys) == 0  # given up: withdrawn
    # 3 of 5 is: the round forms on the join timeout (d, e heartbeat but never asked).
    first = fleet.round({"a": 0, "b": 0, "c": 0})
    assert {x.replica_count for x in first.values()} == {3}
    # A newcomer waits (alone it is no majority) until the members come back: the fast path
    # then takes everyone asking, the newcomer included, under a new id.
    late = fleet.ask("d", 0)
    wait_until(lambda: _req_len(redis_client, run_keys) == 1, what="d's request")
    second = fleet.round({"a": 1, "b": 1, "c": 1})
    second["d"] = late.result(30)
    assert {x.replica_count for x in second.values()} == {4}
    assert {x.quorum_id for x in second.values()} == {first["a"].quorum_id + 1}
    assert second["d"].behind == {"d": 0} and second["d"].heal_from == 0


def test_leave_forms_the_waiting_round_at_once(make_fleet) -> None:
    # Timeouts far beyond the test's deadlines: only the leave can let the round form.
    fleet = make_fleet(
        dataclasses.replace(FAST, heartbeat_timeout_ms=60_000, join_timeout_ms=60_000)
    )
    fleet.add("a", "b", "c")
    qid = fleet.round({"a": 0, "b": 0, "c": 0})["a"].quorum_id
    waiting = [fleet.ask("a", 1), fleet.ask("b", 1)]
    fleet.client.leave("c")
    answers = [f.result(30) for f in waiting]
    assert [(x.replica_rank, x.replica_count) for x in answers] == [(0, 2), (1, 2)]
    assert {x.quorum_id for x in answers} == {qid + 1}
    assert fleet.client.heartbeat(["c"]) == ["c"]
    with pytest.raises(QuorumGone):
        fleet.client.request("c", 1, timeout=5)


def test_silent_loss_is_dropped_after_the_heartbeat_timeout(make_fleet) -> None:
    # The join timeout is out of reach: the round can only form once c is dropped.
    fleet = make_fleet(dataclasses.replace(FAST, join_timeout_ms=60_000))
    fleet.add("a", "b", "c")
    qid = fleet.round({"a": 0, "b": 0, "c": 0})["a"].quorum_id
    fleet.hb.paused.add("c")  # c stops heartbeating and never asks again
    answers = fleet.round({"a": 1, "b": 1})
    assert {x.quorum_id for x in answers.values()} == {qid + 1}
    assert {x.replica_count for x in answers.values()} == {2}
    assert fleet.client.heartbeat_ages(["a", "c"])["c"] is None
    assert fleet.client.heartbeat(["c"]) == ["c"]


def test_quorum_id_changes_only_with_membership_or_commit_failures(
    make_fleet, run_keys, redis_client
) -> None:
    fleet = make_fleet()
    fleet.add("a", "b", "c")
    seen = []

    def step(steps: dict[str, int], first: str = "", **failures: int) -> int:
        if first:  # a newcomer asks first, else the members' fast path may leave it out
            early = fleet.ask(first, steps.pop(first))
            wait_until(lambda: _req_len(redis_client, run_keys) == 1, what="the first request")
        futures = {
            rid: fleet.ask(rid, s, commit_failures=failures.get(rid, 0)) for rid, s in steps.items()
        }
        if first:
            futures[first] = early
        ids = {f.result(30).quorum_id for f in futures.values()}
        assert len(ids) == 1
        seen.append(ids.pop())
        return seen[-1]

    q1 = step({"a": 0, "b": 0, "c": 0})
    assert step({"a": 1, "b": 1, "c": 1}) == q1
    assert step({"a": 2, "b": 2, "c": 2}, b=1) == q1 + 1  # a commit failed somewhere
    assert step({"a": 3, "b": 3, "c": 3}) == q1 + 1
    fleet.client.leave("c")
    assert step({"a": 4, "b": 4}) == q1 + 2
    fleet.add("d")
    assert step({"a": 5, "b": 5, "d": 0}, first="d") == q1 + 3
    assert step({"a": 6, "b": 6, "d": 6}) == q1 + 3
    assert seen == sorted(seen)
    assert fleet.client.roster().version == q1 + 3


def _torchft_heal(steps: list[int]) -> list[int | None]:
    """torchft's compute_quorum_results (src/manager.rs) for group rank 0, init_sync off:
    participants sorted by id; the i-th one behind max_step recovers from
    up_to_date[i % len(up_to_date)]."""
    max_step = max(steps)
    up = [r for r, s in enumerate(steps) if s == max_step]
    behind = [r for r, s in enumerate(steps) if s != max_step]
    heal: list[int | None] = [None] * len(steps)
    for i, rank in enumerate(behind):
        heal[rank] = up[i % len(up)]
    return heal


def test_behind_and_heal_from_match_torchft(make_fleet) -> None:
    fleet = make_fleet()
    ids = ["r0", "r1", "r2", "r3", "r4"]
    fleet.add(*ids)
    fleet.round({rid: 0 for rid in ids})
    steps = {"r0": 7, "r1": 5, "r2": 7, "r3": 2, "r4": 6}  # diverged inside one quorum
    answers = fleet.round(steps)
    expected = _torchft_heal([steps[rid] for rid in ids])
    assert [answers[rid].heal_from for rid in ids] == expected == [None, 0, None, 2, 0]
    behind = {"r1": 5, "r3": 2, "r4": 6}
    assert all(a.behind == behind and a.max_step == 7 for a in answers.values())
    assert list(answers["r0"].behind) == ["r1", "r3", "r4"]  # rank order


def test_request_retries_are_idempotent(make_fleet, run_keys, redis_client) -> None:
    fleet = make_fleet(dataclasses.replace(FAST, join_timeout_ms=60_000))
    fleet.add("a", "b", "c")
    fleet.round({"a": 0, "b": 0, "c": 0})
    request = redis_client.register_script(scripts.REQUEST)
    keys = scripts.script_keys(run_keys)
    config = scripts.config_args(run_keys, fleet.config, "e0")

    def send(rid: str, step: int, token: str) -> int:
        args = scripts.request_args(rid, step, 0, 0, False, token)
        return int(request(keys=keys, args=[*config, *args]))

    # The same request three times counts once: the fast path still waits for b and c.
    for _ in range(3):
        send("a", 1, "t1")
    state = run_keys.quorum_key("state")
    assert redis_client.hget(state, "joined_prev") == b"1"
    send("b", 1, "t2")
    send("c", 1, "t3")  # the round forms here
    assert _req_len(redis_client, run_keys) == 0
    # A retry after its round formed finds its answer waiting and does not ask again.
    send("c", 1, "t3")
    assert _req_len(redis_client, run_keys) == 0
    token, line = scripts.split_reply(redis_client.lindex(scripts.reply_key(run_keys, "c"), 0))
    assert token == "t3" and scripts.parse_answer(line).replica_count == 3
    # A new request replaces answers to requests given up on.
    send("c", 2, "t4")
    assert redis_client.llen(scripts.reply_key(run_keys, "c")) == 0


def test_shrink_only_leaves_newcomers_for_the_next_round(make_fleet, run_keys, redis_client):
    fleet = make_fleet()
    fleet.add("a", "b", "c")
    first = fleet.round({"a": 0, "b": 0})
    newcomer = fleet.ask("c", 0)
    wait_until(lambda: _req_len(redis_client, run_keys) == 1, what="c's request")
    shrunk = {r: fleet.ask(r, 1, shrink_only=r == "a") for r in "ab"}
    answers = {r: f.result(30) for r, f in shrunk.items()}
    assert {(x.quorum_id, x.replica_count) for x in answers.values()} == {(first["a"].quorum_id, 2)}
    assert not newcomer.done() and _req_len(redis_client, run_keys) == 1  # c waits on
    grown = fleet.round({"a": 2, "b": 2})
    assert newcomer.result(30).replica_count == grown["a"].replica_count == 3
    assert grown["a"].quorum_id == first["a"].quorum_id + 1
