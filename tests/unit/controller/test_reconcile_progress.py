"""The run's progress decisions after a pass, pure: a stop completing, below-min since, a
move's end and the plan's reason, with literals."""

from __future__ import annotations

from spottrain.cloud.base import Instance, InstanceState, Market
from spottrain.controller.reconcile.ledger import Note, SetCtl
from spottrain.controller.reconcile.progress import (
    DelCtl,
    MoveCopy,
    after_pass,
    stop_progress,
)
from spottrain.controller.reconcile.types import NodeObs, Observed, Plan

NOW = 1_000.0
NO_COPY = MoveCopy(None, -1)


def node(name: str, agent: str | None = "joined", beat: bool = True) -> NodeObs:
    inst = Instance(f"i-{name}", "local", "r", "z", "t", Market.SPOT, InstanceState.RUNNING,
                    "run", name, f"rq-{name}")  # fmt: skip
    return NodeObs(name, inst, None, NOW - 60, agent_state=agent, alive_beat=beat)


def obs(*nodes: NodeObs) -> Observed:
    return Observed(now=NOW, nodes=list(nodes), offers=[])


def test_a_stop_completes_once_every_agent_left_or_the_timeout_passed() -> None:
    ctl = {"stopping": "budget", "stopping_since": str(NOW - 10)}
    assert stop_progress(ctl, obs(node("n0")), 180.0) == (obs(node("n0")), [])
    seen, steps = stop_progress(ctl, obs(node("n0", "left")), 180.0)
    assert seen.stopped == "budget" and steps == [SetCtl({"stopped": "budget"})]
    assert stop_progress(ctl, obs(node("n0")), 5.0)[1] == [SetCtl({"stopped": "budget"})]
    assert stop_progress({**ctl, "stopped": "budget"}, obs(), 5.0)[1] == []


def after(p: Plan, o: Observed, ctl: dict[str, str], copy: MoveCopy = NO_COPY) -> list[object]:
    return after_pass(
        p, o, ctl, min_nodes=2, move_timeout_s=240.0, move_copy=copy, last_reason="before"
    )


def test_below_min_is_stamped_once_and_cleared_when_the_fleet_is_back() -> None:
    p = Plan((), "1 of 2", ("local", "z", "t"))
    assert after(p, obs(node("n0")), {}) == [
        SetCtl({"reason": "1 of 2", "home": "local|z|t", "below_min_since": str(NOW)}),
        Note("plan", {"reason": "1 of 2"}),
    ]
    back = after(Plan((), "before"), obs(node("n0"), node("n1")), {"below_min_since": "5"})
    assert back == [DelCtl(("below_min_since",)), SetCtl({"reason": "before"})]


def test_a_move_ends_once_the_old_agents_stopped_and_the_newest_commit_is_copied() -> None:
    ctl = {"moving": "z2", "moving_since": str(NOW - 30), "below_min_since": "1"}
    p = Plan((), "before")
    # An old agent still beats: the move waits.
    assert after(p, obs(node("n0")), ctl, MoveCopy(7, 7)) == [SetCtl({"reason": "before"})]
    quiet = obs(node("n0", beat=False))
    assert after(p, quiet, ctl, MoveCopy(7, 7)) == [
        DelCtl(("moving", "below_min_since", "moving_quiet_since")),
        Note("move-ready", {"to": "z2", "resumes_from_step": 7}),
        SetCtl({"reason": "before"}),
    ]
    # The newest commit is not copied: a short grace first.
    assert after(p, quiet, ctl, MoveCopy(5, 7))[0] == SetCtl({"moving_quiet_since": str(NOW)})
    waited = {**ctl, "moving_quiet_since": str(NOW - 16)}
    assert after(p, quiet, waited, MoveCopy(5, 7))[1] == Note(
        "move-ready", {"to": "z2", "resumes_from_step": 5}
    )
    # Past the move's timeout it ends whatever the agents do.
    late = {**ctl, "moving_since": str(NOW - 300)}
    assert after(p, obs(node("n0")), late, MoveCopy(None, 7))[1] == Note(
        "move-ready", {"to": "z2", "resumes_from_step": -1}
    )
