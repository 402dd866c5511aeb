"""The run's figures from Redis alone: for the live view, ``spottrain status`` and the end
of ``spottrain up``."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from spottrain.protocol.boot import BootState
from spottrain.protocol.states import LEAVING, LIVE_LAUNCHES, NodeState, RunPhase
from spottrain.safetext import escape_controls

from .ledger import FAILED_LAUNCHES
from .records import Ledger
from .state import RunState
from .types import FailedLaunches

# The most booting nodes named one line each (the rest are counted in one more line).
BOOTING_LINES = 8
# A holder row this much older than the newest is a replica that stopped without leaving
# (the engine's own rule, agent/replica/holders.py, which the controller may not import).
STALE_S = 10.0


@dataclass
class ReplicaFigures:
    """A replica run's figures, from the rows each replica's rank 0 writes
    (``RunKeys.replica_holders``; a replica that died without leaving keeps its last row).

    ``discarded``: step attempts each replica threw away (a peer lost mid-step; the step is
    redone on the same samples, so no committed step is lost). ``longest_pause_s``: the
    longest gap between two consecutive steps a replica committed (``s - 1`` then ``s``), over
    every replica that reports it; None while none does. A joiner's wait before its first
    step is not a pause (it committed no step before), nor a gap across a restart."""

    replicas: int
    live: int
    quorum_id: int | None
    discarded: dict[str, int]
    longest_pause_s: float | None = None
    longest_pause_step: int | None = None

    @property
    def discarded_total(self) -> int:
        return sum(self.discarded.values())


@dataclass
class Summary:
    """What a run did, for the live view and the end of ``spottrain up``.

    Text a node wrote (an agent's state, the error a VM's boot reason went into) is escaped
    here (:func:`spottrain.safetext.escape_controls`): no field holds a control character.
    What the VMs say of their boot is kept apart (:func:`boot_lines`), as the replica
    figures are: these fields are the run's record (``status --json``, the archive's
    ``summary.json``) and stay as they were."""

    phase: str
    step: int
    loss: float | None
    world_size: int
    nodes: dict[str, str]
    preemptions: int
    steps_lost: int
    spent_usd: float
    saved_usd: float
    reason: str
    checkpoints: int = 0
    final_step: int | None = None
    at_risk: list[str] = field(default_factory=list)


def finished(state: RunState) -> bool:
    """Training is over: the SDK's ``finish`` reported it, or a final checkpoint landed."""
    return state.progress().get("finished") == "1" or state.ckpt_last().get("kind") == "final"


def _final_step(progress: dict[str, str], last: dict[str, str]) -> int | None:
    if progress.get("finished") == "1":
        return int(progress.get("final_step", progress.get("step", "0")))
    if last.get("kind") == "final":
        return int(last["step"])
    return None


COMPUTE_FRESH_S = 60.0  # a rank's compute report older than this is no longer its own


def node_compute_s(record: Mapping[str, str], now: float) -> float | None:
    """A node's compute seconds per step: its slowest local rank's recent median, from the
    ``compute:<local rank>`` fields its trainers write ("<seconds> <unix time>"). Reports
    older than ``COMPUTE_FRESH_S`` are left out (a rank that holds, or is gone)."""
    figures = []
    for k, v in record.items():
        if not k.startswith("compute:"):
            continue
        try:
            secs, at = (float(x) for x in v.split())
        except ValueError:
            continue
        if now - at <= COMPUTE_FRESH_S and math.isfinite(secs) and secs >= 0:
            figures.append(secs)
    return max(figures) if figures else None


def summarize(state: RunState, now: float) -> Summary:
    """The run's figures from Redis alone (``spottrain status`` uses it too)."""
    ctl = state.ctl()
    ledger = state.ledger()
    progress = state.progress()
    names = [r.node for r in ledger.records.values() if r.status in LIVE_LAUNCHES]
    agents = state.node_records(names)
    nodes = {}
    for r in sorted(ledger.records.values(), key=lambda r: r.launched_at):
        if r.status in LIVE_LAUNCHES:
            node_state = agents.get(r.node, {}).get("state", "launching")
            nodes[escape_controls(r.node)] = escape_controls(node_state)
    restores = state.restores()
    lost = sum(max(0, r.reached_step - r.restored_step) for r in restores)
    preempted = sum(1 for r in ledger.records.values() if r.interrupted)
    last = state.ckpt_last()
    loss = progress.get("loss")
    # Any node can write the run's Redis: what reaches a terminal is escaped here.
    phase = escape_controls(
        ctl.get("phase") or (RunPhase.STOPPING if ctl.get("stopping") else RunPhase.RUNNING)
    )
    final = _final_step(progress, last)
    return Summary(
        phase=phase,
        step=final if final is not None else int(float(progress.get("step", 0))),
        loss=float(loss) if loss else None,
        world_size=int(float(progress.get("world_size", 0))),
        nodes=nodes,
        preemptions=preempted,
        steps_lost=lost,
        spent_usd=ledger.spent(now),
        saved_usd=ledger.saved(now),
        reason=escape_controls(ctl.get("error") or ctl.get("reason", "")),
        final_step=final,
        at_risk=[escape_controls(line) for line in _at_risk_lines(ledger, agents)],
    )


@dataclass(frozen=True)
class BootLines:
    """What the VMs say of their boot, for ``status``, the plain lines and the live view,
    one escaped line each (:func:`boot_lines`).

    Attributes:
        failed: the failed-launch streak ("2 VM(s) in a row failed at boot; the last: ..."),
            the last lines of output of its last VM's workers when they crash-looped
            (``n4> ModuleNotFoundError: No module named 'x'``), and each live node whose
            boot reported a failure (its VM about to be ended).
        booting: the stage of each live node whose boot reports one (``n3: booting: fetch
            the code``), at most :data:`BOOTING_LINES` lines, the last counting the rest.
    """

    failed: list[str] = field(default_factory=list)
    booting: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [*self.failed, *self.booting]

    def to_json(self) -> dict[str, list[str]]:
        return {"failed": self.failed, "booting": self.booting}


# The node states of a summary (Summary.nodes) whose boot may still report.
_BOOTING_STATES = frozenset({"launching", NodeState.BOOTING})


def boot_lines(state: RunState, s: Summary) -> BootLines:
    """The boot lines of the run ``s`` summarises: the streak in the controller's hash and
    the boot hashes of its live nodes whose agent has not registered or still boots (one
    round trip)."""
    failed: list[str] = []
    streak = FailedLaunches.from_json(state.ctl().get(FAILED_LAUNCHES))
    if streak.count:
        when = "at boot" if streak.at_boot else "before training"
        failed.append(f"{streak.count} VM(s) in a row failed {when}; the last: {streak.last}")
        node = streak.last.split(":", 1)[0]
        failed.extend(f"{node}> {line}" for line in streak.tail)
    names = [n for n, st in s.nodes.items() if st in _BOOTING_STATES]
    reports = state.boot_reports(names) if names else {}
    booting: list[str] = []
    for name in names:
        report = reports.get(name)
        if report is None:
            continue
        if report.failed:
            failed.append(report.line())
        elif report.state is BootState.BOOTING:
            booting.append(report.line())
    if len(booting) > BOOTING_LINES:
        more = len(booting) - (BOOTING_LINES - 1)
        booting = [*booting[: BOOTING_LINES - 1], f"... {more} more nodes booting"]
    return BootLines([escape_controls(x) for x in failed], [escape_controls(x) for x in booting])


def replica_summary(state: RunState) -> ReplicaFigures | None:
    """A replica run's figures from Redis; None for an elastic run. Kept apart from
    :class:`Summary`, whose fields are the elastic run's record (``status --json``, the
    archive's ``summary.json``) and stay as they were."""
    return replica_figures(state.client.hgetall(state.keys.replica_holders))


def summary_record(s: Summary, replica: ReplicaFigures | None) -> dict[str, Any]:
    """The summary as a record (``summary.json``, ``status --json``): a replica run's adds
    ``replica``, an elastic run's is exactly ``asdict(s)``."""
    out = asdict(s)
    if replica is not None:
        out["replica"] = {**asdict(replica), "discarded_total": replica.discarded_total}
    return out


def _order(replica_id: str) -> tuple[int, str]:
    """replica-2 before replica-10."""
    m = re.search(r"(\d+)$", replica_id)
    return (int(m.group(1)) if m else -1, replica_id)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def replica_figures(rows: Mapping[str | bytes, str | bytes]) -> ReplicaFigures | None:
    """The replica figures from the holder rows; None for an elastic run (no rows). A row
    that does not parse is left out (``status`` must never break on one)."""
    parsed: dict[str, dict[str, Any]] = {}
    for k, v in rows.items():
        try:
            body = json.loads(v)
        except (TypeError, ValueError):
            continue
        if isinstance(body, dict):
            parsed[k.decode() if isinstance(k, bytes) else k] = body
    if not parsed:
        return None
    discarded: dict[str, int] = {}
    quorum: int | None = None
    pause: tuple[float, int | None] | None = None
    for rid in sorted(parsed, key=_order):
        body = parsed[rid]
        discarded[rid] = int(_number(body.get("discarded")) or 0)
        q = _number(body.get("quorum_id"))
        if q is not None and q >= 0:
            quorum = max(quorum or 0, int(q))
        gap = _number(body.get("longest_gap_s"))
        if gap is not None and (pause is None or gap > pause[0]):
            at_step = _number(body.get("longest_gap_step"))
            pause = (gap, int(at_step) if at_step is not None else None)
    # Live: a live row written within STALE_S of the newest row (a replica killed without
    # leaving keeps its "live" row, which stops moving).
    newest = max((_number(b.get("at")) or 0.0 for b in parsed.values()), default=0.0)
    return ReplicaFigures(
        replicas=len(parsed),
        live=sum(
            1
            for b in parsed.values()
            if b.get("state") == "live" and (_number(b.get("at")) or 0.0) >= newest - STALE_S
        ),
        quorum_id=quorum,
        discarded=discarded,
        longest_pause_s=pause[0] if pause else None,
        longest_pause_step=pause[1] if pause else None,
    )


def replica_lines(r: ReplicaFigures) -> list[str]:
    """The end-of-run lines of a replica run (after ``steps lost``), aligned with them."""
    per = ", ".join(f"{k} {v}" for k, v in r.discarded.items() if v)
    pause = "not reported by the replicas"
    if r.longest_pause_s is not None:
        where = f" (at step {r.longest_pause_step})" if r.longest_pause_step else ""
        pause = f"{r.longest_pause_s:.2f} s{where}"
    return [
        f"  discarded attempts     {r.discarded_total}" + (f" ({per})" if per else ""),
        f"  longest pause          {pause}",
        f"  replicas               {r.replicas} ({r.live} live), quorum id {r.quorum_id}",
    ]


def _at_risk_lines(ledger: Ledger, agents: Mapping[str, Mapping[str, str]]) -> list[str]:
    """One line per live node at risk of preemption, and how its replacement is doing."""
    live = {r.node: r for r in ledger.records.values() if r.status in LIVE_LAUNCHES}
    by_target = {r.replaces: r.node for r in live.values() if r.replaces}
    lines = []
    for node in sorted(live):
        why = agents.get(node, {}).get("at_risk")
        state = agents.get(node, {}).get("state")
        if not why or state in LEAVING:
            continue
        r = by_target.get(node)
        if r is None:
            lines.append(f"{node} at risk ({why}): no replacement launched yet")
        else:
            lines.append(
                f"{node} at risk ({why}): replacement {r} "
                f"{agents.get(r, {}).get('state') or 'launching'}"
            )
    return lines
