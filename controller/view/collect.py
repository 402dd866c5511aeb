"""One frame of the live view read from a run's Redis (:class:`Collector`), with what a
single read cannot say: the step rate and how long the fleet has been short."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import Summary, boot_lines, summarize
from spottrain.controller.run.records import RunInfo
from spottrain.controller.run.replica_view import replica_status
from spottrain.controller.run.shortfall import LedgerCache, ShortWatch
from spottrain.protocol import events as stream
from spottrain.safetext import escape_controls
from spottrain.spec import FaultTolerance

from .model import EventRow, NodeRow, ViewData

# The step rate is the steps made over about this many seconds.
RATE_WINDOW_S = 30.0
# Events the view leaves out: the trainers' progress is the step line already.
QUIET_EVENTS = frozenset({"progress"})
EVENTS_READ = 60


def refused_line(refused: Mapping[str, str]) -> str:
    """A refused checkpoint commit must not pass unseen: the trainers went on training."""
    return escape_controls(
        f"{refused.get('count', '?')} checkpoint commits refused (newest: step "
        f"{refused.get('step', '?')} by {refused.get('node') or '?'}: {refused.get('reason', '')})"
    )


def event_row(row: Mapping[str, str]) -> EventRow:
    """An entry of the event stream as one line: who (the node it is about, else its writer),
    what, and the rest of its fields, control characters escaped (any node may write the
    stream)."""
    rest = {k: v for k, v in row.items() if k not in ("type", "node", "at", "id", "node_name")}
    try:
        at = float(row.get("at") or 0)
    except ValueError:
        at = 0.0
    return EventRow(
        at=at,
        node=escape_controls(row.get("node_name") or row.get("node", "")),
        kind=escape_controls(row.get("type", "?")),
        detail=escape_controls(" ".join(f"{k}={v}" for k, v in rest.items())),
    )


class Collector:
    """Reads frames of one run's live view.

    Args:
        info: the run.
        state: its Redis.
        target: the nodes the run keeps when ``scale`` set none (the spec's ``nodes.max``).
    """

    def __init__(
        self,
        info: RunInfo,
        state: RunState,
        target: int,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.info, self.state, self.target, self.clock = info, state, target, clock
        self._steps: deque[tuple[float, int]] = deque()
        self._short = ShortWatch(target)
        self._ledgers = LedgerCache()
        self._replica = bool(info.lighthouse) or _replica_spec(info)

    def frame(self, summary: Summary | None = None) -> ViewData:
        """The figures of now; ``summary``: the controller's own of this pass, if it has one.

        Raises:
            redis.RedisError: the run's Redis does not answer.
        """
        now = self.clock()
        s = summary if summary is not None else summarize(self.state, now)
        ctl = self.state.ctl()
        # Read again when a node the view has not placed appears (and while the fleet is
        # short, at most every LEDGER_EVERY_S: _shortfall).
        ledger = self._ledgers.ledger
        if set(s.nodes) - set(ledger.records):
            ledger = self._ledgers.read(self.state, now, force=True)
        nodes = []
        for name, node_state in s.nodes.items():
            rec = ledger.records.get(name)
            o = rec.offer if rec is not None else None
            nodes.append(
                NodeRow(
                    name,
                    o.cloud if o else "?",
                    o.zone if o else "?",
                    o.instance_type if o else "?",
                    o.market.value if o else "?",
                    node_state,
                )
            )
        refused = self.state.ckpt_refused()
        started = _float(ctl.get("started_at"))
        replicas = replica_status(self.info, self.state.client) if self._replica else None
        boot = boot_lines(self.state, s)
        return ViewData(
            run_id=self.info.run_id,
            summary=s,
            nodes=nodes,
            step_rate=self._rate(now, s.step),
            elapsed_s=now - started if started is not None else None,
            short=self._shortfall(now, s, ctl),
            replica=replicas.lines(now) if replicas else [],
            events=self._events(),
            notes=[refused_line(refused)] if refused else [],
            boot_failed=boot.failed,
            booting=boot.booting,
        )

    def _rate(self, now: float, step: int) -> float | None:
        if self._steps and step < self._steps[-1][1]:
            self._steps.clear()  # a restore went back: the rate starts again
        self._steps.append((now, step))
        while len(self._steps) > 2 and now - self._steps[1][0] >= RATE_WINDOW_S:
            self._steps.popleft()
        (t0, s0), (t1, s1) = self._steps[0], self._steps[-1]
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= 1.0 and s1 > s0 else None

    def _shortfall(self, now: float, s: Summary, ctl: Mapping[str, str]) -> str:
        """How long the fleet has had fewer nodes than it keeps, and what it waits for."""
        short = self._short.check(now, s, ctl, lambda: self._ledgers.read(self.state, now))
        return short.line() if short is not None else ""

    def _events(self) -> list[EventRow]:
        rows = self.state.client.xrevrange(self.state.keys.events, count=EVENTS_READ)
        out = [event_row(stream.decode(i, f)) for i, f in rows]
        return [e for e in reversed(out) if e.kind not in QUIET_EVENTS]


def _replica_spec(info: RunInfo) -> bool:
    """A replica run (its quorum's figures are read each frame); an elastic one has none."""
    try:
        return info.spec().train.fault_tolerance is FaultTolerance.REPLICA
    except Exception:
        return False  # a record whose spec no longer parses: shown as an elastic run


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v else None
    except ValueError:
        return None
