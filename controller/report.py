"""``spottrain report RUN``: a run's timeline (world size, step rate, preemptions, cost) as a
PNG and a text summary, for a running run (from its Redis) or a finished one (from the files
``archive_run`` left in its directory).

Where each panel's data comes from (the progress hash is overwritten at every step, so
timelines are rebuilt from the event stream and the launch ledger):

- **world size**: nodes training, from the agents' ``state`` events (a node counts from
  ``joined`` until ``draining``, ``left`` or ``failed``) and the controller's end of its VM
  (``preempted``, ``vm-ended``, ``terminate``: a VM killed without notice says nothing
  itself); and ranks, the world size of each rendezvous round, from the SDK's ``restored``
  events (rank 0 writes one each time the workers restart, so once per round).
- **step rate**: steps per minute between consecutive known (time, step) points: each
  ``checkpoint-committed`` event, each ``restored`` event (the step the job had reached,
  then the step it went back to), ``progress`` events if the SDK writes them, and the live
  progress hash when it is ahead of them. Its resolution is the checkpoint cadence.
- **preemptions**: the controller's ``preempted`` events (time, node, zone), with the
  agent's first draining ``notice`` for that node if it had one; ledger records marked
  interrupted whose event was trimmed from the stream are added at their end time.
- **cost**: cumulative dollars from the launch ledger (each VM's price x hours between its
  launch and its end, and the same hours at the on-demand price); an archive without
  ``launches.json`` falls back to the ``launched`` events (which carry the price) and the
  end events, and then has no on-demand figure.

All times in :class:`ReportData` are unix seconds; ``start`` is the run's creation.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spottrain.keys import EVENTS_MAXLEN, RunKeys

if TYPE_CHECKING:
    import redis

    from .reconcile.records import LaunchRecord
    from .runs import RunInfo

# The controller's modules (runs, state, loop) and matplotlib are imported where they are
# used: `spottrain --help` builds this command's parser and should stay quick.

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

# Phases after which nothing of the run changes any more: its timeline ends at its last record.
ENDED_PHASES = frozenset({"done", "failed", "down"})
# Agent states in which a node's workers are in the training world.
_TRAINING_STATES = frozenset({"joined", "checkpointing"})
_LEAVING_STATES = frozenset({"draining", "left", "failed"})
# Controller events that end a node's VM (``node_name`` names the node).
_VM_END_EVENTS = frozenset({"preempted", "vm-ended", "terminate"})


class NoReportData(Exception):
    """Neither the run's Redis nor its archive holds anything to report; says which."""


# --- the data behind the panels ---------------------------------------------------------------


@dataclass(frozen=True)
class NodesPoint:
    """From ``at`` on, ``nodes`` nodes train (until the next point)."""

    at: float
    nodes: int


@dataclass(frozen=True)
class WorldPoint:
    """From ``at`` on, the newest round has ``world_size`` ranks (0: no node trains)."""

    at: float
    world_size: int
    round: int | None = None


@dataclass(frozen=True)
class StepPoint:
    """The job was at ``step`` at ``at``. ``source``: ``checkpoint`` (a commit), ``reached``
    (the highest step reported before a restart), ``restored`` (the step a restart went back
    to), ``progress`` (a progress report)."""

    at: float
    step: int
    source: str


@dataclass(frozen=True)
class RateSegment:
    """``steps`` steps trained between ``start`` and ``end``: ``per_minute`` steps/minute."""

    start: float
    end: float
    steps: int
    per_minute: float


@dataclass(frozen=True)
class Preemption:
    """A VM taken back by its cloud, as the controller saw it (``at``); ``notice_at`` is when
    its agent got a draining notice, if it got one."""

    at: float
    node: str
    zone: str
    vm: str = ""
    reason: str = ""
    notice_at: float | None = None


@dataclass(frozen=True)
class VmSpan:
    """One VM's billed time: ``price`` $/h from ``start`` to ``end`` (``None``: still running
    at the report's end). ``od_price`` is the on-demand price of the same VM, if known."""

    node: str
    zone: str
    market: str
    price: float
    od_price: float | None
    start: float
    end: float | None
    interrupted: bool = False


@dataclass(frozen=True)
class CostPoint:
    """Cumulative dollars at ``at``: ``spent_usd`` at the prices paid, ``on_demand_usd`` had
    the same VM-hours been on-demand (``None`` when the prices are not known). Cost is
    linear between consecutive points."""

    at: float
    spent_usd: float
    on_demand_usd: float | None


@dataclass(frozen=True)
class Figures:
    """The summary figures."""

    phase: str
    step: int
    final_step: int | None
    loss: float | None
    steps_lost: int
    preemptions: int
    preemptions_with_notice: int
    spent_usd: float
    on_demand_usd: float | None
    saved_usd: float | None
    max_nodes: int
    max_world_size: int
    mean_steps_per_minute: float | None
    reason: str = ""


@dataclass
class ReportData:
    """Everything the PNG and the text summary show. ``source``: ``redis`` or ``archive``;
    ``cost_source``: ``ledger`` or ``events``; ``notes`` say what could not be known."""

    run_id: str
    source: str
    start: float
    end: float
    nodes: list[NodesPoint]
    world: list[WorldPoint]
    steps: list[StepPoint]
    rate: list[RateSegment]
    preemptions: list[Preemption]
    vms: list[VmSpan]
    cost: list[CostPoint]
    cost_source: str
    figures: Figures
    notes: list[str] = field(default_factory=list)

    def nodes_at(self, t: float) -> int:
        """Nodes training at time ``t``."""
        i = bisect.bisect_right([p.at for p in self.nodes], t) - 1
        return self.nodes[i].nodes if i >= 0 else 0

    def world_at(self, t: float) -> int:
        """Ranks in the newest round at time ``t``."""
        i = bisect.bisect_right([p.at for p in self.world], t) - 1
        return self.world[i].world_size if i >= 0 else 0

    def rate_at(self, t: float) -> float | None:
        """Steps per minute at ``t`` (None outside the known segments)."""
        for seg in self.rate:
            if seg.start <= t < seg.end:
                return seg.per_minute
        return None

    def cost_at(self, t: float) -> CostPoint:
        """Cumulative cost at ``t`` (exact: cost is linear between the points)."""
        if not self.cost or t <= self.cost[0].at:
            return CostPoint(t, 0.0, 0.0 if self.cost_source == "ledger" else None)
        times = [p.at for p in self.cost]
        i = bisect.bisect_right(times, t) - 1
        a = self.cost[i]
        if i + 1 >= len(self.cost):
            return CostPoint(t, a.spent_usd, a.on_demand_usd)
        b = self.cost[i + 1]
        w = (t - a.at) / (b.at - a.at) if b.at > a.at else 0.0
        od = None
        if a.on_demand_usd is not None and b.on_demand_usd is not None:
            od = a.on_demand_usd + w * (b.on_demand_usd - a.on_demand_usd)
        return CostPoint(t, a.spent_usd + w * (b.spent_usd - a.spent_usd), od)

    def to_json(self) -> dict[str, Any]:
        """The panel data as plain JSON values (``--json``)."""
        return asdict(self)


@dataclass
class ReportInputs:
    """What a report is built from, read from Redis or from the archive.

    Attributes:
        events: the event stream's entries (each with ``id``), oldest first.
        launches: the launch ledger, or None when it is not available (an archive made
            before ``launches.json`` was kept).
        progress: the progress hash (``{}`` when unknown).
        summary: the run's summary (``summarize`` live, ``summary.json`` archived), or None.
    """

    events: list[dict[str, str]]
    launches: list[LaunchRecord] | None
    progress: dict[str, str]
    summary: dict[str, Any] | None

    @property
    def empty(self) -> bool:
        return not self.events and not self.launches and not self.progress and not self.summary


# --- reading ----------------------------------------------------------------------------------


def read_redis_inputs(client: redis.Redis, keys: RunKeys, now: float) -> ReportInputs:
    """The report's inputs from the run's Redis."""
    from .reconcile.state import RunState
    from .reconcile.summary import summarize

    state = RunState(client, keys)
    events = state.events()
    ledger = state.ledger()
    launches = list(ledger.records.values()) or None
    progress = state.progress()
    summary = None
    if events or launches or progress or state.ctl():
        summary = asdict(summarize(state, now))
    return ReportInputs(events, launches, progress, summary)


def read_archive_inputs(run_dir: Path) -> ReportInputs:
    """The report's inputs from what the run left on disk: ``events.jsonl``,
    ``summary.json`` and, when kept, ``launches.json`` and ``progress.json``."""
    events: list[dict[str, str]] = []
    path = run_dir / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                events.append({str(k): str(v) for k, v in row.items()})
    from .reconcile.records import LaunchRecord

    launches = None
    path = run_dir / "launches.json"
    if path.exists():
        raw = json.loads(path.read_text())
        launches = [LaunchRecord.from_json(json.dumps(d)) for d in raw.values()]
    progress: dict[str, str] = {}
    path = run_dir / "progress.json"
    if path.exists():
        progress = {str(k): str(v) for k, v in json.loads(path.read_text()).items()}
    summary = None
    path = run_dir / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
    return ReportInputs(events, launches, progress, summary)


def write_report_inputs(run_dir: Path, client: redis.Redis, keys: RunKeys) -> None:
    """Keep what the report needs beyond events and summary: the launch ledger
    (``launches.json``, node -> launch record) and the progress hash (``progress.json``).
    Meant to be called by ``archive_run``."""
    launches = {k.decode(): json.loads(v) for k, v in client.hgetall(keys.ctl_launches).items()}
    (run_dir / "launches.json").write_text(json.dumps(launches, indent=1, sort_keys=True))
    progress = {k.decode(): v.decode() for k, v in client.hgetall(keys.progress).items()}
    (run_dir / "progress.json").write_text(json.dumps(progress, indent=1, sort_keys=True))


def load_report_data(
    info: RunInfo, *, client: redis.Redis | None = None, now: float | None = None
) -> ReportData:
    """The report of a run: from its Redis when it answers and holds the run, else from its
    archive.

    Args:
        info: the run.
        client: a client of the run's Redis (opened from ``info`` when None).
        now: the end of a running run's timeline (the clock when None). A run that ended
            (phase done, failed or down) ends at its last record instead.

    Raises:
        NoReportData: neither holds anything about the run.
    """
    import redis

    from .runs import RunError, open_redis

    clock = time.time() if now is None else now
    keys = RunKeys(info.run_id)
    if client is None:
        try:
            spec = info.spec()
        except Exception:
            spec = None
        try:
            client = open_redis(info, spec)
        except (RunError, redis.RedisError):
            client = None
    if client is not None:
        try:
            inputs = read_redis_inputs(client, keys, clock)
        except redis.RedisError:
            inputs = None
        if inputs is not None and not inputs.empty:
            return build_report(
                info.run_id, inputs, start=info.created_at, now=clock, source="redis"
            )
    inputs = read_archive_inputs(info.dir)
    if inputs.empty:
        where = "holds nothing about it" if client is not None else "does not answer"
        raise NoReportData(
            f"run {info.run_id}: its Redis ({info.redis_url}) {where} and it left no archive "
            f"(events.jsonl, summary.json) in {info.dir}: nothing to report"
        )
    return build_report(info.run_id, inputs, start=info.created_at, now=clock, source="archive")


# --- building ---------------------------------------------------------------------------------


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
            if state in _TRAINING_STATES:
                training.add(node)
            elif state in _LEAVING_STATES:
                training.discard(node)
        elif kind in _VM_END_EVENTS and row.get("node") == "controller":
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
    from .reconcile.records import FAILED

    out = []
    for r in sorted(launches, key=lambda r: (r.launched_at, r.node)):
        if r.status == FAILED:
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
        elif kind in _VM_END_EVENTS and node in started and node not in ends:
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
    if rows:
        start = min(start, rows[0][0])
    launches = inputs.launches
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
    if not any(r.get("type") == "restored" for _, r in rows):
        notes.append("no restore event: the world size in ranks is unknown")
    if not steps:
        notes.append("no checkpoint or restore event: the step rate is unknown")
    if len(rows) >= EVENTS_MAXLEN:
        notes.append(
            f"the event stream is at its cap ({EVENTS_MAXLEN:,} entries): its oldest events "
            "were trimmed, so the timelines start late (cost and preemptions use the ledger)"
        )

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
    figures = Figures(
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
    return ReportData(
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
        figures=figures,
        notes=notes,
    )


# --- text -------------------------------------------------------------------------------------


def _dur(seconds: float) -> str:
    s = round(max(0.0, seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def text_summary(data: ReportData) -> str:
    """The report as a few lines of text."""
    f = data.figures
    origin = "its Redis" if data.source == "redis" else "its archive"
    lines = [f"run {data.run_id} ({f.phase}, from {origin})"]
    lines.append(
        f"  time          {_dur(data.end - data.start)} "
        f"({_clock(data.start)} to {_clock(data.end)})"
    )
    trained = f"{f.final_step} trained, finished" if f.final_step is not None else f"{f.step}"
    lines.append(f"  steps         {trained}; {f.steps_lost} lost to restarts")
    if f.mean_steps_per_minute is not None:
        best = max(s.per_minute for s in data.rate)
        lines.append(
            f"  step rate     {f.mean_steps_per_minute:.1f}/min on average, {best:.1f}/min at best"
        )
    lines.append(f"  world size    {f.max_nodes} node(s), {f.max_world_size} rank(s) at most")
    pre = f"  preemptions   {f.preemptions} ({f.preemptions_with_notice} with notice)"
    if data.preemptions:
        pre += ": " + ", ".join(
            f"{p.node} in {p.zone or '?'} at +{_dur(p.at - data.start)}" for p in data.preemptions
        )
    lines.append(pre)
    cost = f"  cost          ${f.spent_usd:,.2f} spent"
    if f.on_demand_usd is not None and f.saved_usd is not None:
        share = f" ({f.saved_usd / f.on_demand_usd:.0%})" if f.on_demand_usd > 0 else ""
        cost += f", ${f.on_demand_usd:,.2f} on-demand, ${f.saved_usd:,.2f} saved{share}"
    elif f.saved_usd is not None:
        cost += f", ${f.saved_usd:,.2f} saved against on-demand"
    lines.append(cost)
    if f.reason:
        lines.append(f"  reason        {f.reason}")
    for note in data.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


# --- the PNG ----------------------------------------------------------------------------------


def _unit(data: ReportData) -> tuple[float, str]:
    """The time axis: minutes for a run of up to 3 hours, hours beyond."""
    return (60.0, "minutes") if data.end - data.start <= 3 * 3600 else (3600.0, "hours")


def _minutes(data: ReportData, ts: Iterable[float]) -> list[float]:
    """Times on the plot's axis (in :func:`_unit`'s unit) since the run started."""
    div = _unit(data)[0]
    return [(t - data.start) / div for t in ts]


def render_png(data: ReportData, path: Path | str) -> Path:
    """Draw the four panels (world size, step rate, preemptions, cost) sharing the time
    axis (minutes, or hours past 3 hours, since the run started) into a PNG at ``path``.

    Raises:
        ImportError: matplotlib is missing (``pip install 'spottrain[report]'``).
        OSError: the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    end_m = _minutes(data, [data.end])[0]
    fig = Figure(figsize=(10, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_world, ax_rate, ax_pre, ax_cost = fig.subplots(4, 1, sharex=True)
    f = data.figures
    fig.suptitle(
        f"{data.run_id}: {f.phase}, step {f.final_step if f.final_step is not None else f.step}, "
        f"{f.preemptions} preemption(s), ${f.spent_usd:,.2f} spent"
    )

    # 1. world size: nodes training, and ranks in the newest round.
    xs = [*_minutes(data, [p.at for p in data.nodes]), end_m]
    ys = [p.nodes for p in data.nodes] + [data.nodes[-1].nodes if data.nodes else 0]
    ax_world.step(xs, ys, where="post", color="tab:blue", label="nodes training")
    ax_world.set_ylabel("nodes")
    ax_world.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_world.set_ylim(bottom=0, top=max(1, f.max_nodes) + 0.5)
    if data.world and f.max_world_size > 0:
        ranks = ax_world.twinx()
        xs = [*_minutes(data, [p.at for p in data.world]), end_m]
        ys = [p.world_size for p in data.world] + [data.world[-1].world_size]
        ranks.step(xs, ys, where="post", color="tab:orange", linestyle="--", label="ranks")
        ranks.set_ylabel("ranks")
        ranks.yaxis.set_major_locator(MaxNLocator(integer=True))
        ranks.set_ylim(bottom=0, top=max(1, f.max_world_size) * 1.15)
        ranks.legend(loc="upper right", fontsize="small")
    ax_world.legend(loc="upper left", fontsize="small")
    ax_world.set_title("world size", loc="left", fontsize="medium")

    # 2. step rate (segments), with the step itself on the right.
    if data.rate:
        ax_rate.hlines(
            [s.per_minute for s in data.rate],
            _minutes(data, [s.start for s in data.rate]),
            _minutes(data, [s.end for s in data.rate]),
            color="tab:green",
            linewidth=2,
        )
    ax_rate.set_ylabel("steps / min")
    ax_rate.set_ylim(bottom=0, top=max([s.per_minute for s in data.rate], default=1) * 1.15)
    if data.steps:
        step_ax = ax_rate.twinx()
        step_ax.plot(
            _minutes(data, [p.at for p in data.steps]),
            [p.step for p in data.steps],
            color="tab:gray",
            linewidth=1,
            marker="." if len(data.steps) <= 200 else None,
        )
        step_ax.set_ylabel("step")
        step_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_rate.set_title("step rate (between checkpoints and restarts)", loc="left", fontsize="medium")

    # 3. preemptions: a line and a marker (its zone) at each, a triangle at its notice.
    # One call per kind of mark: a run can have thousands.
    zones = sorted({p.zone for p in data.preemptions}) or [""]
    row = {z: i for i, z in enumerate(zones)}
    px = _minutes(data, [p.at for p in data.preemptions])
    py = [row[p.zone] for p in data.preemptions]
    if data.preemptions:
        ax_pre.vlines(px, -0.5, len(zones) - 0.5, color="tab:red", linewidth=1)
        ax_pre.plot(px, py, linestyle="none", marker="X", color="tab:red", markersize=9)
        if len(data.preemptions) <= 40:
            for ax in (ax_world, ax_rate, ax_cost):
                ax.vlines(px, 0, 1, transform=ax.get_xaxis_transform(), color="tab:red", alpha=0.25)
        noticed = [p for p in data.preemptions if p.notice_at is not None]
        ax_pre.plot(
            _minutes(data, [p.notice_at or p.at for p in noticed]),
            [row[p.zone] for p in noticed],
            linestyle="none",
            marker="v",
            color="tab:purple",
        )
    if len(data.preemptions) <= 40:
        for p, x, y in zip(data.preemptions, px, py, strict=True):
            ax_pre.annotate(p.node, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_pre.set_yticks(range(len(zones)), [z or "?" for z in zones])
    ax_pre.set_ylim(-0.5, len(zones) - 0.5)
    ax_pre.set_title(f"preemptions ({f.preemptions}; v: notice)", loc="left", fontsize="medium")

    # 4. cumulative cost against the on-demand equivalent.
    xs = _minutes(data, [p.at for p in data.cost])
    ax_cost.plot(xs, [p.spent_usd for p in data.cost], color="tab:blue", label="spent")
    if data.cost and all(p.on_demand_usd is not None for p in data.cost):
        od = [p.on_demand_usd or 0.0 for p in data.cost]
        ax_cost.plot(xs, od, color="tab:gray", linestyle="--", label="on-demand equivalent")
        ax_cost.fill_between(
            xs, [p.spent_usd for p in data.cost], od, color="tab:green", alpha=0.15
        )
    ax_cost.set_ylabel("USD")
    ax_cost.set_ylim(bottom=0)
    ax_cost.legend(loc="upper left", fontsize="small")
    ax_cost.set_title(f"cumulative cost ({data.cost_source})", loc="left", fontsize="medium")
    ax_cost.set_xlabel(f"{_unit(data)[1]} since the run started")
    ax_cost.set_xlim(0, max(end_m, 1e-3))
    fig.savefig(path, format="png")
    return path


# --- the command ------------------------------------------------------------------------------


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``report`` to the ``spottrain`` subcommands (``sub``: from ``add_subparsers``)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "report",
        help="a run's timeline (world size, step rate, preemptions, cost) as a PNG, and a summary",
    )
    p.add_argument("run", nargs="?", help="run id or job name (default: the newest run)")
    p.add_argument(
        "--png", metavar="PATH", help="where to write the PNG (default: RUN_DIR/report.png)"
    )
    p.add_argument("--json", action="store_true", help="print the panels' data as JSON")
    p.set_defaults(func=command)
    return p


def _err(msg: str) -> None:
    print(f"spottrain: {msg}", file=sys.stderr)


def command(args: argparse.Namespace) -> int:
    """``spottrain report``: 0 done, 1 nothing to report or the PNG not written, 2 no such
    run or a PNG path in a missing directory."""
    from .runs import RunError, find_run

    try:
        info = find_run(args.run)
    except RunError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    png = Path(args.png) if getattr(args, "png", None) else info.dir / "report.png"
    if not png.parent.is_dir():
        _err(f"cannot write {png}: directory {png.parent} does not exist")
        return EXIT_BAD_INPUT
    try:
        data = load_report_data(info)
    except NoReportData as e:
        _err(str(e))
        return EXIT_FAILED
    code = EXIT_OK
    written: str | None = None
    try:
        written = str(render_png(data, png))
    except ImportError:
        _err("the PNG needs matplotlib: pip install 'spottrain[report]'")
        code = EXIT_FAILED
    except OSError as e:
        _err(f"cannot write {png}: {e.strerror or e}")
        code = EXIT_FAILED
    if args.json:
        print(json.dumps({**data.to_json(), "png": written}))
    else:
        print(text_summary(data))
        if written:
            print(f"  timeline      {written}")
    return code
