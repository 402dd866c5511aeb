"""Who holds the state, and what a leaver decides from it (the Lua's rule, in Python)."""

from __future__ import annotations

import json

from spottrain.agent.replica.holders import (
    HolderRow,
    drain_requested,
    must_save_on_leave,
    other_live_holders,
    parse_row,
)

NOW = 1_000_000.0


def row(state: str, at: float) -> str:
    return HolderRow(state=state, step=7, at=at).to_json()


def test_only_fresh_live_rows_of_others_count() -> None:
    rows = {
        "replica-0": row("live", NOW),  # me
        "replica-1": row("live", NOW - 1),
        "replica-2": row("leaving", NOW),
        "replica-3": row("live", NOW - 60),  # died without leaving
        "replica-4": "not json",
    }
    assert other_live_holders(rows, "replica-0", NOW, stale_s=10) == 1


def test_the_last_holder_saves_and_one_with_a_live_peer_does_not() -> None:
    assert must_save_on_leave(0) is True
    assert must_save_on_leave(1) is False


def test_two_leavers_at_once_leave_one_to_save() -> None:
    # Each marks itself leaving before counting, so the second sees no live peer.
    rows = {"replica-0": row("live", NOW), "replica-1": row("live", NOW)}
    rows["replica-0"] = row("leaving", NOW)
    first = other_live_holders(rows, "replica-0", NOW)
    rows["replica-1"] = row("leaving", NOW)
    second = other_live_holders(rows, "replica-1", NOW)
    assert (must_save_on_leave(first), must_save_on_leave(second)) == (False, True)


def test_a_row_round_trips_in_the_common_format() -> None:
    body = json.loads(HolderRow(step=3, quorum_id=2, participants=2, discarded=1, at=5).to_json())
    assert set(body) == {
        "state",
        "step",
        "quorum_id",
        "participants",
        "discarded",
        "at",
        "longest_gap_s",
        "longest_gap_step",
    }
    assert parse_row(json.dumps(body)) == HolderRow("live", 3, 2, 2, 1, 5.0)
    assert parse_row("{}") is None


def test_drain_requests_made_before_the_worker_started_or_expired_are_ignored() -> None:
    def req(**kw: object) -> str:
        return json.dumps({"id": 1, "drain": True, "at": NOW, **kw})

    assert drain_requested(req(), NOW + 1, started_at=NOW - 5)
    assert not drain_requested(req(), NOW + 1, started_at=NOW + 0.5)
    assert not drain_requested(req(deadline=NOW), NOW + 1, started_at=NOW - 5)
    assert not drain_requested(req(drain=False), NOW + 1, started_at=NOW - 5)
    assert not drain_requested(None, NOW, started_at=NOW)
    assert not drain_requested("garbage", NOW, started_at=NOW)
