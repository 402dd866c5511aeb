"""A replica run's part of the report: its replicas, the quorum id, the discarded attempts,
the survivors' longest pause, and the step rate just before and just after each membership
event (a replica that left on a notice, one killed without notice, a backfill that joined).

Where it comes from: the replica figures of the run's summary (the holder rows each
replica's rank 0 writes), the SDK's ``progress`` events (``world_size`` is the number of
replicas taking part in the step, ``round`` the quorum id; one is written at every change
of the participants and at least once a minute), the agents' ``replica-slot`` and ``state``
events and the controller's ``preempted`` events. The rate around an event is the slope of
the step timeline over at least ``MIN_SPAN_S`` on each side of it, between the points the
run recorded: its resolution is their spacing (a change of the participants always adds
one shortly after the event; otherwise one a minute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spottrain.controller.report.model import Preemption, StepPoint
from spottrain.controller.report.timelines import _int, _unquote
from spottrain.protocol.states import TRAINING


@dataclass(frozen=True)
class ReplicaEvent:
    """One membership event: ``kind`` is ``left on notice``, ``killed`` or ``joined``;
    ``taking_part`` the replicas in the first step reported after it; the rates are steps
    per minute over the segments before and after it (None where none is known)."""

    at: float
    kind: str
    node: str
    taking_part: int | None
    rate_before: float | None
    rate_after: float | None


@dataclass(frozen=True)
class ReplicaReport:
    """``replicas``: replicas that ever held a slot; ``most_taking_part``: the most replicas
    in one step; ``quorum_id``: the newest; the rest as in the summary's replica figures."""

    replicas: int
    most_taking_part: int
    quorum_id: int | None
    discarded: int
    longest_pause_s: float | None
    longest_pause_step: int | None
    events: list[ReplicaEvent]


# Points closer than this are not a rate: two replicas report the same step a moment apart.
MIN_SPAN_S = 5.0


def _slope(a: StepPoint, b: StepPoint) -> float | None:
    return (b.step - a.step) * 60.0 / (b.at - a.at) if b.at > a.at else None


def _rates_around(points: Sequence[StepPoint], at: float) -> tuple[float | None, float | None]:
    """Steps per minute just before ``at`` (from the last step point before it back over at
    least ``MIN_SPAN_S``) and just after (from the first point after it, forward as far)."""
    before_pts = [p for p in points if p.at <= at]
    after_pts = [p for p in points if p.at >= at]
    before = after = None
    if before_pts:
        b = before_pts[-1]
        a = next((p for p in reversed(before_pts) if p.at <= b.at - MIN_SPAN_S), None)
        before = _slope(a, b) if a is not None else None
    if after_pts:
        c = after_pts[0]
        d = next((p for p in after_pts if p.at >= c.at + MIN_SPAN_S), None)
        after = _slope(c, d) if d is not None else None
    return before, after


def _membership(
    rows: Sequence[tuple[float, dict[str, str]]], preemptions: Sequence[Preemption]
) -> list[tuple[float, str, str]]:
    """(time, kind, node) of each leave, kill and join after training started (the first
    progress event): the initial replicas' joins are not events."""
    started = next((at for at, r in rows if r.get("type") == "progress"), None)
    slotted = {r.get("node", "") for _, r in rows if r.get("type") == "replica-slot"}
    out = []
    for p in preemptions:
        if p.notice_at is not None:
            out.append((p.notice_at, "left on notice", p.node))
        else:
            out.append((p.at, "killed", p.node))
    for at, r in rows:
        node = r.get("node", "")
        if (
            r.get("type") == "state"
            and node in slotted
            and _unquote(r.get("state", "")) in TRAINING
            and started is not None
            and at > started
        ):
            out.append((at, "joined", node))
    out.sort()
    return out


def replica_report(
    rows: Sequence[tuple[float, dict[str, str]]],
    summary: dict[str, Any],
    steps: Sequence[StepPoint],
    preemptions: Sequence[Preemption],
) -> ReplicaReport | None:
    """The replica part of a report; None for an elastic run (no replica figures in its
    summary and no ``replica-slot`` event)."""
    figures = summary.get("replica") if isinstance(summary.get("replica"), dict) else None
    if figures is None and not any(r.get("type") == "replica-slot" for _, r in rows):
        return None
    figures = figures or {}
    progress = [(at, r) for at, r in rows if r.get("type") == "progress"]
    taking = [w for _, r in progress if (w := _int(r.get("world_size"))) is not None]
    quorums = [q for _, r in progress if (q := _int(r.get("round"))) is not None]
    slots = {_unquote(r.get("slot", "")) for _, r in rows if r.get("type") == "replica-slot"}
    events = []
    for at, kind, node in _membership(rows, preemptions):
        after = next((r for t, r in progress if t >= at), None)
        before_rate, after_rate = _rates_around(steps, at)
        events.append(
            ReplicaEvent(
                at=at,
                kind=kind,
                node=node,
                taking_part=_int(after.get("world_size")) if after else None,
                rate_before=before_rate,
                rate_after=after_rate,
            )
        )
    discarded = figures.get("discarded") or {}
    quorum = figures.get("quorum_id")
    return ReplicaReport(
        replicas=max(len(slots - {""}), int(figures.get("replicas") or 0)),
        most_taking_part=max(taking, default=0),
        quorum_id=int(quorum) if quorum is not None else max(quorums, default=None),
        discarded=sum(int(v) for v in discarded.values()) if isinstance(discarded, dict) else 0,
        longest_pause_s=figures.get("longest_pause_s"),
        longest_pause_step=figures.get("longest_pause_step"),
        events=events,
    )


def _rate_text(v: float | None) -> str:
    return f"{v:.0f}/min" if v is not None else "?"


def replica_text(r: ReplicaReport, start: float, dur: Any) -> list[str]:
    """The report's lines for a replica run (``dur`` formats seconds since ``start``)."""
    pause = "not reported by the replicas"
    if r.longest_pause_s is not None:
        pause = f"{r.longest_pause_s:.2f} s" + (
            f" (at step {r.longest_pause_step})" if r.longest_pause_step else ""
        )
    lines = [
        f"  replicas      {r.replicas} slot(s) used, {r.most_taking_part} taking part at most, "
        f"quorum id {r.quorum_id if r.quorum_id is not None else '?'}",
        f"  discarded     {r.discarded} step attempt(s); longest pause of the survivors {pause}",
    ]
    for e in r.events:
        part = f", {e.taking_part} replica(s) taking part after" if e.taking_part else ""
        lines.append(
            f"  +{dur(e.at - start):<8} {e.node} {e.kind}: step rate "
            f"{_rate_text(e.rate_before)} before, {_rate_text(e.rate_after)} after{part}"
        )
    return lines
