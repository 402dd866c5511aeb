"""The report's data built from its inputs (pure: no I/O, no clock): the span of the run,
its timelines (:mod:`spottrain.controller.report.timelines`) and the summary figures."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from spottrain.controller.report.model import (
    CostPoint,
    Figures,
    NodesPoint,
    Preemption,
    RateSegment,
    ReplicaReportData,
    ReportData,
    ReportInputs,
    StepPoint,
    WorldPoint,
)
from spottrain.controller.report.replica import replica_report
from spottrain.controller.report.timelines import (
    _at,
    _cost,
    _float,
    _nodes_timeline,
    _preemptions,
    _rate,
    _step_timeline,
    _vms_from_events,
    _vms_from_ledger,
    _world_timeline,
)
from spottrain.protocol.events import EVENTS_MAXLEN
from spottrain.protocol.states import ENDED_PHASES

if TYPE_CHECKING:
    from spottrain.controller.reconcile.records import LaunchRecord


def build_report(
    run_id: str, inputs: ReportInputs, *, start: float, now: float, source: str
) -> ReportData:
    """The report's data from its inputs (pure: no I/O, no clock)."""
    notes: list[str] = []
    rows: list[tuple[float, dict[str, str]]] = []
    for row in inputs.events:
        at = _at(row)
        if at is not None:
            rows.append((at, row))
    rows.sort(key=lambda r: r[0])  # stable: stream order within one instant
    summary = inputs.summary or {}
    phase = str(summary.get("phase") or "unknown")
    launches = inputs.launches
    start, end = _span(rows, launches, phase, start, now)

    nodes = _nodes_timeline(rows, start)
    world = _world_timeline(rows, nodes)
    steps = _step_timeline(rows, inputs.progress)
    rate = _rate(steps)
    preemptions = _preemptions(rows, launches)
    if launches:
        vms, cost_source = _vms_from_ledger(launches), "ledger"
    else:
        vms, cost_source = _vms_from_events(rows, notes), "events"
        notes.append(
            "cost from the launch events (no launch ledger: launches.json was not archived); "
            "the on-demand equivalent is unknown"
        )
    cost = _cost(vms, start, end)
    replica = replica_report(rows, summary, steps, preemptions)
    if replica is None and not any(r.get("type") == "restored" for _, r in rows):
        # (A replica run's world is the replicas taking part, from its progress events.)
        notes.append("no restore event: the world size in ranks is unknown")
    if not steps:
        notes.append("no checkpoint or restore event: the step rate is unknown")
    if len(rows) >= EVENTS_MAXLEN:
        notes.append(
            f"the event stream is at its cap ({EVENTS_MAXLEN:,} entries): its oldest events "
            "were trimmed, so the timelines start late (cost and preemptions use the ledger)"
        )
    data = ReportData(
        run_id=run_id,
        source=source,
        start=start,
        end=end,
        nodes=nodes,
        world=world,
        steps=steps,
        rate=rate,
        preemptions=preemptions,
        vms=vms,
        cost=cost,
        cost_source=cost_source,
        figures=_figures(summary, phase, nodes, world, steps, rate, preemptions, cost),
        notes=notes,
    )
    # A replica run's data is the elastic one's plus its replicas (an elastic run's JSON
    # stays as it was).
    return data if replica is None else ReplicaReportData(**vars(data), replica=replica)


def _span(
    rows: list[tuple[float, dict[str, str]]],
    launches: list[LaunchRecord] | None,
    phase: str,
    start: float,
    now: float,
) -> tuple[float, float]:
    """The timeline's start and end: a run that ended ends at its last record."""
    if rows:
        start = min(start, rows[0][0])
    if launches:
        start = min(start, *(r.launched_at for r in launches))
    if phase in ENDED_PHASES:
        last = [at for at, _ in rows[-1:]]
        for r in launches or []:
            last.append(r.launched_at)
            if r.ended_at is not None:
                last.append(r.ended_at)
        end = max(last, default=start)
    else:
        end = max(now, rows[-1][0] if rows else start)
    return start, end


def _figures(
    summary: dict[str, Any],
    phase: str,
    nodes: list[NodesPoint],
    world: list[WorldPoint],
    steps: list[StepPoint],
    rate: list[RateSegment],
    preemptions: list[Preemption],
    cost: list[CostPoint],
) -> Figures:
    """The summary figures: the run's summary where it has them, else the timelines'."""
    spent = cost[-1].spent_usd if cost else 0.0
    od = cost[-1].on_demand_usd if cost else None
    saved = od - spent if od is not None else _float(str(summary.get("saved_usd", "")))
    lost_events = 0
    for a, b in itertools.pairwise(steps):
        if a.source == "reached" and b.source == "restored":
            lost_events += max(0, a.step - b.step)
    steps_lost = summary.get("steps_lost")
    final_step = summary.get("final_step")
    step = summary.get("step")
    if step is None:
        step = max((p.step for p in steps), default=0)
    loss = summary.get("loss")
    total = sum(s.steps for s in rate)
    span = sum(s.end - s.start for s in rate)
    return Figures(
        phase=phase,
        step=int(step),
        final_step=int(final_step) if final_step is not None else None,
        loss=float(loss) if loss is not None else None,
        steps_lost=int(steps_lost) if steps_lost is not None else lost_events,
        preemptions=len(preemptions),
        preemptions_with_notice=sum(1 for p in preemptions if p.notice_at is not None),
        spent_usd=spent,
        on_demand_usd=od,
        saved_usd=saved,
        max_nodes=max((p.nodes for p in nodes), default=0),
        max_world_size=max((p.world_size for p in world), default=0),
        mean_steps_per_minute=total * 60.0 / span if span > 0 else None,
        reason=str(summary.get("reason") or ""),
    )
