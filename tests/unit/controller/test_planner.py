"""The planner, one decision per test, with literals and no I/O."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from spec_samples import VALID, spec_with

from spottrain.cloud.base import Instance, InstanceState, Market, Offer
from spottrain.controller.reconcile.controller import policy_from_spec
from spottrain.controller.reconcile.fleet import FleetIndex
from spottrain.controller.reconcile.planner import plan
from spottrain.controller.reconcile.pricing import effective_price
from spottrain.controller.reconcile.rules import request_id
from spottrain.controller.reconcile.types import (
    Block,
    Drain,
    FailedLaunch,
    FailedLaunches,
    Launch,
    LaunchFailed,
    Move,
    NodeObs,
    Observed,
    Penalise,
    Policy,
    Report,
    Restore,
    Stop,
    StragglerPolicy,
    Terminate,
    ZoneHistory,
)
from spottrain.protocol.boot import (
    STAGE_CODE,
    STAGE_ENV,
    STAGE_IMAGE,
    BootReport,
    BootState,
    reason_key,
)
from spottrain.spec import SpotPolicy, parse_spec

NOW = 10_000.0


def offer(
    zone: str = "us-east-1a",
    price: float = 10.0,
    market: Market = Market.SPOT,
    itype: str = "p4d.24xlarge",
    risk: float = 0.1,
    cloud: str = "aws",
) -> Offer:
    return Offer(
        cloud=cloud,
        region=zone[:-1] if cloud == "aws" else zone.rsplit("-", 1)[0],
        zone=zone,
        instance_type=itype,
        gpus=8,
        gpu_type="A100",
        market=market,
        price_per_hour=price,
        interruption_risk=risk if market is Market.SPOT else 0.0,
    )


A_SPOT = offer("us-east-1a", 10.0)
B_SPOT = offer("us-east-1b", 12.0)
A_OD = offer("us-east-1a", 30.0, Market.ON_DEMAND)
OFFERS = (A_SPOT, B_SPOT, A_OD)


def node(
    name: str,
    o: Offer = A_SPOT,
    state: InstanceState = InstanceState.RUNNING,
    agent: str | None = "joined",
    launched_at: float = NOW - 600,
    step_time: float | None = None,
    interrupted: bool = False,
    listed: bool = True,
    health_failed: bool = False,
    trained: bool | None = None,
) -> NodeObs:
    """A node; one in a round (joined, checkpointing) has trained for a while unless
    ``trained`` says otherwise."""
    inst = Instance(
        id=f"i-{name}",
        cloud=o.cloud,
        region=o.region,
        zone=o.zone,
        instance_type=o.instance_type,
        market=o.market,
        state=state,
        job="job",
        node=name,
        request_id=request_id("job", name),
        interrupted=interrupted,
    )
    return NodeObs(
        name=name,
        instance=inst if listed else None,
        offer=o,
        launched_at=launched_at,
        agent_state=agent,
        alive_beat=agent is not None,
        compute_s=step_time,
        health_failed=health_failed,
        trained=agent in ("joined", "checkpointing") if trained is None else trained,
    )


def observed(**kw: object) -> Observed:
    base: dict[str, object] = {"now": NOW, "nodes": (), "offers": OFFERS, "next_index": 0}
    base.update(kw)
    return Observed(**base)  # type: ignore[arg-type]


def launches(p: object) -> list[Launch]:
    return [a for a in p.actions if isinstance(a, Launch)]  # type: ignore[attr-defined]


def terminates(p: object) -> list[Terminate]:
    return [a for a in p.actions if isinstance(a, Terminate)]  # type: ignore[attr-defined]


def test_plan_launches_the_cheapest_offer_up_to_max_nodes() -> None:
    p = plan(Policy(min_nodes=2, max_nodes=3), observed())
    assert [(a.node, a.offer) for a in launches(p)] == [
        ("n0", A_SPOT),
        ("n1", A_SPOT),
        ("n2", A_SPOT),
    ]
    assert p.next_index == 3
    assert p.home == ("aws", "us-east-1a", "p4d.24xlarge")
    assert "launching 3 on us-east-1a p4d.24xlarge spot" in p.reason


def test_plan_request_ids_are_stable_per_node_and_unique_per_run() -> None:
    p1 = plan(Policy(1, 1), observed(job_tag="run-a-1795000000"))
    p2 = plan(Policy(1, 1), observed(job_tag="run-a-1795000000"))
    p3 = plan(Policy(1, 1), observed(job_tag="run-b-1795000000"))
    assert launches(p1)[0].request_id == launches(p2)[0].request_id
    assert launches(p1)[0].request_id != launches(p3)[0].request_id


def test_plan_weighs_the_bundled_interruption_band() -> None:
    # Same price; the riskier band loses once a preemption's fleet-wide stall is priced in.
    safe = offer("us-east-1b", 10.0, risk=0.025)
    risky = offer("us-east-1a", 10.0, risk=0.25)
    p = plan(Policy(1, 1), observed(offers=(risky, safe)))
    assert launches(p)[0].offer == safe


def test_plan_refines_risk_with_the_jobs_own_preemptions() -> None:
    # A is cheaper, but this job saw 30 preemptions in 10 node-hours there: each stalls the
    # 8-node fleet for 2 minutes, which costs more than zone b's extra $2/h.
    history = {("aws", "us-east-1a", "p4d.24xlarge"): ZoneHistory(preemptions=30, node_hours=10)}
    policy = Policy(1, 8)
    assert effective_price(A_SPOT, policy, history) > effective_price(B_SPOT, policy, history)
    p = plan(Policy(1, 8), observed(history=history))
    assert {a.offer for a in launches(p)} == {B_SPOT}
    # Without that history, A wins.
    assert {a.offer for a in launches(plan(Policy(1, 8), observed()))} == {A_SPOT}


def test_plan_keeps_backfills_in_the_jobs_zone_and_type() -> None:
    # The job lives in zone b; a cheaper offer in zone a does not split it.
    nodes = (
        node("n0", B_SPOT),
        node("n1", B_SPOT, state=InstanceState.TERMINATED, interrupted=True),
    )
    p = plan(
        Policy(1, 2),
        observed(nodes=nodes, next_index=2, home=("aws", "us-east-1b", "p4d.24xlarge")),
    )
    assert [a.offer for a in launches(p)] == [B_SPOT]
    assert terminates(p) == []


def test_plan_spreads_across_zones_when_the_spec_asks() -> None:
    p = plan(Policy(1, 4, same_zone=False), observed())
    zones = sorted(a.offer.zone for a in launches(p))
    assert zones == ["us-east-1a", "us-east-1a", "us-east-1b", "us-east-1b"]


def test_plan_avoids_a_blocked_offer_until_the_block_expires() -> None:
    blocked = {A_SPOT.key: NOW + 60}
    p = plan(Policy(1, 1), observed(blocked=blocked))
    assert launches(p)[0].offer == B_SPOT
    expired = {A_SPOT.key: NOW - 1}
    assert launches(plan(Policy(1, 1), observed(blocked=expired)))[0].offer == A_SPOT


def test_plan_moves_the_whole_job_when_its_zone_cannot_hold_the_minimum() -> None:
    home = ("aws", "us-east-1a", "p4d.24xlarge")
    nodes = (node("n0", A_SPOT),)
    blocked = {A_SPOT.key: NOW + 600}
    policy = Policy(min_nodes=2, max_nodes=2, move_after_s=300)
    # Short for less than the limit: wait (nothing launches elsewhere).
    early = plan(
        policy, observed(nodes=nodes, home=home, blocked=blocked, below_min_since=NOW - 100)
    )
    assert early.of(Move) == [] and launches(early) == []
    # Past the limit: move to zone b.
    late = plan(
        policy, observed(nodes=nodes, home=home, blocked=blocked, below_min_since=NOW - 301)
    )
    (move,) = late.of(Move)
    assert isinstance(move, Move) and move.to == B_SPOT
    assert late.home == ("aws", "us-east-1b", "p4d.24xlarge")
    assert "moving the job to aws us-east-1b" in late.reason


@pytest.mark.parametrize(
    ("copy_to", "moves"), [(None, False), ("s3://acme/ckpt", True)], ids=["no-copy", "copy"]
)
def test_a_job_whose_checkpoints_are_not_copied_does_not_move(
    copy_to: str | None, moves: bool
) -> None:
    # Without checkpoint.copy_to the new zone's volumes hold nothing of the job (or an older
    # checkpoint): the job stays and the reason says why, instead of silently restarting.
    data = spec_with(VALID, "resources.clouds", ["aws"])
    data = spec_with(data, "resources.regions", ["us-east-1"])
    data = spec_with(data, "resources.instance_types", ["p4d.24xlarge"])
    data = spec_with(data, "gcp", ...)
    data = spec_with(data, "checkpoint.copy_to", copy_to or ...)
    policy = replace(
        policy_from_spec(parse_spec(yaml.safe_dump(data)).spec),
        min_nodes=2,
        max_nodes=2,
        move_after_s=300,
    )
    assert policy.copies_checkpoints is moves
    home = ("aws", "us-east-1a", "p4d.24xlarge")
    late = plan(
        policy,
        observed(
            nodes=(node("n0", A_SPOT),),
            home=home,
            blocked={A_SPOT.key: NOW + 600},
            below_min_since=NOW - 301,
        ),
    )
    if moves:
        assert [m.to for m in late.of(Move) if isinstance(m, Move)] == [B_SPOT]
    else:
        assert late.of(Move) == [] and launches(late) == []
        assert late.home == home
        assert (
            "zone us-east-1a is short but the job stays: a move to aws us-east-1b would start "
            "from whatever its volumes hold, not the job's checkpoint (set checkpoint.copy_to "
            "to let the job move)"
        ) in late.reason


def test_plan_does_not_move_while_the_home_zone_is_open() -> None:
    home = ("aws", "us-east-1a", "p4d.24xlarge")
    p = plan(
        Policy(min_nodes=2, max_nodes=2, move_after_s=300),
        observed(nodes=(node("n0"),), home=home, below_min_since=NOW - 1000, next_index=1),
    )
    assert p.of(Move) == []
    assert [a.offer for a in launches(p)] == [A_SPOT]


def test_plan_falls_back_to_on_demand_after_the_spot_drought() -> None:
    policy = Policy(1, 1, spot_policy=SpotPolicy.SPOT_THEN_ON_DEMAND, fallback_after_s=600)
    blocked = {A_SPOT.key: NOW + 600, B_SPOT.key: NOW + 600}
    early = plan(policy, observed(blocked=blocked, spot_short_since=NOW - 100))
    assert launches(early) == [] and "no open offer" in early.reason
    late = plan(policy, observed(blocked=blocked, spot_short_since=NOW - 601))
    assert [a.offer for a in launches(late)] == [A_OD]
    # Spot policy "spot" never falls back; "on-demand" never uses spot.
    assert launches(plan(Policy(1, 1), observed(blocked=blocked, spot_short_since=0))) == []
    od = plan(Policy(1, 1, spot_policy=SpotPolicy.ON_DEMAND), observed())
    assert [a.offer for a in launches(od)] == [A_OD]


def test_plan_prefers_spot_again_when_it_comes_back() -> None:
    policy = Policy(1, 1, spot_policy=SpotPolicy.SPOT_THEN_ON_DEMAND, fallback_after_s=600)
    p = plan(policy, observed(spot_short_since=NOW - 601))
    assert [a.offer for a in launches(p)] == [A_SPOT]


def test_plan_stops_launching_before_the_budget_projection_breaks_the_cap() -> None:
    # $10/h each; $75 spent; cap $100: one more node projects 75 + 10 + 10 = 95 <= 100,
    # a second 105 > 100.
    nodes = (node("n0"),)
    p = plan(Policy(1, 4, budget_usd=100), observed(nodes=nodes, spent_usd=75, next_index=1))
    assert len(launches(p)) == 1
    assert "over the $100.00 cap" in p.reason


def test_plan_checkpoints_and_stops_at_the_cap() -> None:
    nodes = (node("n0"), node("n1"))
    p = plan(Policy(1, 2, budget_usd=100), observed(nodes=nodes, spent_usd=99))
    (stop,) = p.of(Stop)
    assert isinstance(stop, Stop) and stop.checkpoint and not stop.error
    assert "budget: $99.00 spent of $100.00" in stop.why
    assert launches(p) == []


def test_plan_never_exceeds_max_nodes_and_counts_pending_launches() -> None:
    # Two listed, one launched but not listed yet (within the grace): none to add.
    nodes = (node("n0"), node("n1"), node("n2", listed=False, launched_at=NOW - 10, agent=None))
    p = plan(Policy(1, 3), observed(nodes=nodes, next_index=3))
    assert launches(p) == [] and "3 of 3 node(s)" in p.reason


def test_plan_takes_a_vm_missing_past_the_grace_as_lost() -> None:
    nodes = (node("n0"), node("n1", listed=False, launched_at=NOW - 500, agent=None))
    p = plan(Policy(1, 2, lost_grace_s=120), observed(nodes=nodes, next_index=2))
    assert [a.node for a in launches(p)] == ["n2"]


def test_plan_backfills_lost_and_draining_nodes_without_touching_the_rest() -> None:
    nodes = (
        node("n0"),
        node("n1", state=InstanceState.TERMINATED, interrupted=True),
        node("n2", agent="draining"),
        node("n3"),
    )
    p = plan(Policy(2, 4), observed(nodes=nodes, next_index=4))
    assert [a.node for a in launches(p)] == ["n4", "n5"]
    assert terminates(p) == []  # the draining node ends itself (its cloud takes it)


def test_plan_replaces_a_node_that_failed_its_health_check_and_penalises_its_offer() -> None:
    nodes = (node("n0"), node("n1", health_failed=True, agent="failed"))
    p = plan(Policy(1, 2), observed(nodes=nodes, next_index=2))
    assert [t.node for t in terminates(p)] == ["n1"]
    (pen,) = p.of(Penalise)
    assert isinstance(pen, Penalise) and pen.key == ("aws", "us-east-1a", "p4d.24xlarge")
    # Its replacement stays in the job's zone (a bad host is not a bad zone).
    assert [(a.node, a.offer) for a in launches(p)] == [("n2", A_SPOT)]


def test_plan_weighs_bad_nodes_like_preemptions_when_choosing_a_zone() -> None:
    history = {("aws", "us-east-1a", "p4d.24xlarge"): ZoneHistory(bad_nodes=30, node_hours=10)}
    assert {a.offer for a in launches(plan(Policy(1, 8), observed(history=history)))} == {B_SPOT}


def test_plan_replaces_a_node_that_never_boots() -> None:
    stuck = node("n1", agent=None, launched_at=NOW - 1000)
    p = plan(Policy(1, 2, boot_timeout_s=900), observed(nodes=(node("n0"), stuck), next_index=2))
    assert [t.node for t in terminates(p)] == ["n1"]
    assert "not healthy 900 s after launch" in terminates(p)[0].why


def _timed(name: str, compute: float, wall: float = 3.6) -> NodeObs:
    """A node whose trainers timed ``compute`` s per step over 20 steps, at the fleet's
    wall pace ``wall`` (the slowest node's compute)."""
    return replace(node(name, step_time=compute), compute_at=NOW, compute_samples=20, step_s=wall)


# One report decides, as the straggler check did before it waited for a sustained signal
# (tests/unit/controller/test_straggler_hysteresis.py checks that wait).
ONE_REPORT = StragglerPolicy(observations=1, sustain_s=0)


def test_plan_reports_and_replaces_a_straggler() -> None:
    nodes = (*[_timed(f"n{i}", 1.0) for i in range(3)], _timed("n3", 3.5))
    p = plan(Policy(1, 4, straggler=ONE_REPORT), observed(nodes=nodes, next_index=4))
    assert [t.node for t in terminates(p)] == ["n3"]
    (report,) = p.of(Report)
    assert isinstance(report, Report)
    assert (
        "n3 is a straggler: 3.50 s of compute per step against the fleet's median 1.00 s"
        in report.message
    )
    assert [a.node for a in launches(p)] == ["n4"]


def test_plan_does_not_replace_a_straggler_on_one_report() -> None:
    nodes = (*[_timed(f"n{i}", 1.0) for i in range(3)], _timed("n3", 3.5))
    assert terminates(plan(Policy(1, 4), observed(nodes=nodes, next_index=4))) == []


def test_plan_leaves_a_merely_slower_node_alone() -> None:
    nodes = (*[_timed(f"n{i}", 1.0, 1.6) for i in range(3)], _timed("n3", 1.5, 1.6))
    policy = Policy(1, 4, straggler=ONE_REPORT)
    assert terminates(plan(policy, observed(nodes=nodes, next_index=4))) == []


def test_plan_stops_a_crash_loop_with_a_clear_error() -> None:
    restores = (Restore(50, 57), Restore(50, 57), Restore(50, 57))
    p = plan(Policy(1, 2, crash_loop_k=3), observed(nodes=(node("n0"),), restores=restores))
    (stop,) = p.of(Stop)
    assert isinstance(stop, Stop) and stop.error
    assert "crash loop: the job failed at step 57 and restored step 50 3 times" in stop.why
    # Progress between failures is no loop.
    moving = (Restore(50, 57), Restore(50, 57), Restore(75, 80))
    assert plan(Policy(1, 2), observed(nodes=(node("n0"),), restores=moving)).of(Stop) == []


def test_plan_scales_down_when_training_finished() -> None:
    nodes = (node("n0", agent="left"), node("n1"), node("n2", state=InstanceState.TERMINATED))
    # n1's agent is still leaving: its VM waits; n0's agent left: its VM ends.
    p = plan(Policy(1, 3), observed(nodes=nodes, finished=True, finished_at=NOW - 5))
    assert [t.node for t in terminates(p)] == ["n0"]
    assert launches(p) == [] and "training finished" in p.reason
    late = plan(Policy(1, 3), observed(nodes=nodes, finished=True, finished_at=NOW - 61))
    assert sorted(t.node for t in terminates(late)) == ["n0", "n1"]


def test_plan_terminates_the_idle_vm_of_a_node_that_left() -> None:
    nodes = (node("n0"), node("n1", agent="left"))
    p = plan(Policy(1, 2), observed(nodes=nodes, next_index=2))
    assert [t.node for t in terminates(p)] == ["n1"]
    assert [a.node for a in launches(p)] == ["n2"]


def test_the_vm_of_a_node_that_left_on_a_preemption_notice_ends_as_preempted() -> None:
    left = replace(node("n1", agent="left"), preempted="terminate from aws-imds")
    p = plan(Policy(1, 2), observed(nodes=(node("n0"), left), next_index=2))
    (t,) = terminates(p)
    assert (t.node, t.preempted) == ("n1", "terminate from aws-imds")
    done = plan(Policy(1, 2), observed(nodes=(node("n0"), node("n1", agent="left"))))
    assert [t.preempted for t in terminates(done)] == [""]


def test_plan_after_a_stop_only_ends_vms() -> None:
    p = plan(Policy(1, 2), observed(nodes=(node("n0"),), stopped="budget"))
    assert [t.node for t in terminates(p)] == ["n0"] and launches(p) == []


def test_policy_refuses_an_inverted_range() -> None:
    with pytest.raises(ValueError, match="min_nodes <= max_nodes"):
        Policy(min_nodes=3, max_nodes=2)


def test_plan_reason_is_stable_when_nothing_changes() -> None:
    nodes = (node("n0"), node("n1"))
    a = plan(Policy(1, 2), observed(nodes=nodes, next_index=2))
    b = plan(Policy(1, 2), replace(observed(nodes=nodes, next_index=2), now=NOW + 5))
    assert a.reason == b.reason == "2 of 2 node(s): nothing to do" and a.actions == ()


def test_plan_ends_the_newest_nodes_over_max() -> None:
    nodes = tuple(node(f"n{i}", launched_at=NOW - 100 + i) for i in range(4))
    p = plan(Policy(1, 3), observed(nodes=nodes, next_index=4))
    assert [t.node for t in terminates(p)] == ["n3"]
    assert launches(p) == [] and "over max_nodes" in p.reason


def test_plan_stops_with_an_error_when_the_budget_cannot_start_a_node() -> None:
    p = plan(Policy(1, 2, budget_usd=5), observed())
    (stop,) = p.of(Stop)
    assert isinstance(stop, Stop) and stop.error and not stop.checkpoint
    assert stop.why == (
        "budget: $5.00 left cannot cover an hour of the cheapest node ($10.00/h); raise "
        "budget.max_usd"
    )
    assert launches(p) == []


# --- VMs that fail before training, and the give-up streak ---------------------------------
PIP = "pip: no matching distribution for torch==2.13.0 for Python 3.10"


def failed_boot(
    name: str,
    stage: str = STAGE_ENV,
    reason: str = PIP,
    o: Offer = A_SPOT,
    launched_at: float = NOW - 120,
) -> NodeObs:
    report = BootReport(name, f"i-{name}", stage, BootState.FAILED, reason, NOW - 5)
    return replace(node(name, o, agent=None, launched_at=launched_at), boot=report)


def failures(p: object) -> list[LaunchFailed]:
    return [a for a in p.actions if isinstance(a, LaunchFailed)]  # type: ignore[attr-defined]


def test_plan_ends_a_vm_whose_boot_failed_at_once_and_counts_it() -> None:
    p = plan(Policy(1, 2), observed(nodes=(node("n0"), failed_boot("n1")), next_index=2))
    (end,) = terminates(p)
    assert end.node == "n1" and end.why == f"boot failed in 'install the environment': {PIP}"
    (failed,) = failures(p)
    assert failed.failure.line == f"n1: boot failed in 'install the environment': {PIP}"
    # n0 trains, so the launch works: the failure is remembered, not counted.
    assert failed.streak.count == 0 and failed.streak.counted("n1")
    assert [a.node for a in launches(p)] == ["n2"] and p.of(Stop) == []
    # Not two minutes after its launch, long before the boot timeout (900 s).
    alone = plan(Policy(1, 2), observed(nodes=(failed_boot("n1"),), next_index=2))
    assert [t.node for t in terminates(alone)] == ["n1"]
    assert failures(alone)[0].streak.count == 1


def test_three_vms_failing_for_the_same_reason_stop_the_run_with_it() -> None:
    policy = Policy(1, 2, max_failed_launches=3)
    streak = FailedLaunches()
    # Each VM says it with its own instance id: still the same reason.
    for name in ("n1", "n2"):
        said = f"{PIP} (on {'i-0abc1234def56789' if name == 'n1' else 'i-0fed9876cba54321'})"
        p = plan(policy, observed(nodes=(failed_boot(name, reason=said),), failed=streak))
        assert p.of(Stop) == []
        streak = failures(p)[-1].streak
    assert streak.count == 2
    p = plan(
        policy,
        observed(
            nodes=(failed_boot("n4", reason=f"{PIP} (on i-0aaa5555bbbb6666)"),), failed=streak
        ),
    )
    (stop,) = p.of(Stop)
    assert isinstance(stop, Stop) and stop.error and not stop.checkpoint
    assert stop.why == (
        "3 VMs in a row failed at boot: n4: boot failed in 'install the environment': "
        f"{PIP} (on i-0aaa5555bbbb6666); fix that and run spottrain up again"
    )
    assert p.reason == stop.why and launches(p) == []
    assert [t.node for t in terminates(p)] == ["n4"]
    # A controller restarted before the stop was recorded stops the run again.
    after = plan(policy, observed(nodes=(node("n5", agent=None),), failed=failures(p)[-1].streak))
    assert [s.why for s in after.of(Stop) if isinstance(s, Stop)] == [stop.why]


def test_two_reasons_interleaved_never_stop_the_run() -> None:
    policy = Policy(1, 1, max_failed_launches=2)
    streak = FailedLaunches()
    for i in range(6):
        stage, reason = (STAGE_ENV, PIP) if i % 2 else (STAGE_CODE, "git: repository not found")
        p = plan(policy, observed(nodes=(failed_boot(f"n{i}", stage, reason),), failed=streak))
        assert p.of(Stop) == [], f"stopped at failure {i}"
        streak = failures(p)[-1].streak
        assert streak.count == 1


def test_a_node_that_trains_ends_the_streak_and_its_failures_do_not_count() -> None:
    streak = FailedLaunches(2, reason_key(STAGE_ENV, PIP), f"n1: boot failed: {PIP}", True, ("n1",))
    # bookkeeping resets the recorded streak when a node trains; the planner does not count
    # a failure while one does, even with a streak at the brink.
    p = plan(
        Policy(1, 2, max_failed_launches=3),
        observed(nodes=(node("n0", agent="joined"), failed_boot("n2")), failed=streak),
    )
    assert p.of(Stop) == [] and failures(p)[0].streak.count == 0


def test_a_vm_counted_before_is_not_counted_again_while_its_cloud_still_lists_it() -> None:
    policy = Policy(1, 1, max_failed_launches=2)
    first = plan(policy, observed(nodes=(failed_boot("n1"),)))
    streak = failures(first)[0].streak
    # The next pass: the cloud's list lags its terminate, n1 still shows as running.
    again = plan(policy, observed(nodes=(failed_boot("n1"),), failed=streak))
    assert [t.node for t in terminates(again)] == ["n1"], "ended again (harmless)"
    assert failures(again) == [] and again.of(Penalise) == [] and again.of(Stop) == []


def test_an_image_stage_failure_blocks_its_region_before_it_counts() -> None:
    west = offer("us-west-2a", 14.0)
    offers = (A_SPOT, B_SPOT, A_OD, west)
    nodes = (failed_boot("n0", STAGE_IMAGE, "python3 is 3.6; spottrain needs 3.10 or newer"),)
    p = plan(
        Policy(1, 1, refusal_block_s=86_400), observed(nodes=nodes, offers=offers, next_index=1)
    )
    (block,) = p.of(Block)
    assert isinstance(block, Block) and block.until == NOW + 86_400
    assert set(block.keys) == {A_SPOT.key, B_SPOT.key, A_OD.key}
    assert "n0: boot failed in 'check the image'" in block.why
    # Blocked first, then counted; and the backfill goes to the other region.
    kinds = [type(a) for a in p.actions]
    assert kinds.index(Block) < kinds.index(LaunchFailed)
    assert failures(p)[0].streak.count == 1
    assert [a.offer for a in launches(p)] == [west]
    # Another stage blocks nothing.
    other = plan(Policy(1, 1), observed(nodes=(failed_boot("n0"),), offers=offers, next_index=1))
    assert other.of(Block) == []


def test_with_nothing_running_a_blocked_home_is_left_for_an_open_offer() -> None:
    """The home's image failed and its offers are blocked; nothing of the job runs: it starts
    in another region (its checkpoint comes from the copy) instead of waiting for the move
    rule. A job that does not copy its checkpoints stays home."""
    west = offer("us-west-2a", 14.0)
    offers = (A_SPOT, B_SPOT, A_OD, west)
    home = ("aws", "us-east-1a", "p4d.24xlarge")
    blocked = {o.key: NOW + 3600 for o in (A_SPOT, B_SPOT, A_OD)}
    obs = observed(offers=offers, blocked=blocked, home=home, next_index=2)
    p = plan(Policy(1, 1), obs)
    assert [a.offer for a in launches(p)] == [west] and "leaving us-east-1a" in p.reason
    assert p.home == ("aws", "us-west-2a", "p4d.24xlarge")
    stays = plan(Policy(1, 1, copies_checkpoints=False), obs)
    assert launches(stays) == [] and "no open offer" in stays.reason
    # A node still running there keeps the job home.
    running = observed(nodes=(node("n0"),), offers=offers, blocked=blocked, home=home)
    assert plan(Policy(1, 2), running).home == home


def test_the_boot_timeout_reason_carries_the_consoles_last_line() -> None:
    stuck = replace(
        node("n1", agent=None, launched_at=NOW - 1000),
        console="cloud-init[812]: Job for spottrain-agent.service failed \x1b[0m",
    )
    p = plan(Policy(1, 1, boot_timeout_s=900), observed(nodes=(stuck,), next_index=2))
    (end,) = terminates(p)
    assert end.why == (
        "not healthy 900 s after launch; its console's last line: cloud-init[812]: Job for "
        "spottrain-agent.service failed \\e[0m"
    )
    (failed,) = failures(p)
    assert failed.failure.key == reason_key("", "not healthy 900 s after launch")
    # Stuck in a stage its boot reported: said, and part of the reason's key.
    booting = BootReport("n1", "i-n1", STAGE_ENV, BootState.BOOTING, "", NOW - 800)
    p = plan(Policy(1, 1), observed(nodes=(replace(stuck, boot=booting, console=""),)))
    assert terminates(p)[0].why == (
        "not healthy 900 s after launch (its boot was at 'install the environment')"
    )
    assert failures(p)[0].failure.key == reason_key(STAGE_ENV, "not healthy 900 s after launch")


def test_a_failed_agent_counts_with_the_reason_it_gave() -> None:
    bad = replace(node("n1", agent="failed"), agent_reason="health check: expected 8 GPUs, saw 7")
    p = plan(Policy(1, 1, max_failed_launches=1), observed(nodes=(bad,)))
    (stop,) = p.of(Stop)
    assert isinstance(stop, Stop) and stop.why == (
        "1 VM failed before training: n1: its agent failed: health check: expected "
        "8 GPUs, saw 7; fix that and run spottrain up again"
    )


def test_escape_sequences_from_a_vm_never_reach_the_reason_raw() -> None:
    p = plan(Policy(1, 1), observed(nodes=(failed_boot("n1", reason="pip: \x1b]0;pwned\x07 no"),)))
    assert "\x1b" not in terminates(p)[0].why and "\x07" not in failures(p)[0].failure.line
    assert "\\e]0;pwned\\x07" in terminates(p)[0].why


def test_policy_refuses_a_give_up_limit_below_one_and_reads_it_from_the_spec() -> None:
    with pytest.raises(ValueError, match="max_failed_launches must be >= 1"):
        Policy(1, 1, max_failed_launches=0)
    data = spec_with(VALID, "controller", {"max_failed_launches": 5})
    assert policy_from_spec(parse_spec(yaml.safe_dump(data)).spec).max_failed_launches == 5
    assert policy_from_spec(parse_spec(yaml.safe_dump(VALID)).spec).max_failed_launches == 3


def test_the_streak_survives_the_controllers_hash_and_garbage_is_no_streak() -> None:
    streak = FailedLaunches(2, "k", "n1: x", False, ("n0", "n1"))
    assert FailedLaunches.from_json(streak.to_json()) == streak
    assert FailedLaunches.from_json("not json") == FailedLaunches()
    assert FailedLaunches.from_json(None) == FailedLaunches()
    many = FailedLaunches()
    for i in range(100):
        many = many.add(FailedLaunch(f"n{i}", "why", reason="why"))
    assert many.count == 100 and len(many.recent) == 64 and many.recent[-1] == "n99"


def test_plan_stops_when_every_offer_was_refused_for_good() -> None:
    day = NOW + 86_400
    blocked = {o.key: day for o in OFFERS}
    p = plan(Policy(1, 2), observed(blocked=blocked, last_refusal="aws: quota exhausted"))
    (stop,) = p.of(Stop)
    assert isinstance(stop, Stop) and stop.error
    assert stop.why.endswith("the last said: aws: quota exhausted")
    # Short blocks (stockouts) are waited out instead.
    short = {o.key: NOW + 600 for o in OFFERS}
    assert plan(Policy(1, 2), observed(blocked=short)).of(Stop) == []


# --- at-risk nodes (a rebalance recommendation) -------------------------------------------
REBALANCE = "rebalance recommendation"


def drains(p: object) -> list[Drain]:
    return [a for a in p.actions if isinstance(a, Drain)]  # type: ignore[attr-defined]


def test_plan_launches_one_replacement_for_an_at_risk_node_beyond_max() -> None:
    nodes = (node("n0"), replace(node("n1"), at_risk=REBALANCE), node("n2"))
    p = plan(Policy(1, 3), observed(nodes=nodes, next_index=3))
    assert [(a.node, a.replaces) for a in launches(p)] == [("n3", "n1")]
    assert terminates(p) == [] and drains(p) == []
    assert "n1 at risk: launching replacement n3" in p.reason


def test_plan_launches_replacements_and_backfill_for_a_short_fleet() -> None:
    nodes = (node("n0"), replace(node("n1"), at_risk=REBALANCE))
    p = plan(Policy(1, 3), observed(nodes=nodes, next_index=2))
    assert [(a.node, a.replaces) for a in launches(p)] == [("n2", "n1"), ("n3", "")]


def test_plan_keeps_the_surplus_while_the_replacement_boots() -> None:
    nodes = (
        node("n0"),
        replace(node("n1"), at_risk=REBALANCE),
        node("n2"),
        replace(node("n3", agent="booting", launched_at=NOW - 30), replaces="n1"),
    )
    p = plan(Policy(1, 3), observed(nodes=nodes, next_index=4))
    # Neither a second replacement nor "over max_nodes": the surplus is the at-risk count.
    assert p.actions == ()
    assert "n1 at risk (rebalance recommendation): replacement n3 booting" in p.reason


def test_plan_drains_the_at_risk_node_once_its_replacement_joined() -> None:
    nodes = (
        node("n0"),
        replace(node("n1", agent="checkpointing"), at_risk=REBALANCE),
        node("n2"),
        replace(node("n3"), replaces="n1"),
    )
    p = plan(Policy(1, 3), observed(nodes=nodes, next_index=4))
    assert [d.node for d in drains(p)] == ["n1"]
    assert "replacement n3 joined; draining n1" in drains(p)[0].why
    assert launches(p) == [] and terminates(p) == []


def test_plan_a_drained_at_risk_node_leaves_max_nodes_without_a_new_launch() -> None:
    nodes = (
        node("n0"),
        replace(node("n1", agent="draining"), at_risk=REBALANCE),
        node("n2"),
        replace(node("n3"), replaces="n1"),
    )
    p = plan(Policy(1, 3), observed(nodes=nodes, next_index=4))
    assert p.actions == ()
    left = (*nodes[:1], replace(nodes[1], agent_state="left"), *nodes[2:])
    p = plan(Policy(1, 3), observed(nodes=left, next_index=4))
    assert [t.node for t in terminates(p)] == ["n1"] and launches(p) == []


def test_plan_surplus_is_at_most_the_at_risk_count() -> None:
    nodes = tuple(
        replace(node(f"n{i}"), at_risk=REBALANCE) if i in (0, 2) else node(f"n{i}")
        for i in range(4)
    )
    p = plan(Policy(1, 4), observed(nodes=nodes, next_index=4))
    assert sorted((a.node, a.replaces) for a in launches(p)) == [("n4", "n0"), ("n5", "n2")]
    extra = (*nodes, node("n6", launched_at=NOW - 5))  # one more, late-confirmed
    p = plan(Policy(1, 4), observed(nodes=extra, next_index=7))
    # Two replacements are owed, one slot is taken by n6: one launch, nothing ended.
    assert len(launches(p)) == 1 and terminates(p) == []


def test_plan_never_launches_a_replacement_beyond_the_budget() -> None:
    nodes = (node("n0"), replace(node("n1"), at_risk=REBALANCE), node("n2"))
    # Three nodes at $10/h fit under the cap; a fourth would project past it.
    p = plan(Policy(1, 3, budget_usd=35.0), observed(nodes=nodes, next_index=3))
    assert launches(p) == []
    assert "budget: one more node would project" in p.reason


def test_plan_at_risk_fleet_index_plans_like_a_list() -> None:
    nodes = (
        node("n0"),
        replace(node("n1"), at_risk=REBALANCE),
        node("n2"),
        replace(node("n3"), replaces="n1"),
    )
    policy = Policy(1, 3)
    assert plan(policy, observed(nodes=FleetIndex(nodes), next_index=4)) == plan(
        policy, observed(nodes=nodes, next_index=4)
    )


def test_a_fleet_index_knows_a_node_trains_as_the_scan_does() -> None:
    """A big fleet's index counts training nodes as it puts and removes them: a VM failing
    at boot beside them is ended but not counted, exactly as with a list."""
    nodes = (node("n0", agent="healthy"), node("n1", agent="checkpointing"), failed_boot("n2"))
    policy = Policy(1, 3, max_failed_launches=1)
    index = FleetIndex(nodes)
    assert plan(policy, observed(nodes=index)) == plan(policy, observed(nodes=nodes))
    assert plan(policy, observed(nodes=index)).of(Stop) == []
    index.remove("n1")
    alone = plan(policy, observed(nodes=index))
    assert alone == plan(policy, observed(nodes=(nodes[0], nodes[2])))
    (stop,) = alone.of(Stop)
    assert isinstance(stop, Stop) and stop.why.startswith("1 VM failed at boot: n2: boot failed")
