"""The run's progress in the controller's hash, decided as pure functions: a stop that
completes, how long the job has been below its minimum, the end of a move, and the plan's
reason. Each returns the steps for :mod:`.execute` to take.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from spottrain.protocol.states import LEAVING, TERMINAL

from .ledger import Note, SetCtl
from .types import Observed, Plan

# A move whose old agents all stopped waits this long for the newest commit's copy.
MOVE_QUIET_S = 15.0


@dataclass(frozen=True)
class DelCtl:
    """Delete fields of the controller's hash."""

    fields: tuple[str, ...]


ProgressStep = SetCtl | DelCtl | Note


def stop_progress(
    ctl: Mapping[str, str], obs: Observed, stop_timeout_s: float
) -> tuple[Observed, list[ProgressStep]]:
    """A stop in progress ends when every node has left or the stop timeout passed."""
    if not ctl.get("stopping") or ctl.get("stopped"):
        return obs, []
    since = float(ctl.get("stopping_since", obs.now))
    agents_left = all(
        n.agent_state is None
        or n.agent_state in TERMINAL
        or n.instance is None
        or not n.instance.state.alive
        for n in obs.nodes
    )
    if agents_left or obs.now - since > stop_timeout_s:
        return replace(obs, stopped=ctl["stopping"]), [SetCtl({"stopped": ctl["stopping"]})]
    return obs, []


@dataclass(frozen=True)
class MoveCopy:
    """What a move's end depends on: the newest copied checkpoint step (None: none was
    copied) and the newest committed step (-1: none)."""

    copied_step: int | None
    last_step: int


def after_pass(
    p: Plan,
    obs: Observed,
    ctl: Mapping[str, str],
    *,
    min_nodes: int,
    move_timeout_s: float,
    move_copy: MoveCopy,
    last_reason: str,
) -> list[ProgressStep]:
    """The bookkeeping after a pass's actions (``ctl`` read after them)."""
    staying = [
        n
        for n in obs.nodes
        if (n.instance is None or n.instance.state.alive) and n.agent_state not in LEAVING
    ]
    steps: list[ProgressStep] = []
    updates: dict[str, str] = {"reason": p.reason}
    if p.home is not None:
        updates["home"] = "|".join(p.home)
    if len(staying) < min_nodes:
        if not ctl.get("below_min_since"):
            updates["below_min_since"] = str(obs.now)
    elif ctl.get("below_min_since"):
        steps.append(DelCtl(("below_min_since",)))
    if ctl.get("moving"):
        steps += _move_end(ctl, obs, move_timeout_s, move_copy)
    steps.append(SetCtl(updates))
    if p.reason != last_reason:
        # The reason is noted when it changes, not every pass.
        steps.append(Note("plan", {"reason": p.reason}))
    return steps


def _move_end(
    ctl: Mapping[str, str], obs: Observed, move_timeout_s: float, copy: MoveCopy
) -> list[ProgressStep]:
    """The moved job may start in its new zone: every old agent has stopped (each copies
    its drain checkpoint out before it exits) and the newest commit is copied, or a short
    grace has passed since they stopped (a commit whose node died uncopied never will be),
    or the move timed out."""
    done = False
    since = float(ctl.get("moving_since", "0"))
    if obs.now - since > move_timeout_s:
        done = True
    elif any(n.alive_beat for n in obs.nodes if n.instance is None or n.instance.state.alive):
        return []
    elif (copy.copied_step if copy.copied_step is not None else -1) >= copy.last_step:
        done = True
    else:
        quiet = ctl.get("moving_quiet_since")
        if not quiet:
            return [SetCtl({"moving_quiet_since": str(obs.now)})]
        done = obs.now - float(quiet) > MOVE_QUIET_S
    if not done:
        return []
    # The new zone's nodes bring in the newest copy at boot: they resume from it.
    return [
        DelCtl(("moving", "below_min_since", "moving_quiet_since")),
        Note(
            "move-ready",
            {
                "to": ctl["moving"],
                "resumes_from_step": copy.copied_step if copy.copied_step is not None else -1,
            },
        ),
    ]
