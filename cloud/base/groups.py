"""Fleets that a cloud's own group owns (an AWS Auto Scaling group, a GCP managed instance
group), as Terraform provisions them: the interface the controller adopts them through.

The group creates and replaces VMs; spottrain decides how many there are and which one goes.
So the interface has no launch: the controller sets the group's size, and removes a VM it
names itself, never letting the group pick a victim (the groups are created with scale-in
protection on AWS, and the controller only ever deletes named members on GCP).

The contract, which every implementation keeps:

- **Eventually consistent.** :meth:`Group.describe` may lag :meth:`Group.set_target` and
  :meth:`Group.remove` by a few seconds; the controller reconciles each pass.
- **Idempotent.** Setting the size it already has, or removing a member that is already
  gone, is not an error.
- **Typed errors.** Refusals raise the :class:`~spottrain.cloud.base.ProviderError`
  subclasses; a group that does not exist is a :class:`~spottrain.cloud.base.BadRequestError`
  whose message names it and says which Terraform output gives the right name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from spottrain.cloud.base.provider import Market


class MemberState(StrEnum):
    """A group member's state, the same words for every cloud."""

    PENDING = "pending"  # the group is creating it (or restarting it)
    RUNNING = "running"  # in service
    LEAVING = "leaving"  # being removed: waiting on a lifecycle hook, or being deleted
    GONE = "gone"  # terminated or stopped; the group will replace it unless told otherwise

    @property
    def alive(self) -> bool:
        return self in (MemberState.PENDING, MemberState.RUNNING)


@dataclass(frozen=True)
class Member:
    """One VM of a group.

    Attributes:
        id: The cloud's id for it (AWS instance id, GCP instance name). Terraform's boot
            scripts use it as the agent's node id, so it is the node's name too.
        zone: Where it runs.
        instance_type: Its type (the group may mix several).
        state: See :class:`MemberState`.
        status: The cloud's own word for its state (``InService``,
            ``Terminating:Wait``, ``RUNNING``, ``DELETING``), for messages.
        market: Spot or on-demand.
        waiting_on_hook: It is held by a termination lifecycle hook until someone completes
            the action (AWS); its agent does so once its emergency checkpoint commits.
    """

    id: str
    zone: str
    instance_type: str
    state: MemberState
    status: str
    market: Market = Market.SPOT
    waiting_on_hook: bool = False

    @property
    def node(self) -> str:
        return self.id


@dataclass(frozen=True)
class GroupView:
    """A group as one describe call saw it.

    Attributes:
        name: The group's name.
        target: The size it keeps (ASG desired capacity, MIG target size).
        members: Every member it reports, leaving ones included.
        max_size: The most it may hold (AWS ``MaxSize``), or None when the cloud has no cap.
    """

    name: str
    target: int
    members: tuple[Member, ...]
    max_size: int | None = None

    @property
    def alive(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.state.alive)


@runtime_checkable
class Group(Protocol):
    """A group of VMs the cloud keeps at a size (see the module's contract)."""

    cloud: str
    name: str

    def describe(self) -> GroupView:
        """The group's size and members now."""
        ...

    def set_target(self, size: int) -> None:
        """Make the group keep ``size`` VMs. Growing launches VMs; the controller never
        shrinks a group this way (the group would pick the victims): it calls
        :meth:`remove` on the ones it chose."""
        ...

    def remove(self, ids: Sequence[str], *, replace: bool) -> None:
        """Remove these members. ``replace=False`` lowers the target by one per member (a
        scale-in); ``replace=True`` keeps it, so the group launches a new VM in its place
        (a broken VM). On AWS a member with a termination hook waits for its agent to
        complete the lifecycle action."""
        ...

    def release(self, member_id: str) -> None:
        """Let a member that a termination hook holds go now (its agent cannot: it has
        exited or failed). A no-op where the cloud has no such hook."""
        ...
