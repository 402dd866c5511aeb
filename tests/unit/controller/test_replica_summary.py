"""A replica run's figures (summary and report) from the rows and events its writers leave:
pure functions, no Redis."""

from __future__ import annotations

import json
from dataclasses import asdict

from spottrain.controller.reconcile.summary import (
    Summary,
    replica_figures,
    replica_lines,
    summary_record,
)
from spottrain.controller.report.model import Preemption, StepPoint
from spottrain.controller.report.replica import replica_report, replica_text
from spottrain.controller.run.replica_view import format_replicas, replica_rows


def _row(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_no_holder_rows_is_an_elastic_run() -> None:
    assert replica_figures({}) is None


def test_figures_sum_the_discarded_attempts_and_take_the_longest_pause_of_any_replica() -> None:
    rows = {
        b"replica-0": _row(
            state="live",
            step=300,
            quorum_id=7,
            discarded=1,
            longest_gap_s=0.4,
            longest_gap_step=9,
            at=1000.0,
        ),
        b"replica-10": _row(state="live", step=300, quorum_id=8, discarded=0, at=1001.0),
        # Killed without leaving: its last row stays "live" but stops moving; its discards
        # and its pause count.
        b"replica-2": _row(
            state="live",
            step=120,
            quorum_id=4,
            discarded=2,
            longest_gap_s=1.3,
            longest_gap_step=7,
            at=900.0,
        ),
        b"replica-1": _row(state="leaving", step=90, quorum_id=3, discarded=0, at=880.0),
        b"replica-9": b"{half a row",
    }
    f = replica_figures(rows)
    assert f is not None
    assert f.replicas == 4 and f.live == 2 and f.quorum_id == 8
    assert list(f.discarded) == ["replica-0", "replica-1", "replica-2", "replica-10"]
    assert f.discarded_total == 3
    assert (f.longest_pause_s, f.longest_pause_step) == (1.3, 7)
    lines = replica_lines(f)
    assert lines[0] == "  discarded attempts     3 (replica-0 1, replica-2 2)"
    assert lines[1] == "  longest pause          1.30 s (at step 7)"
    assert lines[2] == "  replicas               4 (2 live), quorum id 8"


def test_a_pause_nobody_reports_says_so_rather_than_zero() -> None:
    f = replica_figures({"replica-0": _row(state="live", step=5, quorum_id=1, discarded=0)})
    assert f is not None and f.longest_pause_s is None
    assert replica_lines(f)[1] == "  longest pause          not reported by the replicas"


def _ev(at: float, type_: str, node: str, **fields: object) -> tuple[float, dict[str, str]]:
    row = {"type": type_, "node": node, "at": str(at)}
    return at, {**row, **{k: str(v) for k, v in fields.items()}}


def test_report_lists_each_membership_event_with_the_rate_around_it() -> None:
    rows = [
        _ev(1, "replica-slot", "n0", slot="replica-0"),
        _ev(1, "replica-slot", "n1", slot="replica-1"),
        _ev(2, "state", "n0", state="joined"),
        _ev(2, "state", "n1", state="joined"),
        _ev(10, "progress", "n0", step=5, world_size=2, round=1),
        _ev(40, "notice", "n1", kind="sigterm"),
        _ev(41, "progress", "n0", step=150, world_size=1, round=2),
        _ev(50, "replica-slot", "n2", slot="replica-1"),
        _ev(55, "state", "n2", state="joined"),
        _ev(60, "progress", "n0", step=210, world_size=2, round=3),
    ]
    # Two replicas report nearly the same step a moment apart: no rate from that pair.
    steps = [
        StepPoint(10, 5, "progress"),
        StepPoint(30, 105, "progress"),
        StepPoint(39, 150, "progress"),
        StepPoint(41, 151, "progress"),
        StepPoint(41.5, 153, "progress"),
        StepPoint(60, 210, "progress"),
    ]
    pre = [Preemption(45, "n1", "local-a", notice_at=40)]
    summary = {"replica": {"replicas": 2, "quorum_id": 3, "discarded": {"replica-0": 1}}}
    r = replica_report(rows, summary, steps, pre)
    assert r is not None
    assert (r.replicas, r.most_taking_part, r.quorum_id, r.discarded) == (2, 2, 3, 1)
    # The initial joins (before training started) are not events; the backfill's is.
    assert [(e.at, e.kind, e.node, e.taking_part) for e in r.events] == [
        (40, "left on notice", "n1", 1),
        (55, "joined", "n2", 2),
    ]
    leave = r.events[0]
    # Before: 105 -> 150 over 30..39 s (300/min); after: 151 -> 210 over 41..60 s.
    assert leave.rate_before == 300.0
    assert leave.rate_after is not None and round(leave.rate_after) == 186
    text = replica_text(r, 0.0, lambda s: f"{s:.0f}s")
    assert text[0] == "  replicas      2 slot(s) used, 2 taking part at most, quorum id 3"
    assert "longest pause of the survivors not reported" in text[1]
    assert text[2] == (
        "  +40s      n1 left on notice: step rate 300/min before, 186/min after, "
        "1 replica(s) taking part after"
    )


def test_an_elastic_run_has_no_replica_report() -> None:
    rows = [_ev(10, "progress", "n0", step=5, world_size=2, round=1)]
    assert replica_report(rows, {"replica": None}, [], []) is None


def test_status_ends_with_the_newest_quorum_the_discarded_attempts_and_the_longest_pause() -> None:
    rows = replica_rows(
        {},
        {
            "replica-0": _row(state="live", step=9, quorum_id=4, discarded=1, longest_gap_s=0.31),
            "replica-1": _row(state="live", step=9, quorum_id=5, discarded=2, longest_gap_s=1.2),
        },
    )
    assert format_replicas(rows, "h:1", True, now=0.0)[-1] == (
        "newest quorum 5; discarded attempts 3; longest pause 1.20 s"
    )
    assert format_replicas([], "h:1", True, now=0.0) == [
        "lighthouse h:1 up",
        "replicas: 0 (0 live)",
    ]


def test_the_record_of_an_elastic_run_is_its_summary_as_it_was() -> None:
    s = Summary("running", 5, 0.5, 2, {"n0": "joined"}, 0, 0, 1.0, 2.0, "ok")
    assert summary_record(s, None) == asdict(s)
    f = replica_figures({"replica-0": _row(state="live", discarded=2, longest_gap_s=0.5, at=1.0)})
    record = summary_record(s, f)
    assert record["replica"]["discarded_total"] == 2
    assert record["replica"]["longest_pause_s"] == 0.5
    assert {k: v for k, v in record.items() if k != "replica"} == asdict(s)


def test_status_does_not_count_a_replica_killed_without_leaving_as_live() -> None:
    rows = replica_rows(
        {},
        {
            "replica-0": _row(state="live", step=268, quorum_id=7, at=100.0),
            "replica-2": _row(state="live", step=184, quorum_id=5, at=74.0),
        },
    )
    assert format_replicas(rows, "h:1", True, now=100.5)[1] == "replicas: 2 (1 live)"
