"""The run's figures from Redis alone: for the live view, ``spottrain status`` and the end
of ``spottrain up``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from spottrain.protocol.states import LEAVING, LIVE_LAUNCHES, RunPhase

from .records import Ledger
from .state import RunState


@dataclass
class Summary:
    """What a run did, for the live view and the end of ``spottrain up``."""

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
            nodes[r.node] = agents.get(r.node, {}).get("state", "launching")
    restores = state.restores()
    lost = sum(max(0, r.reached_step - r.restored_step) for r in restores)
    preempted = sum(1 for r in ledger.records.values() if r.interrupted)
    last = state.ckpt_last()
    loss = progress.get("loss")
    phase = ctl.get("phase") or (RunPhase.STOPPING if ctl.get("stopping") else RunPhase.RUNNING)
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
        reason=ctl.get("error") or ctl.get("reason", ""),
        final_step=final,
        at_risk=_at_risk_lines(ledger, agents),
    )


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
