"""Which VM consoles the controller reads each pass (pure), and what it shows the planner of
what it read: with literals, no cloud."""

from __future__ import annotations

from dataclasses import replace

from spottrain.cloud.base import Instance, InstanceState, Market, Offer
from spottrain.controller.reconcile.consoles import ConsoleRead, ConsoleWatch
from spottrain.controller.reconcile.types import NodeObs
from spottrain.protocol.boot import STAGE_ENV, BootReport, BootSource, BootState

NOW = 100_000.0
TIMEOUT = 900.0
OFFER = Offer("aws", "us-east-1", "us-east-1a", "p4d.24xlarge", 8, "A100", Market.SPOT, 10.0, 0.1)


def vm(
    name: str,
    age: float,
    agent: str | None = None,
    boot: BootReport | None = None,
    state: InstanceState = InstanceState.RUNNING,
) -> NodeObs:
    inst = Instance(
        f"i-{name}", "aws", "us-east-1", "us-east-1a", "p4d.24xlarge", Market.SPOT, state,
        "run", name, f"rq-{name}",
    )  # fmt: skip
    return NodeObs(name, inst, OFFER, NOW - age, agent_state=agent, boot=boot)


def names(nodes: list[NodeObs]) -> list[str]:
    return [n.name for n in nodes]


def test_a_vm_is_read_once_it_has_said_nothing_for_a_minute() -> None:
    watch = ConsoleWatch()
    nodes = [vm("young", 30), vm("quiet", 61), vm("registered", 300, agent="healthy")]
    reported = BootReport("told", "i-told", STAGE_ENV, BootState.BOOTING, at=NOW - 10)
    nodes += [vm("told", 300, boot=reported), vm("gone", 300, state=InstanceState.TERMINATED)]
    assert names(watch.due(nodes, NOW, TIMEOUT)) == ["quiet"]


def test_the_same_vm_is_read_again_at_most_every_thirty_seconds() -> None:
    watch = ConsoleWatch()
    quiet = [vm("n1", 120)]
    watch.record({"n1": ConsoleRead(NOW - 10)})
    assert watch.due(quiet, NOW, TIMEOUT) == []
    watch.record({"n1": ConsoleRead(NOW - 30)})
    assert names(watch.due(quiet, NOW, TIMEOUT)) == ["n1"]


def test_a_pass_reads_a_bounded_number_of_consoles_never_read_ones_first() -> None:
    watch = ConsoleWatch(per_pass=16)
    fleet = [vm(f"n{i}", 120 + i % 7) for i in range(12_500)]
    watch.record({f"n{i}": ConsoleRead(NOW - 40) for i in range(100)})
    due = watch.due(fleet, NOW, TIMEOUT)
    assert len(due) == 16
    assert all(int(n.name[1:]) >= 100 for n in due), "a VM never read comes before one read"


def test_a_vm_at_the_boot_timeout_is_read_once_more_before_the_others() -> None:
    watch = ConsoleWatch(per_pass=2)
    late = vm("late", TIMEOUT + 1)
    watch.record({"late": ConsoleRead(NOW - 20)})  # read 20 s ago, before its timeout
    fleet = [vm("a", 120), vm("b", 120), late]
    assert names(watch.due(fleet, NOW, TIMEOUT)) == ["late", "a"]
    # Read at its timeout: not again.
    watch.record({"late": ConsoleRead(NOW)})
    assert "late" not in names(watch.due(fleet, NOW + 1, TIMEOUT))
    # A VM whose boot reports through Redis is still read once at its timeout.
    booting = BootReport("slow", "i-slow", STAGE_ENV, BootState.BOOTING, at=NOW - 600)
    assert names(watch.due([vm("slow", TIMEOUT + 5, boot=booting)], NOW, TIMEOUT)) == ["slow"]


def test_what_a_console_said_reaches_the_planner_and_is_forgotten_with_the_boot() -> None:
    watch = ConsoleWatch()
    failed = BootReport(
        "n1", "i-n1", STAGE_ENV, BootState.FAILED, "pip: no match", NOW, BootSource.CONSOLE
    )
    watch.record(
        {
            "n1": ConsoleRead(NOW, "spottrain-boot: n1 i-n1: failed in ...", failed),
            "n2": ConsoleRead(NOW, "[  12.3] cloud-init: running"),
        }
    )
    n1, n2, n3 = watch.annotate([vm("n1", 120), vm("n2", 120), vm("n3", 120)])
    assert n1.boot == failed and n1.console.startswith("spottrain-boot: n1")
    assert n2.boot is None and n2.console == "[  12.3] cloud-init: running"
    assert n3 == vm("n3", 120)
    # A VM whose own report says it failed keeps its report; one that registered is
    # forgotten.
    own = replace(failed, source=BootSource.VM, reason="its own words")
    (kept,) = watch.annotate([vm("n1", 130, boot=own)])
    assert kept.boot == own
    watch.record({"n2": ConsoleRead(NOW, "x")})
    assert watch.annotate([vm("n2", 130, agent="joined")])[0].console == ""
    assert watch.reads == {}
