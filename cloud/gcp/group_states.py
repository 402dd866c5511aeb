"""What a managed instance group's member is: its state from the group's current action and
the VM's status."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spottrain.cloud.base.groups import MemberState

if TYPE_CHECKING:
    pass


# The group's action for a member says more than the VM's status while it lasts, except that
# a VM that is down is GONE whatever the group plans for it: the controller must learn that
# it lost the node even while the group already recreates it.
_LEAVING_ACTIONS = frozenset({"DELETING", "ABANDONING", "STOPPING", "SUSPENDING"})
_PENDING_ACTIONS = frozenset(
    {
        "CREATING",
        "CREATING_WITHOUT_RETRIES",
        "RECREATING",
        "VERIFYING",
        "RESTARTING",
        "STARTING",
        "RESUMING",
    }
)
_GONE_STATUSES = frozenset({"TERMINATED", "STOPPED", "SUSPENDED"})
# REPAIRING as gcp.py counts it: the VM is out of service.
_LEAVING_STATUSES = frozenset(
    {"STOPPING", "SUSPENDING", "PENDING_STOP", "DEPROVISIONING", "REPAIRING"}
)
_PENDING_STATUSES = frozenset({"PROVISIONING", "STAGING", "PENDING"})
# Members not worth a recreateInstances: already leaving, or already getting a new VM.
_NOT_TO_RECREATE = frozenset(
    {"DELETING", "ABANDONING", "CREATING", "CREATING_WITHOUT_RETRIES", "RECREATING"}
)


def member_state(current_action: str, instance_status: str) -> MemberState:
    """A member's state from the group's ``currentAction`` for it and its VM's
    ``instanceStatus`` ("" while it has no VM)."""
    if current_action in _LEAVING_ACTIONS:
        return MemberState.LEAVING
    if instance_status in _GONE_STATUSES:
        return MemberState.GONE
    if instance_status in _LEAVING_STATUSES:
        return MemberState.LEAVING
    if current_action in _PENDING_ACTIONS:
        return MemberState.PENDING
    if instance_status == "RUNNING":
        return MemberState.RUNNING
    if instance_status in _PENDING_STATUSES:
        return MemberState.PENDING
    if not instance_status:
        # No VM and nothing creating one: it was deleted behind the group's back (a spot
        # VM whose termination action is DELETE) and the group has not noticed yet.
        return MemberState.GONE
    return MemberState.PENDING  # a status newer than this module
