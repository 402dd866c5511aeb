"""The fleet in wandb: what the controller logs each pass (see :mod:`spottrain.tracking`).

Each pass logs one history row: the run's figures from its :class:`Summary` under
``fleet/`` (world size, nodes, step, preemptions, steps lost, dollars spent and saved
against on-demand) and, under ``events/``, how many fleet events of each kind the run's
event stream got since the previous pass (``events/backfills`` counts launched and adopted
VMs). At the end, the whole stream's fleet events go in a ``fleet_events`` table and the
final figures in the run's summary.

The controller's run is ``<run id>-fleet`` in the group ``<run id>`` (the trainers' runs
are in it too) and resumes when a restarted controller drives the run again; the stream
position it has logged up to is kept in the run's controller state, so a restart neither
logs an event twice nor skips one.

Tracking never stops the controller: a failure is logged once and the run goes on.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

from spottrain.protocol import events as stream
from spottrain.protocol.states import TRAINING
from spottrain.spec import JobSpec
from spottrain.tracking import Tracker, WandbSettings, run_id_for, start_run

from .reconcile.state import RunState
from .reconcile.summary import Summary

log = logging.getLogger("spottrain.controller.tracking")

# Event type -> its counter under ``events/``; launched and adopted VMs also count as
# ``backfills``.
FLEET_EVENTS = {
    "preempted": "preempted",
    "inject-preemption": "injected_preemptions",
    "vm-ended": "vm_ended",
    "launched": "launched",
    "adopted": "adopted",
    "capacity": "capacity",
    "launch-refused": "launch_refused",
    "terminate": "terminated",
    "move": "move",
    "move-ready": "move_ready",
    "stopping": "stopping",
    "restored": "restored",
    "checkpoint-committed": "checkpoints",
    "checkpoint-copied": "checkpoint_copies",
}
BACKFILLS = ("launched", "adopted")
TABLE_COLUMNS = ("at", "type", "node", "vm", "zone", "detail")
_CURSOR = "tracking_events_id"
_BATCH = 1000
_PER_PASS = 20_000  # events read in one pass at most (the rest wait for the next)


class FleetTracker:
    """Logs the fleet of one run each pass. Build it with :meth:`start`."""

    def __init__(self, tracker: Tracker, state: RunState) -> None:
        self.tracker = tracker
        self.state = state
        self._warned = False

    @classmethod
    def start(cls, run_id: str, spec: JobSpec, state: RunState) -> FleetTracker:
        """The run's fleet tracker: a no-op one unless the spec has a ``wandb:`` section
        (and wandb is installed)."""
        settings = WandbSettings.from_spec(spec.wandb)
        tracker = start_run(
            settings,
            run_id=run_id_for(run_id, "fleet"),
            job_type="fleet",
            group=run_id,
            config={
                "spottrain_run": run_id,
                "job": spec.name,
                "nodes_min": spec.nodes.min,
                "nodes_max": spec.nodes.max,
                "gpus_per_node": spec.nodes.gpus,
                "budget_usd": spec.budget.max_usd,
            },
            quiet=True,
        )
        return cls(tracker, state)

    @property
    def active(self) -> bool:
        return self.tracker.active

    def on_pass(self, s: Summary) -> None:
        """Log this pass: the figures, and the fleet events since the previous pass."""
        if not self.active:
            return
        try:
            self._log_pass(s)
        except Exception as exc:
            self._warn(f"fleet not logged to wandb: {exc}")

    def _log_pass(self, s: Summary) -> None:
        try:
            counts = Counter(e.get("type", "") for _, e in self._new_events())
        except Exception as exc:  # Redis away: the figures still go, the events next pass
            self._warn(f"fleet events not read for wandb: {exc}")
            counts = Counter()
        row: dict[str, Any] = {
            "fleet/step": s.step,
            "fleet/world_size": s.world_size,
            "fleet/nodes": len(s.nodes),
            "fleet/nodes_training": sum(1 for st in s.nodes.values() if st in TRAINING),
            "fleet/preemptions": s.preemptions,
            "fleet/steps_lost": s.steps_lost,
            "fleet/spent_usd": round(s.spent_usd, 6),
            "fleet/saved_usd": round(s.saved_usd, 6),
        }
        if s.loss is not None:
            row["fleet/loss"] = s.loss
        for type_, key in FLEET_EVENTS.items():
            row[f"events/{key}"] = counts.get(type_, 0)
        row["events/backfills"] = sum(counts.get(t, 0) for t in BACKFILLS)
        self.tracker.log(row)

    def finish(self, s: Summary | None, *, timeout: float = 60.0) -> None:
        """Log the table of fleet events and the final figures; finish the run."""
        if not self.active:
            return
        try:
            rows = [_table_row(e) for _, e in self._events("-")]
            self.tracker.log_table("fleet_events", TABLE_COLUMNS, rows)
        except Exception as exc:
            self._warn(f"fleet events table not logged to wandb: {exc}")
        if s is not None:
            self.tracker.update_summary(
                {
                    "phase": s.phase,
                    "final_step": s.final_step if s.final_step is not None else s.step,
                    "preemptions": s.preemptions,
                    "steps_lost": s.steps_lost,
                    "spent_usd": round(s.spent_usd, 6),
                    "saved_usd": round(s.saved_usd, 6),
                }
            )
        failed = s is None or s.final_step is None
        self.tracker.finish(exit_code=1 if failed else 0, timeout=timeout)

    # -- the event stream -----------------------------------------------------------------
    def _new_events(self) -> list[tuple[str, dict[str, str]]]:
        """Fleet events after the logged position, which moves past them."""
        cursor = self.state.ctl().get(_CURSOR, stream.START)
        out: list[tuple[str, dict[str, str]]] = []
        last = cursor
        for eid, fields in self._events(cursor, limit=_PER_PASS):
            last = eid
            if fields.get("type") in FLEET_EVENTS:
                out.append((eid, fields))
        if last != cursor:
            self.state.set_ctl(**{_CURSOR: last})
        return out

    def _events(self, after: str, limit: int = 1_000_000) -> list[tuple[str, dict[str, str]]]:
        """Events after id ``after`` (``"-"``: all), oldest first; only fleet events when
        reading them all."""
        client, key = self.state.client, self.state.keys.events
        out: list[tuple[str, dict[str, str]]] = []
        start = after
        while len(out) < limit:
            batch = stream.read(client, key, after=start, count=_BATCH)
            for fields in batch:
                start = fields.pop("id")
                if after == "-" and fields.get("type") not in FLEET_EVENTS:
                    continue
                out.append((start, fields))
            if len(batch) < _BATCH:
                break
        return out

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", message)


def _table_row(e: dict[str, str]) -> list[Any]:
    known = {"type", "node", "at", "vm", "zone", "node_name"}
    detail = {k: v for k, v in e.items() if k not in known}
    return [
        float(e.get("at", "0") or 0),
        e.get("type", ""),
        e.get("node_name") or e.get("node", ""),
        e.get("vm", ""),
        e.get("zone", ""),
        json.dumps(detail, sort_keys=True) if detail else "",
    ]
