"""The report's data: the panels' points, the summary figures, and what a report is built
from (:class:`ReportInputs`). All times are unix seconds; ``start`` is the run's creation."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spottrain.controller.reconcile.records import LaunchRecord
    from spottrain.controller.report.replica import ReplicaReport

# Controller events that end a node's VM (``node_name`` names the node).
VM_END_EVENTS = frozenset({"preempted", "vm-ended", "terminate"})


class NoReportData(Exception):
    """Neither the run's Redis nor its archive holds anything to report; says which."""


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
class ReplicaReportData(ReportData):
    """A replica run's report: the elastic one's panels, and its replicas and membership
    events (a subclass, so that an elastic run's report data stays as it was)."""

    replica: ReplicaReport | None = None


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
