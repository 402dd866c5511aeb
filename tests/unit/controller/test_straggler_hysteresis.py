"""The straggler check replaces a node only on a sustained, corroborated signal: slow
against its peers' median in several reports spanning a while, its peers waiting for it,
never on a node with too few steps timed, and never while the whole fleet slowed."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import pytest

from spottrain.cloud.base import Instance, InstanceState, Market, Offer
from spottrain.controller.reconcile.planner import plan
from spottrain.controller.reconcile.rules import median_without, request_id
from spottrain.controller.reconcile.types import (
    NodeObs,
    Observed,
    Plan,
    Policy,
    Report,
    SlowWatch,
    StragglerPolicy,
    Terminate,
    Watch,
)

NOW = 1_000_000.0
OFFER = Offer(
    cloud="aws",
    region="us-east-1",
    zone="us-east-1a",
    instance_type="p4d.24xlarge",
    gpus=8,
    gpu_type="A100",
    market=Market.SPOT,
    price_per_hour=10.0,
    interruption_risk=0.05,
)
POLICY = Policy(1, 4)  # the default straggler policy: 3 reports over 60 s, 10 steps timed


def timed(name: str, compute: float, at: float, wall: float, samples: int = 20) -> NodeObs:
    """A joined node whose trainers timed ``compute`` s per step at ``at`` over ``samples``
    steps; ``wall`` s per step is the fleet's pace (the slowest node's compute)."""
    inst = Instance(
        id=f"i-{name}",
        cloud=OFFER.cloud,
        region=OFFER.region,
        zone=OFFER.zone,
        instance_type=OFFER.instance_type,
        market=OFFER.market,
        state=InstanceState.RUNNING,
        job="job",
        node=name,
        request_id=request_id("job", name),
    )
    return NodeObs(
        name=name,
        instance=inst,
        offer=OFFER,
        launched_at=NOW - 3600,
        agent_state="joined",
        alive_beat=True,
        compute_s=compute,
        compute_at=at,
        compute_samples=samples,
        step_s=wall,
        trained=True,
    )


def fleet(at: float, computes: Mapping[str, float], samples: int = 20) -> list[NodeObs]:
    wall = max(computes.values()) + 0.05  # synchronous: everyone steps at the slowest's pace
    return [timed(n, c, at, wall, samples) for n, c in computes.items()]


def run(
    reports: Sequence[tuple[float, Sequence[NodeObs]]],
    policy: Policy = POLICY,
    watch: SlowWatch | None = None,
) -> tuple[list[Plan], SlowWatch]:
    """One pass per report (its time the pass's clock), the watch carried from pass to pass
    as the controller's hash carries it."""
    watch = watch or SlowWatch()
    plans = []
    for now, nodes in reports:
        obs = Observed(now=now, nodes=nodes, offers=(OFFER,), next_index=4, slow=watch)
        p = plan(policy, obs)
        for a in p.of(Watch):
            assert isinstance(a, Watch)
            watch = a.slow
        plans.append(p)
    return plans, watch


def ended(plans: Sequence[Plan]) -> list[list[str]]:
    return [[a.node for a in p.of(Terminate) if isinstance(a, Terminate)] for p in plans]


CALM = {"n0": 1.0, "n1": 1.0, "n2": 1.1}


def test_a_node_slow_in_one_report_is_not_replaced() -> None:
    plans, watch = run([(NOW, fleet(NOW, {**CALM, "n3": 3.5}))])
    assert ended(plans) == [[]]
    assert set(watch.streaks) == {"n3"}  # remembered, not yet acted on
    # It recovers clearly in its next report: the streak ends.
    plans, watch = run([(NOW + 5, fleet(NOW + 5, {**CALM, "n3": 1.2}))], watch=watch)
    assert ended(plans) == [[]] and watch.streaks == {}


def test_a_node_slow_for_a_sustained_span_with_its_peers_waiting_is_replaced() -> None:
    times = [NOW + 20 * i for i in range(4)]  # reports at 0, 20, 40, 60 s
    plans, watch = run([(t, fleet(t, {**CALM, "n3": 3.5})) for t in times])
    # Three slow reports are not enough until they span 60 s.
    assert ended(plans) == [[], [], [], ["n3"]]
    (report,) = plans[-1].of(Report)
    assert isinstance(report, Report)
    assert "n3 is a straggler: 3.50 s of compute per step against the fleet's median" in (
        report.message
    )
    assert "n3" not in watch.streaks  # replaced: nothing left to watch


def test_a_report_looked_at_already_does_not_count_again() -> None:
    # Passes come faster than reports: the same report seen for 60 s is one observation.
    nodes = fleet(NOW, {**CALM, "n3": 3.5})
    plans, watch = run([(NOW + s, nodes) for s in range(0, 61, 2)])
    assert not any(ended(plans))
    assert watch.streaks["n3"].count == 1


def test_a_node_its_peers_do_not_wait_for_is_not_replaced() -> None:
    """A high figure left from a starved moment: the fleet's wall pace is its peers' own, so
    nobody waits for it now."""
    times = [NOW + 20 * i for i in range(5)]
    reports = []
    for t in times:
        nodes = [timed(n, c, t, wall=1.15) for n, c in CALM.items()]
        reports.append((t, [*nodes, timed("n3", 3.5, t, wall=3.6)]))
    plans, _ = run(reports)
    assert not any(ended(plans))


def test_a_node_slow_while_the_whole_fleet_slowed_is_not_replaced() -> None:
    """A loaded host slows every node, one more than the others."""
    calm = [(NOW + 20 * i, fleet(NOW + 20 * i, {**CALM, "n3": 1.0})) for i in range(3)]
    loaded = {"n0": 2.0, "n1": 2.0, "n2": 2.2, "n3": 5.0}
    later = [(NOW + 60 + 20 * i, fleet(NOW + 60 + 20 * i, loaded)) for i in range(1, 6)]
    plans, watch = run([*calm, *later])
    assert not any(ended(plans))
    assert watch.streaks == {}


def test_a_lasting_slowdown_of_the_fleet_becomes_its_new_calm() -> None:
    # Ten minutes after the fleet slowed for good (a smaller world, say), a node slow
    # against it is a straggler again.
    calm = [(NOW, fleet(NOW, {**CALM, "n3": 1.0}))]
    slow = {"n0": 2.0, "n1": 2.0, "n2": 2.2}
    steady = [(NOW + 60 * i, fleet(NOW + 60 * i, {**slow, "n3": 2.0})) for i in range(1, 12)]
    start = NOW + 720
    bad = [(start + 20 * i, fleet(start + 20 * i, {**slow, "n3": 5.0})) for i in range(4)]
    plans, _ = run([*calm, *steady, *bad])
    assert ended(plans)[-1] == ["n3"] and not any(ended(plans)[:-1])


def test_a_node_with_too_few_steps_timed_is_not_replaced() -> None:
    times = [NOW + 20 * i for i in range(5)]
    reports = [(t, fleet(t, {**CALM, "n3": 3.5}, samples=4)) for t in times]
    plans, _ = run(reports)
    assert not any(ended(plans))


def test_a_node_between_the_marks_keeps_its_streak_and_only_a_clear_recovery_ends_it() -> None:
    def at(i: int, n3: float) -> tuple[float, list[NodeObs]]:
        return NOW + 20 * i, fleet(NOW + 20 * i, {**CALM, "n3": n3})

    # Slow, a little better (1.8x: above the 1.5x recovery mark), slow again: replaced.
    plans, _ = run([at(0, 3.5), at(1, 1.8), at(2, 3.5), at(3, 3.5)])
    assert ended(plans) == [[], [], [], ["n3"]]
    # Slow, clearly recovered (1.2x), slow again: the count starts over.
    plans, watch = run([at(0, 3.5), at(1, 1.2), at(2, 3.5), at(3, 3.5)])
    assert not any(ended(plans))
    assert watch.streaks["n3"].since == NOW + 40


def test_a_restarted_controller_carries_the_streak_on() -> None:
    times = [NOW + 20 * i for i in range(4)]
    _, watch = run([(t, fleet(t, {**CALM, "n3": 3.5})) for t in times[:3]])
    again = SlowWatch.from_json(watch.to_json())  # the controller's hash, read back
    assert again == watch
    plans, _ = run([(times[3], fleet(times[3], {**CALM, "n3": 3.5}))], watch=again)
    assert ended(plans) == [["n3"]]
    assert SlowWatch.from_json("not json") == SlowWatch()
    assert SlowWatch.from_json('{"streaks": {"n1": [1]}}') == SlowWatch()


def test_one_pass_judges_a_node_when_the_policy_asks_for_one_report() -> None:
    once = Policy(1, 4, straggler=StragglerPolicy(observations=1, sustain_s=0))
    plans, _ = run([(NOW, fleet(NOW, {**CALM, "n3": 3.5}))], policy=once)
    assert ended(plans) == [["n3"]]
    merely_slower = fleet(NOW, {**CALM, "n3": 1.9})
    assert not any(ended(run([(NOW, merely_slower)], policy=once)[0]))


@pytest.mark.parametrize("n", range(2, 9))
def test_the_median_without_one_figure_is_the_median_of_the_rest(n: int) -> None:
    figures = sorted([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0][:n])
    for i, x in enumerate(figures):
        rest = figures[:i] + figures[i + 1 :]
        assert median_without(figures, x) == statistics.median(rest)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"recover_factor": 2.5}, "recover_factor"),
        ({"recover_factor": 1.0}, "recover_factor"),
        ({"observations": 0}, "observations"),
        ({"min_samples": 0}, "min_samples"),
        ({"sustain_s": -1}, "sustain_s"),
        ({"corroboration": 1.5}, "corroboration"),
        ({"fleet_factor": 1.0}, "fleet_factor"),
    ],
)
def test_a_bad_straggler_setting_is_refused_by_name(kw: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        StragglerPolicy(**kw)
