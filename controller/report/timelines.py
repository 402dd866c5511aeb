"""The report's timelines rebuilt from the event stream and the launch ledger: nodes
training, ranks per round, steps and step rate, preemptions, VMs and cumulative cost."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from spottrain.controller.report.model import (
    VM_END_EVENTS,
    CostPoint,
    NodesPoint,
    Preemption,
    RateSegment,
    StepPoint,
    VmSpan,
    WorldPoint,
)
from spottrain.protocol.states import LEAVING, TRAINING, LedgerStatus

if TYPE_CHECKING:
    from spottrain.controller.reconcile.records import LaunchRecord


def _at(row: dict[str, str]) -> float | None:
    try:
        v = float(row.get("at", ""))
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _unquote(v: str) -> str:
    """Event fields that were not strings are JSON-encoded; a string stays as it is."""
    if v.startswith('"'):
        try:
            out = json.loads(v)
        except ValueError:
            return v
        return out if isinstance(out, str) else v
    return v


def _nodes_timeline(
    events: Sequence[tuple[float, dict[str, str]]], start: float
) -> list[NodesPoint]:
    training: set[str] = set()
    ended: set[str] = set()
    points = [NodesPoint(start, 0)]
    for at, row in events:
        kind = row.get("type", "")
        if kind == "state" and row.get("node") not in (None, "", "controller"):
            node = row["node"]
            state = _unquote(row.get("state", ""))
            if node in ended:
                continue
            if state in TRAINING:
                training.add(node)
            elif state in LEAVING:
                training.discard(node)
        elif kind in VM_END_EVENTS and row.get("node") == "controller":
            node = _unquote(row.get("node_name", ""))
            if node:
                training.discard(node)
                ended.add(node)
        else:
            continue
        if len(training) != points[-1].nodes:
            if points[-1].at == at:
                points[-1] = NodesPoint(at, len(training))
            else:
                points.append(NodesPoint(at, len(training)))
    # Two changes at the same instant that cancel out leave a redundant point: drop it.
    out: list[NodesPoint] = []
    for p in points:
        if not out or out[-1].nodes != p.nodes:
            out.append(p)
    return out


def _world_timeline(
    events: Sequence[tuple[float, dict[str, str]]], nodes: list[NodesPoint]
) -> list[WorldPoint]:
    raw: list[tuple[float, int, int | None]] = []
    for at, row in events:
        if row.get("type") in ("restored", "progress"):
            w = _int(row.get("world_size"))
            if w is not None:
                raw.append((at, w, _int(row.get("round"))))
    # No node trains: no rank either, until the next round restores.
    for p in nodes[1:]:
        if p.nodes == 0:
            raw.append((p.at, 0, None))
    raw.sort(key=lambda r: r[0])
    out: list[WorldPoint] = []
    for at, w, rnd in raw:
        if out and out[-1].world_size == w and (rnd is None or out[-1].round == rnd):
            continue
        if out and out[-1].at == at:
            out[-1] = WorldPoint(at, w, rnd)
        else:
            out.append(WorldPoint(at, w, rnd))
    return out


def _step_timeline(
    events: Sequence[tuple[float, dict[str, str]]], progress: dict[str, str]
) -> list[StepPoint]:
    points: list[StepPoint] = []
    cur: int | None = None
    for at, row in events:
        kind = row.get("type")
        if kind == "restored":
            step = _int(row.get("step"))
            if step is None:
                continue
            reached = _int(row.get("reached"))
            if cur is not None:
                # The step reached before the restart, as of now (it was reported earlier).
                points.append(StepPoint(at, max(cur, reached or 0), "reached"))
            points.append(StepPoint(at, step, "restored"))
            cur = step
        elif kind in ("checkpoint-committed", "progress"):
            step = _int(row.get("step"))
            if step is None:
                continue
            step = max(step, cur or 0)
            points.append(StepPoint(at, step, "checkpoint" if kind != "progress" else "progress"))
            cur = step
    # The live progress hash, when it is ahead of what the events say.
    p_step, p_at = _int(progress.get("step")), _float(progress.get("at"))
    if (
        p_step is not None
        and p_at is not None
        and (not points or (p_step > points[-1].step and p_at >= points[-1].at))
    ):
        points.append(StepPoint(p_at, p_step, "progress"))
    return points


def _rate(points: list[StepPoint]) -> list[RateSegment]:
    out: list[RateSegment] = []
    for a, b in itertools.pairwise(points):
        if b.at <= a.at:
            continue
        steps = max(0, b.step - a.step)
        out.append(RateSegment(a.at, b.at, steps, steps * 60.0 / (b.at - a.at)))
    return out


def _preemptions(
    events: Sequence[tuple[float, dict[str, str]]], launches: list[LaunchRecord] | None
) -> list[Preemption]:
    notices: dict[str, float] = {}
    out: list[Preemption] = []
    for at, row in events:
        kind = row.get("type")
        if kind == "notice" and _unquote(row.get("kind", "")) != "rebalance":
            notices.setdefault(row.get("node", ""), at)
        elif kind == "preempted":
            node = _unquote(row.get("node_name", ""))
            out.append(
                Preemption(
                    at=at,
                    node=node,
                    zone=_unquote(row.get("zone", "")),
                    vm=_unquote(row.get("vm", "")),
                    reason=_unquote(row.get("reason", "")),
                    notice_at=notices.get(node),
                )
            )
    seen = {p.node for p in out}
    for rec in launches or []:
        if rec.interrupted and rec.node not in seen and rec.ended_at is not None:
            # Its event was trimmed from the stream: the ledger still knows.
            out.append(
                Preemption(rec.ended_at, rec.node, rec.offer.zone, rec.instance_id, rec.reason)
            )
    out.sort(key=lambda p: p.at)
    return out


def _vms_from_ledger(launches: list[LaunchRecord]) -> list[VmSpan]:

    out = []
    for r in sorted(launches, key=lambda r: (r.launched_at, r.node)):
        if r.status == LedgerStatus.FAILED:
            continue  # refused by the cloud: nothing ran, nothing is billed
        out.append(
            VmSpan(
                node=r.node,
                zone=r.offer.zone,
                market=r.offer.market.value,
                price=r.offer.price_per_hour,
                od_price=r.od_price if r.od_price > 0 else r.offer.price_per_hour,
                start=r.launched_at,
                end=r.ended_at,
                interrupted=r.interrupted,
            )
        )
    return out


def _vms_from_events(
    events: Sequence[tuple[float, dict[str, str]]], notes: list[str]
) -> list[VmSpan]:
    started: dict[str, tuple[float, dict[str, str]]] = {}
    ends: dict[str, tuple[float, bool]] = {}
    unpriced: list[str] = []
    for at, row in events:
        kind = row.get("type")
        node = _unquote(row.get("node_name", ""))
        if not node or row.get("node") != "controller":
            continue
        if kind == "launched" and node not in started:
            started[node] = (at, row)
        elif kind == "adopted" and node not in started:
            unpriced.append(node)
        elif kind in VM_END_EVENTS and node in started and node not in ends:
            ends[node] = (at, kind == "preempted")
    if unpriced:
        notes.append(
            f"no price in the events for adopted node(s) {', '.join(sorted(set(unpriced)))}: "
            "not counted"
        )
    out = []
    for node, (at, row) in sorted(started.items(), key=lambda kv: (kv[1][0], kv[0])):
        end = ends.get(node)
        out.append(
            VmSpan(
                node=node,
                zone=_unquote(row.get("zone", "")),
                market=_unquote(row.get("market", "")),
                price=_float(row.get("price")) or 0.0,
                od_price=None,
                start=at,
                end=end[0] if end else None,
                interrupted=bool(end and end[1]),
            )
        )
    return out


def _cost(vms: list[VmSpan], start: float, end: float) -> list[CostPoint]:
    """Cumulative cost at every time the fleet's hourly rate changes (a sweep: linear in the
    VMs, so a long run with thousands of launches stays cheap)."""
    with_od = all(v.od_price is not None for v in vms)
    changes: dict[float, list[float]] = {start: [0.0, 0.0], end: [0.0, 0.0]}
    for v in vms:
        t0 = min(max(v.start, start), end)
        t1 = min(max(v.end if v.end is not None else end, t0), end)
        if t1 <= t0:
            continue
        od = v.od_price or 0.0
        for t, sign in ((t0, 1.0), (t1, -1.0)):
            c = changes.setdefault(t, [0.0, 0.0])
            c[0] += sign * v.price
            c[1] += sign * od
    out = []
    spent = on_demand = rate = od_rate = 0.0
    prev = start
    for t in sorted(changes):
        spent += rate * (t - prev) / 3600.0
        on_demand += od_rate * (t - prev) / 3600.0
        out.append(CostPoint(t, spent, on_demand if with_od else None))
        rate += changes[t][0]
        od_rate += changes[t][1]
        prev = t
    return out
