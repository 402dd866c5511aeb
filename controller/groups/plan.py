"""The decisions for a fleet that a cloud group owns (Terraform's Auto Scaling group or
managed instance group): pure, like :mod:`spottrain.controller.reconcile.planner`.

The group launches and replaces VMs by itself; what is left to decide is its size and which
VM leaves. The rules:

- **Grow by size.** Fewer members than the job wants: raise the group's size.
- **Shrink by name.** More than it wants: choose the victims (VMs whose agent already left
  or failed first, then ones that have not joined training, then the newest), ask each
  trainer-bearing victim to drain (emergency checkpoint, leave), and remove it by name once
  its agent has left, lowering the size with it. The group never picks a victim; on AWS its
  scale-in protection stops it from trying.
- **Replace the spent.** A VM whose agent left or failed while the job still wants it (a
  node that drained after a rebalance notice, a broken GPU) is removed with the size kept,
  so the group launches a fresh one in its place.
- **Release the held.** A VM held by a termination lifecycle hook is let go only when its
  agent cannot complete the action itself: it left (its checkpoint committed), failed, or
  went silent. An agent that is still draining completes it once its checkpoint commits.
- **Shed unfilled size.** A size above both what the job wants and what exists (launches the
  cloud cannot fill) comes down to what exists, which makes no victim.
"""

from __future__ import annotations

from dataclasses import dataclass

from spottrain.cloud.base.groups import Member, MemberState
from spottrain.protocol.states import TERMINAL, TRAINING, NodeState

# Agents in the training round, or draining out of it (still holding their place).
_TRAINING = TRAINING | {NodeState.DRAINING}


@dataclass(frozen=True)
class GroupPolicy:
    """The group planner's tunables.

    Attributes:
        min_nodes: Fewest nodes training continues with (for the reason line).
        max_nodes: Most nodes the job may have; the wanted size is clamped to it.
        drain_timeout_s: A victim asked to drain is removed after this even if its agent
            has not left (on AWS the termination hook still gives it time to finish).
        silent_s: An agent that registered and then stopped heartbeating this long on a
            running VM has a broken VM (replaced).
        boot_timeout_s: A running VM whose agent never registered within this is broken.
        budget_usd: The job's spending cap.
    """

    min_nodes: int
    max_nodes: int
    drain_timeout_s: float = 300.0
    silent_s: float = 120.0
    boot_timeout_s: float = 1200.0
    budget_usd: float | None = None


@dataclass(frozen=True)
class MemberObs:
    """One member as the controller sees it this pass.

    Attributes:
        member: What the group says.
        agent_state: What its agent last recorded (None: never registered).
        alive_beat: Its agent's heartbeat is fresh.
        first_seen: When the controller first saw it.
        drain_asked_at: When the controller asked it to drain (it is a victim), or None.
        removed_at: When the controller asked the group to remove it, or None.
    """

    member: Member
    agent_state: str | None
    alive_beat: bool
    first_seen: float
    drain_asked_at: float | None = None
    removed_at: float | None = None

    @property
    def id(self) -> str:
        return self.member.id


@dataclass(frozen=True)
class GroupObserved:
    """The group planner's input.

    Attributes:
        now: Unix seconds.
        wanted: Nodes the job wants now (``spottrain scale``, else ``nodes.max``).
        group_target: The group's size as the cloud reports it.
        max_size: The group's cap, if it has one.
        members: Every member the group reports.
        finished: Training is over.
        stopping: Why the run is being stopped, or "".
        spent_usd: What the run has cost so far.
    """

    now: float
    wanted: int
    group_target: int
    members: tuple[MemberObs, ...]
    max_size: int | None = None
    finished: bool = False
    stopping: str = ""
    spent_usd: float = 0.0


@dataclass(frozen=True)
class SetTarget:
    size: int
    why: str


@dataclass(frozen=True)
class DrainMember:
    id: str
    why: str


@dataclass(frozen=True)
class RemoveMembers:
    ids: tuple[str, ...]
    replace: bool
    why: str


@dataclass(frozen=True)
class ReleaseMember:
    id: str
    why: str


@dataclass(frozen=True)
class StopRun:
    why: str
    error: bool = False


GroupAction = SetTarget | DrainMember | RemoveMembers | ReleaseMember | StopRun


@dataclass(frozen=True)
class GroupPlan:
    actions: tuple[GroupAction, ...] = ()
    reason: str = ""
    wanted: int = 0
    active: int = 0

    def of(self, kind: type) -> list[GroupAction]:
        return [a for a in self.actions if isinstance(a, kind)]


def _spent(m: MemberObs) -> bool:
    return m.agent_state in TERMINAL


def broken(policy: GroupPolicy, m: MemberObs, now: float) -> bool:
    """A running VM whose agent failed, went silent, or never came up."""
    if m.member.state is not MemberState.RUNNING:
        return False
    if m.agent_state == NodeState.FAILED:
        return True
    if m.agent_state is None:
        return now - m.first_seen > policy.boot_timeout_s
    return (
        not m.alive_beat and m.agent_state not in TERMINAL and now - m.first_seen > policy.silent_s
    )


def _victim_order(policy: GroupPolicy, m: MemberObs, now: float) -> tuple[int, int, float, str]:
    # Keep earlier choices (a drain already asked), then the cheapest to lose: spent or broken,
    # then not yet training, then the newest (older nodes hold warm caches and state).
    rank = 0 if _spent(m) or broken(policy, m, now) else 1 if m.agent_state not in _TRAINING else 2
    return (0 if m.drain_asked_at is not None else 1, rank, -m.first_seen, m.id)


def _held_without_agent(m: MemberObs) -> bool:
    """Held by a termination hook with nobody left to complete it."""
    return m.member.waiting_on_hook and (
        m.agent_state in TERMINAL or m.agent_state is None or not m.alive_beat
    )


def plan_group(policy: GroupPolicy, obs: GroupObserved) -> GroupPlan:
    """Decide this pass's actions for a group-owned fleet (see the module's rules)."""
    now = obs.now
    actions: list[GroupAction] = []
    notes: list[str] = []

    if (
        policy.budget_usd is not None
        and obs.spent_usd >= policy.budget_usd
        and not obs.stopping
        and not obs.finished
    ):
        actions.append(
            StopRun(f"budget: ${obs.spent_usd:.2f} spent of ${policy.budget_usd:.2f}", error=True)
        )
    ending = obs.finished or bool(obs.stopping) or bool(actions)
    wanted = 0 if ending else max(0, min(obs.wanted, policy.max_nodes))
    if obs.max_size is not None:
        wanted = min(wanted, obs.max_size)

    for m in obs.members:
        if _held_without_agent(m):
            actions.append(ReleaseMember(m.id, f"agent {m.agent_state or 'never started'}"))

    active = [m for m in obs.members if m.member.state.alive and m.removed_at is None]
    excess = len(active) - wanted
    victims: list[MemberObs] = []
    if excess > 0:
        victims = sorted(active, key=lambda m: _victim_order(policy, m, now))[:excess]
    to_remove: list[str] = []
    for v in victims:
        ready = (
            _spent(v)
            or broken(policy, v, now)
            or v.agent_state not in _TRAINING
            or v.member.state is MemberState.PENDING
        )
        if ready:
            to_remove.append(v.id)
        elif v.drain_asked_at is None:
            actions.append(DrainMember(v.id, "scale-in" if not ending else "run ending"))
        elif now - v.drain_asked_at > policy.drain_timeout_s:
            to_remove.append(v.id)
            notes.append(f"{v.id} did not leave within {policy.drain_timeout_s:.0f} s")
    if to_remove:
        why = "run ending" if ending else f"scale-in to {wanted}"
        actions.append(RemoveMembers(tuple(to_remove), replace=False, why=why))

    chosen = {v.id for v in victims}
    spent = [m.id for m in active if m.id not in chosen and (_spent(m) or broken(policy, m, now))]
    if spent:
        actions.append(RemoveMembers(tuple(spent), replace=True, why="replace spent or broken VM"))
    # A VM removed now whose agent is gone will be held by the hook with nobody to end the
    # wait: release it in the same pass (a release before the hook holds it is harmless).
    by_id = {m.id: m for m in obs.members}
    for member_id in [*to_remove, *spent]:
        m = by_id[member_id]
        if m.agent_state in TERMINAL or m.agent_state is None:
            actions.append(ReleaseMember(member_id, f"agent {m.agent_state or 'never started'}"))

    if obs.group_target < wanted:
        actions.append(SetTarget(wanted, f"grow to {wanted}"))
    else:
        # Only what no VM fills can go by size: the group then has nobody to pick.
        floor = max(wanted, len(active) - len(to_remove))
        if obs.group_target - len(to_remove) > floor:
            actions.append(SetTarget(floor, "shed launches the cloud has not filled"))

    running = sum(1 for m in active if m.agent_state in _TRAINING)
    reason = (
        f"group {len(active)} VMs ({running} training), size {obs.group_target}, wanted {wanted}"
        f" (min {policy.min_nodes})"
    )
    if ending:
        reason += "; ending: " + ("finished" if obs.finished else obs.stopping or "budget")
    if notes:
        reason += "; " + "; ".join(notes)
    return GroupPlan(tuple(actions), reason, wanted, len(active))
