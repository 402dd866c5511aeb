"""The group controller's ledger fold, pure: members first seen, reborn under an old name,
and gone (removed by the controller, or taken by the cloud), with literals."""

from __future__ import annotations

from spottrain.cloud.base import Market, Offer
from spottrain.cloud.base.groups import GroupView, Member, MemberState
from spottrain.controller.groups.fold import ForgetAgent, Pricing, Unmark, fold_group
from spottrain.controller.reconcile.ledger import CountPreemption, Note, PutRecord
from spottrain.controller.reconcile.records import Ledger
from spottrain.protocol.states import LedgerStatus

NOW = 5_000.0
OFFER = Offer("aws", "us-east-1", "us-east-1a", "g5.xlarge", 1, "A10G", Market.SPOT, 0.5, 0.1)
PRICING = Pricing(lambda m: OFFER, lambda o: 1.0, "grp")


def member(id_: str, state: MemberState = MemberState.RUNNING) -> Member:
    return Member(id_, "us-east-1a", "g5.xlarge", state, str(state))


def view(*members: Member) -> GroupView:
    return GroupView("grp", len(members), members)


def test_a_member_first_seen_is_recorded_and_noted() -> None:
    ledger = Ledger({})
    out = fold_group(view(member("i-1")), NOW, ledger, {}, {}, PRICING)
    assert ledger.records == {}
    rec = out.ledger.records["i-1"]
    assert (rec.status, rec.reason, rec.od_price) == (
        LedgerStatus.LAUNCHED,
        "adopted from group grp",
        1.0,
    )
    assert out.steps == [
        PutRecord(rec),
        Note(
            "adopted", {"vm": "i-1", "node_name": "i-1", "zone": "us-east-1a", "itype": "g5.xlarge"}
        ),
    ]


def test_a_member_taken_by_the_cloud_is_a_preemption_and_its_agent_forgotten() -> None:
    first = fold_group(view(member("i-1")), NOW - 600, Ledger({}), {}, {}, PRICING)
    agents = {"i-1": {"state": "joined"}}
    out = fold_group(view(member("i-1", MemberState.GONE)), NOW, first.ledger, {}, agents, PRICING)
    rec = out.ledger.records["i-1"]
    assert (rec.status, rec.interrupted, rec.reason) == (LedgerStatus.ENDED, True, "gone")
    assert out.agents == {}
    assert out.steps == [
        PutRecord(rec),
        ForgetAgent("i-1"),
        CountPreemption(("aws", "us-east-1a", "g5.xlarge")),
        Note("preempted", {"vm": "i-1", "node_name": "i-1", "zone": "us-east-1a"}),
    ]


def test_a_removed_member_ends_without_a_preemption() -> None:
    first = fold_group(view(member("i-1")), NOW - 600, Ledger({}), {}, {}, PRICING)
    marks = {"i-1": {"removed_at": NOW - 5}}
    out = fold_group(view(), NOW, first.ledger, marks, {}, PRICING)
    rec = out.ledger.records["i-1"]
    assert (rec.status, rec.interrupted, rec.reason) == (LedgerStatus.ENDED, False, "removed")
    assert out.steps[-1] == Note("vm-ended", {"vm": "i-1", "node_name": "i-1", "reason": "removed"})


def test_a_member_replaced_in_place_is_archived_and_recorded_anew() -> None:
    first = fold_group(view(member("vm-a")), NOW - 600, Ledger({}), {}, {}, PRICING)
    marks = {"vm-a": {"removed_at": NOW - 60, "replace": True}}
    agents = {"vm-a": {"state": "booting", "registered_at": str(NOW - 5)}}
    out = fold_group(view(member("vm-a")), NOW, first.ledger, marks, agents, PRICING)
    archived = out.ledger.records[f"vm-a@{NOW - 600:.0f}"]
    assert (archived.status, archived.reason) == (LedgerStatus.ENDED, "replaced by group")
    fresh = out.ledger.records["vm-a"]
    assert (fresh.status, fresh.reason) == (LedgerStatus.LAUNCHED, "replaced by group in group grp")
    assert out.marks == {} and marks != {}
    assert out.steps == [
        PutRecord(archived),
        Unmark("vm-a"),
        Note("adopted", {"vm": "vm-a", "node_name": "vm-a", "why": "replaced by group"}),
        PutRecord(fresh),
    ]
