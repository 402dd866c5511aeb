"""The group controller's ledger decisions, pure: the group's members folded into the launch
ledger (members first seen recorded, a VM reborn under an old name archived and recorded
anew, members gone ended, an end the controller did not ask for counted as a preemption).

:func:`fold_group` returns the steps; :class:`~.controller.GroupController` takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from spottrain.cloud.base import Market, Offer
from spottrain.cloud.base.groups import GroupView, Member, MemberState
from spottrain.protocol.states import LedgerStatus

from ..reconcile.ledger import CountPreemption, Note, PutRecord
from ..reconcile.records import LaunchRecord, Ledger


@dataclass(frozen=True)
class Unmark:
    """Drop the controller's marks (drain asked, removed) of a member."""

    member_id: str


@dataclass(frozen=True)
class ForgetAgent:
    """Delete a gone VM's agent record and heartbeat: its agent's last state must not be
    read as the state of a VM the group brings back under the same name."""

    node: str


GroupStep = PutRecord | Note | CountPreemption | Unmark | ForgetAgent


@dataclass
class Folded:
    """The ledger, marks and agent records after the fold, and the steps that write it."""

    ledger: Ledger
    marks: dict[str, dict[str, Any]]
    agents: dict[str, dict[str, str]]
    steps: list[GroupStep]


@dataclass(frozen=True)
class Pricing:
    """How the fold prices a member: its offer, and the on-demand price of an offer."""

    offer_of: Callable[[Member], Offer]
    od_price: Callable[[Offer], float]
    group_name: str


def fold_group(
    view: GroupView,
    now: float,
    ledger: Ledger,
    marks: Mapping[str, dict[str, Any]],
    agents: Mapping[str, dict[str, str]],
    pricing: Pricing,
) -> Folded:
    """Record members first seen, and end the records of members gone; a member that went
    without the controller removing it was taken by the cloud (a preemption). The inputs
    are left as they are."""
    out = Folded(Ledger(dict(ledger.records)), dict(marks), dict(agents), [])
    for m in view.members:
        rec = out.ledger.records.get(m.id)
        mark = out.marks.get(m.id, {})
        # A replaced member's agent record is deleted when it is removed, so a record
        # registered since is the new VM's agent (GCP recreates members by name).
        registered_anew = bool(mark.get("replace")) and "registered_at" in out.agents.get(m.id, {})
        if rec is None and m.state.alive:
            rec = _new_record(m, now, f"adopted from group {view.name}", pricing, out)
            out.steps.append(
                Note(
                    "adopted",
                    {"vm": m.id, "node_name": m.id, "zone": m.zone, "itype": m.instance_type},
                )
            )
        elif rec is not None and rec.status == LedgerStatus.ENDED and m.state.alive:
            rec = _reincarnated(m, rec, now, "restarted by group", pricing, out)
        elif rec is not None and mark.get("removed_at") is not None and registered_anew:
            # An agent registered after the removal: the group replaced the VM in place.
            rec = _reincarnated(m, rec, now, "replaced by group", pricing, out)
        else:
            continue
        out.ledger.records[m.id] = rec
    _end_gone(view, now, out)
    return out


def _new_record(m: Member, now: float, why: str, pricing: Pricing, out: Folded) -> LaunchRecord:
    offer = pricing.offer_of(m)
    rec = LaunchRecord(
        node=m.id,
        request_id=m.id,
        offer=offer,
        launched_at=now,
        status=LedgerStatus.LAUNCHED,
        instance_id=m.id,
        od_price=pricing.od_price(offer),
        reason=why,
    )
    out.steps.append(PutRecord(rec))
    return rec


def _reincarnated(
    m: Member, rec: LaunchRecord, now: float, why: str, pricing: Pricing, out: Folded
) -> LaunchRecord:
    """A new VM under an old name (a GCP MIG recreates members by name): the old VM's
    record is kept under ``<name>@<launch time>`` so its cost still counts, and the name
    starts a new record."""
    old = (
        rec
        if rec.status == LedgerStatus.ENDED
        else replace(rec, status=LedgerStatus.ENDED, ended_at=now, reason=why)
    )
    archived = replace(old, node=f"{m.id}@{old.launched_at:.0f}")
    out.ledger.records[archived.node] = archived
    out.marks.pop(m.id, None)
    out.steps += [
        PutRecord(archived),
        Unmark(m.id),
        Note("adopted", {"vm": m.id, "node_name": m.id, "why": why}),
    ]
    return _new_record(m, now, f"{why} in group {pricing.group_name}", pricing, out)


def _end_gone(view: GroupView, now: float, out: Folded) -> None:
    listed = {m.id: m for m in view.members}
    for node, rec in list(out.ledger.records.items()):
        if rec.status != LedgerStatus.LAUNCHED:
            continue
        seen = listed.get(node)
        if seen is not None and seen.state is not MemberState.GONE:
            continue
        removed = out.marks.get(node, {}).get("removed_at") is not None
        interrupted = not removed and rec.offer.market is Market.SPOT
        rec = replace(
            rec,
            status=LedgerStatus.ENDED,
            ended_at=now,
            interrupted=interrupted,
            reason="removed" if removed else (seen.status if seen else "gone"),
        )
        out.ledger.records[node] = rec
        out.agents.pop(node, None)
        out.steps += [PutRecord(rec), ForgetAgent(node)]
        if interrupted:
            key = (rec.offer.cloud, rec.offer.zone, rec.offer.instance_type)
            out.steps += [
                CountPreemption(key),
                Note("preempted", {"vm": node, "node_name": node, "zone": rec.offer.zone}),
            ]
        else:
            out.steps.append(
                Note("vm-ended", {"vm": node, "node_name": node, "reason": rec.reason})
            )
