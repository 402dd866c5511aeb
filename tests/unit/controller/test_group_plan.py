"""The group planner's rules, with literals: no cloud, no Redis, no clock."""

from __future__ import annotations

from spottrain.cloud.base.groups import Member, MemberState
from spottrain.controller.groups.plan import (
    DrainMember,
    GroupObserved,
    GroupPolicy,
    MemberObs,
    ReleaseMember,
    RemoveMembers,
    SetTarget,
    StopRun,
    plan_group,
)

NOW = 10_000.0
POLICY = GroupPolicy(min_nodes=1, max_nodes=4, budget_usd=100.0)


def m(
    id_: str,
    agent: str | None = "joined",
    *,
    state: MemberState = MemberState.RUNNING,
    beat: bool = True,
    seen: float = NOW - 600,
    drain_at: float | None = None,
    removed_at: float | None = None,
    hook: bool = False,
) -> MemberObs:
    return MemberObs(
        member=Member(id_, "us-east-1a", "p5.48xlarge", state, state.value, waiting_on_hook=hook),
        agent_state=agent,
        alive_beat=beat,
        first_seen=seen,
        drain_asked_at=drain_at,
        removed_at=removed_at,
    )


def obs(
    *members: MemberObs, wanted: int = 3, target: int | None = None, **kw: object
) -> GroupObserved:
    return GroupObserved(
        now=NOW,
        wanted=wanted,
        group_target=len(members) if target is None else target,
        members=members,
        **kw,  # type: ignore[arg-type]
    )


def test_a_fleet_at_the_wanted_size_is_left_alone() -> None:
    p = plan_group(POLICY, obs(m("a"), m("b"), m("c")))
    assert p.actions == ()
    assert p.reason == "group 3 VMs (3 training), size 3, wanted 3 (min 1)"


def test_fewer_than_wanted_raises_the_size_and_never_past_max_nodes() -> None:
    assert plan_group(POLICY, obs(m("a"), wanted=3)).actions == (SetTarget(3, "grow to 3"),)
    assert plan_group(POLICY, obs(m("a"), wanted=9)).of(SetTarget) == [SetTarget(4, "grow to 4")]
    capped = plan_group(POLICY, obs(m("a"), wanted=4, max_size=2))
    assert capped.of(SetTarget) == [SetTarget(2, "grow to 2")]


def test_scale_in_drains_a_training_victim_and_does_not_remove_it_yet() -> None:
    p = plan_group(POLICY, obs(m("a", seen=1), m("b", seen=3), m("c", seen=2), wanted=2))
    # The newest goes: older nodes hold warm caches.
    assert p.actions == (DrainMember("b", "scale-in"),)


def test_scale_in_prefers_a_drained_node_and_removes_it_lowering_the_size() -> None:
    p = plan_group(POLICY, obs(m("a", seen=1), m("b", "left", seen=0), m("c", seen=2), wanted=2))
    assert p.of(RemoveMembers) == [RemoveMembers(("b",), replace=False, why="scale-in to 2")]
    assert p.of(ReleaseMember) == [ReleaseMember("b", "agent left")]
    assert not p.of(DrainMember) and not p.of(SetTarget)


def test_scale_in_prefers_a_node_that_is_not_training_over_the_newest() -> None:
    p = plan_group(POLICY, obs(m("a", "healthy", seen=1), m("b", seen=3), m("c", seen=2), wanted=2))
    assert p.of(RemoveMembers) == [RemoveMembers(("a",), replace=False, why="scale-in to 2")]


def test_a_victim_is_removed_once_its_agent_left_or_after_the_drain_timeout() -> None:
    asked = NOW - 10
    draining = obs(m("a"), m("b", "draining", drain_at=asked), m("c"), wanted=2)
    assert plan_group(POLICY, draining).actions == ()
    left = obs(m("a"), m("b", "left", drain_at=asked), m("c"), wanted=2)
    assert plan_group(POLICY, left).of(RemoveMembers)[0].ids == ("b",)
    late = obs(m("a"), m("b", "draining", drain_at=NOW - 301), m("c"), wanted=2)
    p = plan_group(POLICY, late)
    assert p.of(RemoveMembers)[0].ids == ("b",)
    assert "b did not leave within 300 s" in p.reason


def test_the_chosen_victim_stays_chosen_even_if_another_looks_cheaper_later() -> None:
    p = plan_group(
        POLICY, obs(m("a", "healthy"), m("b", "draining", drain_at=NOW - 5), m("c"), wanted=2)
    )
    assert p.actions == ()


def test_a_spent_node_the_job_still_wants_is_replaced_keeping_the_size() -> None:
    p = plan_group(POLICY, obs(m("a"), m("b", "failed"), m("c")))
    assert p.of(RemoveMembers) == [
        RemoveMembers(("b",), replace=True, why="replace spent or broken VM")
    ]
    assert p.of(ReleaseMember) == [ReleaseMember("b", "agent failed")]
    assert not p.of(SetTarget)


def test_a_silent_agent_or_one_that_never_came_up_marks_a_broken_vm() -> None:
    silent = plan_group(POLICY, obs(m("a"), m("b", beat=False, seen=NOW - 121), m("c")))
    assert silent.of(RemoveMembers)[0].ids == ("b",)
    young = plan_group(POLICY, obs(m("a"), m("b", beat=False, seen=NOW - 60), m("c")))
    assert young.actions == ()
    never = plan_group(POLICY, obs(m("a"), m("b", None, seen=NOW - 1201), m("c")))
    assert never.of(RemoveMembers)[0].ids == ("b",)
    booting = plan_group(POLICY, obs(m("a"), m("b", None, seen=NOW - 600), m("c")))
    assert booting.actions == ()


def test_a_held_vm_is_released_only_when_its_agent_cannot_release_it() -> None:
    draining = m("b", "draining", state=MemberState.LEAVING, hook=True)
    assert not plan_group(POLICY, obs(m("a"), draining, m("c"), target=3)).of(ReleaseMember)
    for agent, beat in (("left", True), ("failed", True), (None, False), ("joined", False)):
        held = m("b", agent, state=MemberState.LEAVING, hook=True, beat=beat)
        p = plan_group(POLICY, obs(m("a"), held, m("c"), target=3))
        assert [a.id for a in p.of(ReleaseMember)] == ["b"], agent


def test_unfilled_size_is_shed_without_giving_the_group_a_victim() -> None:
    # Size 4 but only 2 VMs (the cloud cannot fill the rest) and the job wants 2 now.
    p = plan_group(POLICY, obs(m("a"), m("b"), wanted=2, target=4))
    assert p.actions == (SetTarget(2, "shed launches the cloud has not filled"),)
    # Never below what runs: 3 VMs, 1 removed this pass, the job wants 1.
    p = plan_group(POLICY, obs(m("a", "left"), m("b"), m("c"), wanted=1, target=5))
    removed = p.of(RemoveMembers)[0]
    assert isinstance(removed, RemoveMembers) and len(removed.ids) == 1
    assert p.of(SetTarget) == [SetTarget(2, "shed launches the cloud has not filled")]


def test_members_already_removed_or_gone_do_not_count() -> None:
    p = plan_group(
        POLICY,
        obs(
            m("a"),
            m("b", "left", state=MemberState.LEAVING, removed_at=NOW - 5),
            m("c", state=MemberState.GONE),
            m("d"),
            wanted=3,
            target=3,
        ),
    )
    assert p.actions == () and p.active == 2


def test_a_finished_run_removes_every_vm_whose_agent_left() -> None:
    p = plan_group(POLICY, obs(m("a", "left"), m("b", "left"), finished=True))
    assert p.of(RemoveMembers) == [RemoveMembers(("a", "b"), replace=False, why="run ending")]
    assert p.wanted == 0 and p.reason.endswith("ending: finished")


def test_the_budget_stops_the_run_by_draining_everyone() -> None:
    p = plan_group(POLICY, obs(m("a"), m("b"), spent_usd=100.0))
    assert p.actions[0] == StopRun("budget: $100.00 spent of $100.00", error=True)
    assert p.of(DrainMember) == [DrainMember("a", "run ending"), DrainMember("b", "run ending")]
    assert not p.of(RemoveMembers)
