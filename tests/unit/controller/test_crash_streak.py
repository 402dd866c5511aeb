"""VMs whose workers crash-loop, in the run's one give-up policy (``max_failed_launches``),
with literals: what counts as the same reason (the crash's key, the same known step, or
crash loops side by side), what ends the streak (a checkpoint committed past it; a node that
trained for a while, not one that only joined), and what ``status`` shows of it."""

from __future__ import annotations

from dataclasses import replace

import fakeredis

from spottrain.cloud.base import Instance, InstanceState, Market, Offer
from spottrain.controller.reconcile.ledger import FAILED_LAUNCHES, bookkeeping
from spottrain.controller.reconcile.planner import plan
from spottrain.controller.reconcile.records import LaunchRecord
from spottrain.controller.reconcile.rules import CAUSE_WAIT_S, failure, request_id
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import boot_lines, summarize
from spottrain.controller.reconcile.types import (
    FailedLaunch,
    FailedLaunches,
    LaunchFailed,
    NodeObs,
    Observed,
    Policy,
    Stop,
)
from spottrain.controller.run.drive import format_summary
from spottrain.protocol.crashes import Crash, crash_key
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus

NOW = 1_800_000_000.0
OFFER = Offer("aws", "us-east-1", "us-east-1a", "p5.48xlarge", 8, "H100", Market.SPOT, 30.0, 0.1)
IMPORT = "ModuleNotFoundError: No module named 'no_such_module'"


def _node(name: str, agent: str | None = "joined", launched_at: float = NOW - 600) -> NodeObs:
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
    return NodeObs(name, inst, OFFER, launched_at, agent_state=agent, alive_beat=True)


def _looped(
    name: str,
    line: str = IMPORT,
    times: int = 3,
    step: int | None = None,
    launched_at: float = NOW - 600,
) -> NodeObs:
    """A node whose agent ended torchrun: its workers failed ``times`` in a row."""
    crash = Crash(1, line, crash_key(1, line, name), ("Traceback ...", line), 0, step, 1.0, times)
    crash = replace(crash, loop=True)
    reason = f"crash loop: {crash.why()}"
    return replace(
        _node(name, "failed", launched_at), agent_reason=reason, crash=crash, trained=False
    )


def _observed(*nodes: NodeObs, **kw: object) -> Observed:
    return Observed(now=NOW, nodes=nodes, offers=(OFFER,), next_index=10, **kw)


def _streak(p: object) -> FailedLaunches:
    return [a for a in p.actions if isinstance(a, LaunchFailed)][-1].streak  # type: ignore[attr-defined]


def test_a_node_that_only_joined_the_rendezvous_is_not_training() -> None:
    """Workers that fail at every start join the rendezvous each time: the streak of VMs
    that failed goes on beside such a node, and stops the run at its limit."""
    why = "torchrun exited with code 1"
    n1, n2 = (replace(_node(n, "failed"), agent_reason=why) for n in ("n1", "n2"))
    first = failure(n1, NOW, Policy(1, 2))
    assert first is not None
    streak = FailedLaunches().add(first)
    obs = _observed(_node("n0"), failed=streak)
    assert bookkeeping(obs) == (obs, [])
    p = plan(Policy(1, 2, max_failed_launches=2), _observed(_node("n0"), n2, failed=streak))
    (stop,) = p.of(Stop)
    assert isinstance(stop, Stop) and stop.why.startswith("2 VMs in a row failed before training")


def test_a_crash_loop_counts_by_its_crash_and_names_the_failing_line() -> None:
    policy = Policy(1, 1, max_failed_launches=2)
    first = plan(policy, _observed(_looped("n1", times=3)))
    streak = _streak(first)
    assert streak.count == 1 and streak.crashed and streak.tail == ("Traceback ...", IMPORT)
    # Its agent saw one more failure before torchrun ended: still the same reason.
    second = plan(policy, _observed(_looped("n2", times=4, launched_at=NOW + 1), failed=streak))
    (stop,) = second.of(Stop)
    assert isinstance(stop, Stop) and stop.error and not stop.checkpoint
    assert stop.why == (
        "2 VMs in a row failed before training: n2: its agent failed: crash loop: its workers "
        f"failed 4 times in a row (local rank 0, exit code 1): {IMPORT}; fix that and run "
        "spottrain up again"
    )


def test_the_same_reason_is_the_same_key_the_same_step_or_crash_loops_side_by_side() -> None:
    a = failure(_looped("n1", "RuntimeError: the batch has 3 rows"), NOW, Policy(1, 1))
    assert a is not None and a.crashed and a.step is None
    streak = FailedLaunches().add(a, now=NOW)
    # n2 ran beside n1 (launched before n1 was counted): its workers failed on the lost
    # connection to n1's, which says something else.
    lost = "RuntimeError: Connection closed by peer [10.0.0.7]:29400"
    beside = failure(_looped("n2", lost, launched_at=NOW - 30), NOW, Policy(1, 1))
    after = failure(_looped("n3", lost, launched_at=NOW + 5), NOW, Policy(1, 1))
    assert beside is not None and after is not None
    assert streak.same(beside) and not streak.same(after)
    # A NaN at the same step after every resume: whatever each rank said.
    nan = failure(_looped("n4", "FloatingPointError: loss is nan", step=7), NOW, Policy(1, 1))
    peer = failure(_looped("n5", lost, step=7, launched_at=NOW + 5), NOW, Policy(1, 1))
    assert nan is not None and peer is not None
    assert FailedLaunches().add(nan, now=NOW).same(peer)
    # A boot failure is never the same as a crash loop beside it.
    boot = FailedLaunch("n6", "boot failed in 'fetch the code'", reason="x")
    assert not streak.same(boot)


def test_a_streak_at_a_known_step_ends_only_by_a_checkpoint_committed_past_it() -> None:
    nan = FailedLaunch("n1", "its agent failed: ...", reason="nan", at_boot=False, step=7)
    streak = FailedLaunches().add(nan, committed_step=6, now=NOW)
    assert streak.best_step == 6
    # Nodes that train up to step 7 train for a while too: that ends nothing.
    assert not streak.ended_by(committed_step=6, trained=3)
    assert streak.ended_by(committed_step=8, trained=0)
    # A failure at a known step counts even while nodes train (their steps lead to it).
    assert streak.counts(nan, trained=3)


def test_a_streak_at_no_known_step_ends_when_a_node_trained_for_a_while() -> None:
    crash = FailedLaunch("n1", "its agent failed: ...", reason="import", at_boot=False)
    streak = FailedLaunches().add(crash, committed_step=None, now=NOW)
    assert not streak.ended_by(committed_step=None, trained=0)
    assert streak.ended_by(committed_step=None, trained=1)
    assert streak.ended_by(committed_step=0, trained=0)  # a first checkpoint
    assert not streak.counts(crash, trained=1) and streak.counts(crash, trained=0)
    assert not FailedLaunches().ended_by(committed_step=5, trained=5)  # no streak
    # Through the planner's bookkeeping: a node marked trained ends it, a joined one not.
    joined = _observed(_node("n0"), failed=streak)
    assert bookkeeping(joined)[0].failed == streak
    trained = _observed(replace(_node("n0"), trained=True), failed=streak)
    assert bookkeeping(trained)[0].failed == FailedLaunches(recent=("n1",))


def test_the_streak_carries_its_crash_through_the_controllers_hash() -> None:
    crash = FailedLaunch(
        "n1", "w", reason="r", at_boot=False, crashed=True, step=7, tail=("a", "b")
    )
    streak = FailedLaunches().add(crash, committed_step=6, now=NOW)
    assert FailedLaunches.from_json(streak.to_json()) == streak
    assert FailedLaunches.from_json('{"count": 2, "key": "k"}').best_step == -1


def test_status_shows_the_last_crash_looped_vms_last_lines_escaped() -> None:
    state = RunState(fakeredis.FakeRedis(), RunKeys("t-crash"))
    state.put_launch(LaunchRecord("n2", "r2", OFFER, NOW, LedgerStatus.LAUNCHED, "i-2"))
    crash = FailedLaunch(
        "n1",
        f"its agent failed: crash loop: ...: {IMPORT}",
        at_boot=False,
        crashed=True,
        tail=("Traceback (most recent call last):", "import x \x1b]0;owned\x07", IMPORT),
    )
    state.set_ctl(**{FAILED_LAUNCHES: FailedLaunches().add(crash, now=NOW).to_json()})
    s = summarize(state, NOW)
    lines = format_summary(s, boot_lines(state, s))
    assert f"  1 VM(s) in a row failed before training; the last: n1: {crash.why}" in lines
    at = lines.index(f"  n1> {IMPORT}")
    assert lines[at - 2 : at] == [
        "  n1> Traceback (most recent call last):",
        "  n1> import x \\e]0;owned\\x07",
    ]


def test_vms_failing_beside_the_first_keep_the_first_ones_reason() -> None:
    """Rank 0's VM crash-loops on the bug; its peer, which ran beside it, fails after it with a
    line of its own (its rendezvous round left short): the streak grows, and the run's reason
    stays the bug's, not the peer's symptom (seen in CI under load)."""
    bug = "RuntimeError: the batch has 3 rows, the model expects 4"
    first = failure(_looped("n0", bug), NOW, Policy(1, 2))
    assert first is not None
    streak = FailedLaunches().add(first, now=NOW)
    short = "torch.distributed.DistStoreError: timed out after 60 s waiting for MASTER_ADDR"
    peer = failure(_looped("n1", short, times=1, launched_at=NOW - 600), NOW + 60, Policy(1, 2))
    assert peer is not None and streak.same(peer)
    both = streak.add(peer, now=NOW + 60)
    assert both.count == 2 and both.recent == ("n0", "n1")
    assert bug in both.last and short not in both.last and both.tail[-1] == bug
    # A VM launched after the first one failed does not join by running beside it.
    later = failure(_looped("n2", short, launched_at=NOW + 30), NOW + 90, Policy(1, 2))
    assert later is not None and not both.same(later)


def test_a_vm_that_finds_the_rendezvous_closed_keeps_the_streaks_reason() -> None:
    """The bug's VMs ended their torchrun, which closed the job's rendezvous; a backfill
    launched after them fails at once on the closed rendezvous (seen in CI under load): it
    counts in the streak, whose reason stays the bug's."""
    bug = "RuntimeError: the batch has 3 rows, the model expects 4"
    first = failure(_looped("n0", bug), NOW, Policy(1, 2))
    assert first is not None
    streak = FailedLaunches().add(first, now=NOW)
    closed = "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"
    late = _node("n2", agent="failed", launched_at=NOW + 30)
    late = replace(late, agent_reason=f"torchrun exited with code 1: its workers failed: {closed}")
    backfill = failure(late, NOW + 60, Policy(1, 2))
    assert backfill is not None and not backfill.crashed and streak.same(backfill)
    both = streak.add(backfill, now=NOW + 60)
    assert both.count == 2 and bug in both.last and closed not in both.last
    # With no streak, it is a failure of its own.
    alone = FailedLaunches().add(backfill, now=NOW + 60)
    assert alone.count == 1 and closed in alone.last


CLOSED = "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"
BUG = "RuntimeError: the batch has 3 rows, the model expects 4"


def _closed(name: str, launched_at: float = NOW - 600) -> NodeObs:
    """A node whose torchrun exited by itself at once: the job's rendezvous was closed (its
    agent keeps the crash of a torchrun that gave up, whose key is lowercase)."""
    crash = Crash(1, CLOSED, crash_key(1, CLOSED, name), (CLOSED,), -1, None, 0.5, 1, True)
    reason = f"torchrun exited with code 1: {crash.why()}"
    return replace(
        _node(name, "failed", launched_at), agent_reason=reason, crash=crash, trained=False
    )


def test_a_vm_whose_torchrun_found_the_rendezvous_closed_joins_by_its_crash_too() -> None:
    """Seen in CI: the backfill's torchrun gave up on the closed rendezvous by itself, so its
    failure is a crash whose key is lowercase; it joins the bug's streak all the same."""
    first = failure(_looped("n0", BUG), NOW, Policy(1, 2))
    backfill = failure(_closed("n2", launched_at=NOW + 30), NOW + 60, Policy(1, 2))
    assert first is not None and backfill is not None and backfill.found_closed
    both = FailedLaunches().add(first, now=NOW).add(backfill, now=NOW + 60)
    assert both.count == 2 and BUG in both.last and not both.effects_only


def test_a_streak_of_closed_rendezvous_takes_the_reason_of_the_failure_that_closed_it() -> None:
    """The VMs that found the rendezvous closed were counted before the one whose workers'
    failure closed it: the streak goes on and names that one's bug."""
    a = failure(_closed("n1"), NOW, Policy(1, 2))
    b = failure(_closed("n2", launched_at=NOW + 30), NOW + 40, Policy(1, 2))
    bug = failure(_looped("n0", BUG), NOW + 50, Policy(1, 2))
    assert a is not None and b is not None and bug is not None
    effects = FailedLaunches().add(a, now=NOW).add(b, now=NOW + 40)
    assert effects.count == 2 and effects.effects_only and "n2" in effects.last
    named = effects.add(bug, now=NOW + 50)
    assert named.count == 3 and BUG in named.last and not named.effects_only
    # Another VM that finds it closed afterwards keeps the bug's reason.
    late = failure(_closed("n3", launched_at=NOW + 45), NOW + 60, Policy(1, 2))
    assert late is not None and BUG in named.add(late, now=NOW + 60).last


def test_at_its_limit_a_streak_of_closed_rendezvous_waits_for_the_failing_peer_to_say_why() -> None:
    policy = Policy(1, 2, max_failed_launches=2)
    a = failure(_closed("n1"), NOW - 10, policy)
    assert a is not None
    effects = FailedLaunches().add(a, now=NOW - 10)
    # n0's workers are failing (a crash record, not a loop yet): the stop waits for it.
    crash = Crash(1, BUG, crash_key(1, BUG, "n0"), (BUG,), 0, None, 1.0, 2)
    failing = replace(_node("n0"), crash=crash)
    waits = plan(policy, _observed(failing, _closed("n2", launched_at=NOW - 5), failed=effects))
    assert not waits.of(Stop) and "waiting for why n0's workers failed" in waits.reason
    streak = _streak(waits)
    assert streak.count == 2 and streak.effects_only
    # n0's crash loop comes: the run stops and names the bug.
    done = plan(policy, _observed(_looped("n0", BUG), failed=streak))
    (stop,) = done.of(Stop)
    assert isinstance(stop, Stop) and stop.why.startswith("3 VMs in a row failed before")
    assert BUG in stop.why and CLOSED not in stop.why
    # With no failing node left, or past the wait, the streak stops the run as it is.
    for obs in (
        _observed(_node("n0"), failed=streak),
        replace(_observed(failing, failed=streak), now=NOW + CAUSE_WAIT_S),
    ):
        (stop,) = plan(policy, obs).of(Stop)
        assert isinstance(stop, Stop) and CLOSED in stop.why
