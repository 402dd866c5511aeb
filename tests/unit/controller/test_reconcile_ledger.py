"""The reconcile package's pure decisions beside ``plan``: the ledger's fold against what
the clouds list, the launches sent again, the bookkeeping, the actions' own fields, and
``end_run_vms`` (what ``spottrain down`` ends), all with literals and a fake cloud."""

from __future__ import annotations

from dataclasses import replace

from spottrain.cloud.base import Instance, InstanceState, Market, Offer
from spottrain.controller.reconcile.execute import end_run_vms
from spottrain.controller.reconcile.ledger import (
    FAILED_LAUNCHES,
    CountPreemption,
    EndDuplicate,
    GiveUp,
    Note,
    PutRecord,
    Resend,
    SetCtl,
    bookkeeping,
    fold_ledger,
    redrive,
)
from spottrain.controller.reconcile.planner import plan
from spottrain.controller.reconcile.records import LaunchRecord, Ledger
from spottrain.controller.reconcile.types import (
    FailedLaunches,
    Launch,
    NodeObs,
    Observed,
    Penalise,
    Policy,
)
from spottrain.protocol.states import LedgerStatus

NOW = 10_000.0
OFFER = Offer("aws", "us-east-1", "us-east-1a", "p4d.24xlarge", 8, "A100", Market.SPOT, 10.0, 0.1)


def inst(
    node: str,
    id_: str = "",
    state: InstanceState = InstanceState.RUNNING,
    request_id: str = "",
    interrupted: bool = False,
) -> Instance:
    return Instance(
        id=id_ or f"i-{node}",
        cloud="aws",
        region="us-east-1",
        zone="us-east-1a",
        instance_type="p4d.24xlarge",
        market=Market.SPOT,
        state=state,
        job="run",
        node=node,
        request_id=request_id or f"rq-{node}",
        interrupted=interrupted,
        state_reason="Spot interruption" if interrupted else "",
        launched_at=NOW - 100,
    )


def rec(
    node: str, status: str = LedgerStatus.LAUNCHED, launched_at: float = NOW - 600
) -> LaunchRecord:
    return LaunchRecord(
        node=node,
        request_id=f"rq-{node}",
        offer=OFFER,
        launched_at=launched_at,
        status=status,
        instance_id=f"i-{node}" if status != LedgerStatus.INTENT else "",
    )


def fold(ledger: Ledger, instances: list[Instance]) -> tuple[Ledger, list[object]]:
    out, steps = fold_ledger(ledger, instances, NOW, 120.0, lambda i: OFFER, lambda o: 30.0)
    return out, list(steps)


def test_an_unknown_vm_is_adopted_and_the_ledger_given_is_left_as_it_is() -> None:
    ledger = Ledger({})
    out, steps = fold(ledger, [inst("n3")])
    assert ledger.records == {}
    r = out.records["n3"]
    assert (r.status, r.instance_id, r.reason, r.od_price) == (
        LedgerStatus.LAUNCHED,
        "i-n3",
        "adopted",
        30.0,
    )
    assert steps == [PutRecord(r), Note("adopted", {"vm": "i-n3", "node_name": "n3"})]


def test_a_confirmed_intent_becomes_launched() -> None:
    out, steps = fold(Ledger({"n0": rec("n0", LedgerStatus.INTENT)}), [inst("n0")])
    assert out.records["n0"].status == LedgerStatus.LAUNCHED
    assert steps == [PutRecord(out.records["n0"])]


def test_a_preemption_is_recorded_counted_and_noted_once() -> None:
    out, steps = fold(
        Ledger({"n0": rec("n0")}),
        [inst("n0", state=InstanceState.TERMINATED, interrupted=True)],
    )
    r = out.records["n0"]
    assert (r.status, r.interrupted, r.ended_at) == (LedgerStatus.ENDED, True, NOW)
    assert steps == [
        PutRecord(r),
        CountPreemption(("aws", "us-east-1a", "p4d.24xlarge")),
        Note(
            "preempted",
            {"vm": "i-n0", "node_name": "n0", "zone": "us-east-1a", "reason": "Spot interruption"},
        ),
    ]
    # Folded again, an ended record stays ended: nothing more is written.
    _, again = fold(out, [inst("n0", state=InstanceState.TERMINATED, interrupted=True)])
    assert again == []


def test_a_vm_ended_by_the_controller_after_a_preemption_notice_counts_as_preempted() -> None:
    """The node drained on its cloud's notice and the controller ended the VM before the
    cloud reclaimed it: the cloud reports no interruption, the ledger still counts one."""
    noticed = replace(rec("n0"), interrupted=True, reason="preempted: terminate from aws-imds")
    out, steps = fold(Ledger({"n0": noticed}), [inst("n0", state=InstanceState.TERMINATED)])
    r = out.records["n0"]
    assert (r.status, r.interrupted) == (LedgerStatus.ENDED, True)
    assert CountPreemption(("aws", "us-east-1a", "p4d.24xlarge")) in steps
    (note,) = [s for s in steps if isinstance(s, Note)]
    assert note.fields["reason"] == "preempted: terminate from aws-imds"


def test_a_second_vm_for_one_node_is_ended_and_the_ledgers_kept() -> None:
    extra = inst("n0", id_="i-other", request_id="rq-other")
    out, steps = fold(Ledger({"n0": rec("n0")}), [inst("n0"), extra])
    assert out.records["n0"].instance_id == "i-n0"
    assert steps == [EndDuplicate("n0", extra, "a second VM for the same node")]


def test_a_vm_gone_from_the_listing_past_the_grace_vanished() -> None:
    out, steps = fold(Ledger({"n0": rec("n0"), "n1": rec("n1", launched_at=NOW - 10)}), [])
    assert out.records["n0"].status == LedgerStatus.ENDED and out.records["n0"].reason == "vanished"
    assert out.records["n1"].status == LedgerStatus.LAUNCHED  # within the grace
    assert steps == [
        PutRecord(out.records["n0"]),
        Note("vm-ended", {"vm": "i-n0", "node_name": "n0", "reason": "vanished"}),
    ]


def test_a_late_launch_is_counted_again() -> None:
    out, steps = fold(Ledger({"n0": rec("n0", LedgerStatus.FAILED)}), [inst("n0")])
    assert out.records["n0"].status == LedgerStatus.LAUNCHED
    assert steps[1] == Note("adopted", {"vm": "i-n0", "node_name": "n0", "why": "late launch"})


def test_redrive_resends_fresh_intents_with_the_policys_blocks_and_gives_up_old_ones() -> None:
    policy = Policy(min_nodes=1, max_nodes=2, block_s=60.0, refusal_block_s=3600.0)
    fresh = rec("n0", LedgerStatus.INTENT, launched_at=NOW - 10)
    ledger = Ledger({"n0": fresh, "n1": rec("n1", LedgerStatus.INTENT), "n2": rec("n2")})
    assert redrive(ledger, {}, NOW, policy) == [
        Resend(fresh, 60.0, 3600.0),
        GiveUp("n1", "launch never confirmed"),
    ]
    # A listed intent is folded by observe, not sent again.
    assert redrive(ledger, {"n0": inst("n0")}, NOW, policy) == [
        GiveUp("n1", "launch never confirmed")
    ]


def node(name: str, agent: str | None = "joined", trained: bool = False) -> NodeObs:
    n = NodeObs(name=name, instance=inst(name), offer=OFFER, launched_at=NOW - 600,
                agent_state=agent, alive_beat=True)  # fmt: skip
    return replace(n, trained=True) if trained else n


def test_bookkeeping_stamps_the_finish_once_and_ends_the_streak_on_a_node_that_trained() -> None:
    streak = FailedLaunches(2, "k", "n3: boot failed in 'x'", recent=("n2", "n3"))
    # Joined at the rendezvous is not training: workers that fail at every start join too.
    joined = Observed(now=NOW, nodes=[node("n0")], offers=[OFFER], failed=streak)
    assert bookkeeping(joined) == (joined, [])
    obs = Observed(
        now=NOW, nodes=[node("n0", trained=True)], offers=[OFFER], finished=True, failed=streak
    )
    seen, steps = bookkeeping(obs)
    # The streak ends, and still remembers which nodes it counted.
    assert (seen.finished_at, seen.failed) == (NOW, FailedLaunches(recent=("n2", "n3")))
    assert steps == [
        SetCtl({"finished_at": str(NOW)}),
        SetCtl({FAILED_LAUNCHES: seen.failed.to_json()}),
    ]
    assert bookkeeping(seen)[1] == []
    booting = replace(obs, nodes=[node("n0", "booting", trained=True)], finished=False)
    assert bookkeeping(booting) == (booting, [])


def test_the_planner_names_the_bad_node_and_sets_the_launch_blocks() -> None:
    policy = Policy(min_nodes=1, max_nodes=1, block_s=60.0, refusal_block_s=7200.0)
    obs = Observed(now=NOW, nodes=[node("n0", "failed")], offers=[OFFER], next_index=1)
    p = plan(policy, obs)
    (pen,) = p.of(Penalise)
    assert isinstance(pen, Penalise) and pen.node == "n0"
    (launch,) = p.of(Launch)
    assert isinstance(launch, Launch)
    assert (launch.node, launch.block_s, launch.refusal_block_s) == ("n1", 60.0, 7200.0)


class FakeCloud:
    """Lists the run's VMs; a terminated VM is listed as terminated from the next call on,
    unless it is stuck."""

    def __init__(self, vms: list[Instance], stuck: frozenset[str] = frozenset()) -> None:
        self.vms = {v.id: v for v in vms}
        self.stuck = stuck
        self.terminated: list[list[str]] = []

    def list(self, job: str) -> list[Instance]:
        assert job == "run"
        return list(self.vms.values())

    def terminate(self, ids: list[str]) -> None:
        self.terminated.append(list(ids))
        for i in ids:
            if i not in self.stuck:
                self.vms[i] = replace(self.vms[i], state=InstanceState.TERMINATED)


class Events:
    def __init__(self) -> None:
        self.rows: list[tuple[str, dict[str, object]]] = []

    def event(self, type_: str, **fields: object) -> None:
        self.rows.append((type_, fields))


def test_end_run_vms_ends_every_vm_listed_the_ended_ones_too_and_notes_each_once() -> None:
    # A VM listed as ended is ended again in the first round (a GCP VM that shut itself
    # down is billed for its disks until it is deleted); only live ones are noted.
    ended = inst("n1", state=InstanceState.TERMINATED)
    cloud = FakeCloud([inst("n0"), ended])
    events = Events()
    sleeps: list[float] = []
    left = end_run_vms(
        "run", {"aws": cloud}, events, 30.0, sleep=sleeps.append, monotonic=lambda: 0.0
    )  # type: ignore[arg-type]
    assert left == []
    assert cloud.terminated == [["i-n0", "i-n1"]]
    assert events.rows == [("terminate", {"vm": "i-n0", "node_name": "n0", "why": "down"})]
    assert sleeps == [1.0]


def test_end_run_vms_returns_what_is_still_there_at_the_deadline() -> None:
    cloud = FakeCloud([inst("n0")], stuck=frozenset({"i-n0"}))
    clock = iter([0.0, 0.5, 2.0])
    left = end_run_vms(
        "run", {"aws": cloud}, None, 1.0, sleep=lambda s: None, monotonic=lambda: next(clock)
    )  # type: ignore[arg-type]
    assert left == ["aws:i-n0 (running)"]
    assert cloud.terminated == [["i-n0"], ["i-n0"]]
