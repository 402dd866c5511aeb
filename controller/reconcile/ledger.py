"""The ledger's decisions, pure like :func:`.planner.plan`: what the clouds list folded into
the launch ledger (adoptions, launches confirmed, ends, interruptions counted once, a
second VM for one node ended), launches to send again, and the controller's bookkeeping.

Each function returns the steps to take, in order; :mod:`.execute` takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from spottrain.cloud.base import Instance, InstanceState, Offer
from spottrain.protocol.states import LIVE_LAUNCHES, LedgerStatus

from .records import LaunchRecord, Ledger
from .types import Observed, Policy

# The field of the controller's hash that holds the give-up streak (JSON of FailedLaunches).
FAILED_LAUNCHES = "failed_launches"


@dataclass(frozen=True)
class PutRecord:
    """Write ``record`` to the ledger."""

    record: LaunchRecord


@dataclass(frozen=True)
class Note:
    """Add an event of ``type`` with ``fields`` to the run's stream."""

    type: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CountPreemption:
    """Count one preemption against (cloud, zone, instance type)."""

    key: tuple[str, str, str]


@dataclass(frozen=True)
class EndDuplicate:
    """End ``instance``, a second VM that claims ``node`` (the ledger keeps its own)."""

    node: str
    instance: Instance
    why: str


@dataclass(frozen=True)
class SetCtl:
    """Set fields of the controller's hash."""

    fields: Mapping[str, str]


@dataclass(frozen=True)
class Resend:
    """Send a recorded launch intent again (same request id), blocking its offer for
    ``block_s`` on a capacity error or ``refusal_block_s`` on a refusal."""

    record: LaunchRecord
    block_s: float
    refusal_block_s: float


@dataclass(frozen=True)
class GiveUp:
    """Mark ``node``'s launch failed: the cloud never confirmed it."""

    node: str
    reason: str


Step = PutRecord | Note | CountPreemption | EndDuplicate | SetCtl


def fold_ledger(
    ledger: Ledger,
    instances: Iterable[Instance],
    now: float,
    lost_grace_s: float,
    offer_for: Callable[[Instance], Offer],
    od_price: Callable[[Offer], float],
) -> tuple[Ledger, list[Step]]:
    """Fold what the clouds list into the ledger: adopt VMs it lacks, record launches and
    ends, count interruptions once. Returns the ledger after the fold (``ledger`` is left
    as it is) and the steps that write it."""
    out = Ledger(dict(ledger.records))
    steps: list[Step] = []
    by_node: dict[str, list[Instance]] = {}
    for inst in instances:
        by_node.setdefault(inst.node, []).append(inst)
    for node, insts in by_node.items():
        rec = out.records.get(node)
        if rec is None:
            # A VM of this run the ledger does not know (its record was lost): adopt it.
            rec = _adopt(insts[0], now, offer_for, od_price)
            steps += [PutRecord(rec), Note("adopted", {"vm": insts[0].id, "node_name": node})]
        out.records[node] = _fold_node(rec, insts, now, steps)
    for node, rec in list(out.records.items()):
        # Listed before, gone now: the cloud forgot it (a DELETE-on-preempt VM).
        if (
            rec.status == LedgerStatus.LAUNCHED
            and node not in by_node
            and now - rec.launched_at > lost_grace_s
        ):
            rec = replace(rec, status=LedgerStatus.ENDED, ended_at=now, reason="vanished")
            out.records[node] = rec
            steps += [
                PutRecord(rec),
                Note("vm-ended", {"vm": rec.instance_id, "node_name": node, "reason": "vanished"}),
            ]
    return out, steps


def _adopt(
    inst: Instance,
    now: float,
    offer_for: Callable[[Instance], Offer],
    od_price: Callable[[Offer], float],
) -> LaunchRecord:
    offer = offer_for(inst)
    return LaunchRecord(
        node=inst.node,
        request_id=inst.request_id,
        offer=offer,
        launched_at=inst.launched_at or now,
        status=LedgerStatus.LAUNCHED,
        instance_id=inst.id,
        od_price=od_price(offer),
        reason="adopted",
    )


def _fold_node(
    rec: LaunchRecord, insts: list[Instance], now: float, steps: list[Step]
) -> LaunchRecord:
    """One node's record against the VMs listed for it; appends the steps to ``steps``."""
    node = rec.node
    mine = [i for i in insts if i.request_id == rec.request_id] or insts
    inst = mine[0]
    if rec.status in (LedgerStatus.FAILED, LedgerStatus.ENDED) and inst.state.alive:
        # A VM the ledger gave up on runs after all (a late answer): count it again.
        rec = replace(rec, status=LedgerStatus.LAUNCHED, instance_id=inst.id, ended_at=None)
        steps += [
            PutRecord(rec),
            Note("adopted", {"vm": inst.id, "node_name": node, "why": "late launch"}),
        ]
    for extra in insts:
        if extra is not inst and extra.state.alive:
            # Two VMs claim one node: keep the ledger's, end the other.
            steps.append(EndDuplicate(node, extra, "a second VM for the same node"))
    if rec.status in LIVE_LAUNCHES and inst.state.alive:
        if rec.status == LedgerStatus.INTENT or rec.instance_id != inst.id:
            rec = replace(rec, status=LedgerStatus.LAUNCHED, instance_id=inst.id)
            steps.append(PutRecord(rec))
    elif rec.status in LIVE_LAUNCHES and inst.state is InstanceState.TERMINATED:
        # Interrupted as the cloud says, or as the node said before the controller ended it
        # (drained on a preemption notice: see Terminate.preempted).
        interrupted = inst.interrupted or rec.interrupted
        rec = replace(
            rec,
            status=LedgerStatus.ENDED,
            instance_id=inst.id,
            ended_at=now,
            interrupted=interrupted,
            reason=rec.reason or inst.state_reason,
        )
        steps.append(PutRecord(rec))
        if interrupted:
            key = (rec.offer.cloud, rec.offer.zone, rec.offer.instance_type)
            steps += [
                CountPreemption(key),
                Note(
                    "preempted",
                    {
                        "vm": inst.id,
                        "node_name": node,
                        "zone": rec.offer.zone,
                        "reason": inst.state_reason if inst.interrupted else rec.reason,
                    },
                ),
            ]
        else:
            steps.append(Note("vm-ended", {"vm": inst.id, "node_name": node, "reason": rec.reason}))
    return rec


def bookkeeping(obs: Observed) -> tuple[Observed, list[Step]]:
    """Stamp when training finished (once), and end the streak of VMs that failed before
    training (:class:`~.types.FailedLaunches`) once the job trains again
    (:meth:`~.types.FailedLaunches.ended_by`: a checkpoint committed past the streak's, or
    a node training for a while). Returns the observation as the planner sees it, and the
    steps."""
    steps: list[Step] = []
    if obs.finished and obs.finished_at is None:
        steps.append(SetCtl({"finished_at": str(obs.now)}))
        obs = replace(obs, finished_at=obs.now)
    if obs.failed.count and obs.failed.ended_by(
        obs.committed_step, sum(1 for n in obs.nodes if n.trains)
    ):
        failed = obs.failed.reset()
        steps.append(SetCtl({FAILED_LAUNCHES: failed.to_json()}))
        obs = replace(obs, failed=failed)
    return obs, steps


def redrive(
    ledger: Ledger, listed: Mapping[str, Instance], now: float, policy: Policy
) -> list[Resend | GiveUp]:
    """Send again every launch whose answer a killed controller never recorded; give up on
    one the cloud never confirmed within the grace (the planner replaces it, and a VM that
    shows up later is adopted)."""
    out: list[Resend | GiveUp] = []
    for rec in ledger.records.values():
        if rec.status != LedgerStatus.INTENT or rec.node in listed:
            continue
        if now - rec.launched_at > policy.lost_grace_s:
            out.append(GiveUp(rec.node, "launch never confirmed"))
        else:
            out.append(Resend(rec, policy.block_s, policy.refusal_block_s))
    return out
