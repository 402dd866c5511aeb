"""How a managed instance group acts between calls: it deletes the members marked for
deletion, repairs failed ones (a VM stopped or deleted behind its back), reaches its target
size, and creates every missing VM from its template."""

from __future__ import annotations

import copy
import string
import time
from dataclasses import dataclass, field
from typing import Any

from .common import API, ApiError
from .state import GceState

# A member whose VM is in one of these has failed, and the MIG repairs it by recreating it.
_DOWN = ("TERMINATED", "STOPPED", "SUSPENDED")


@dataclass
class Member:
    """One managed instance: a name the MIG keeps a VM under.

    Attributes:
        vm_id: the id of the VM it has now; "" while it has none (being created, or its VM
            was deleted behind the MIG's back).
        replace: recreateInstances asked for a new VM; the next reconcile deletes the old one.
        template: the template URL its VM was created from.
        last_error: why the MIG's last attempt to create its VM failed (lastAttempt).
    """

    name: str
    action: str = "CREATING"
    vm_id: str = ""
    replace: bool = False
    template: str = ""
    last_error: dict[str, Any] | None = None


@dataclass
class Group:
    zone: str
    body: dict[str, Any]  # the stored resource, without the computed fields
    members: dict[str, Member] = field(default_factory=dict)


class ReconcileMixin(GceState):
    def reconcile_groups(self) -> None:
        """Let every managed instance group act now, as it would between two calls: delete the
        members marked for deletion, repair failed ones (a VM stopped or deleted by
        preemption), add or remove members to reach the target size, and try to create every
        missing VM (a stockout or quota fault leaves the member ``CREATING``, retried on the
        next pass)."""
        with self._lock:
            self._reconcile_groups()

    def _vm_of(self, group: Group, member: Member) -> dict[str, Any] | None:
        vm = self._instances.get(group.zone, {}).get(member.name)
        # A VM of the same name that the group did not create is not its member's.
        return vm if vm is not None and member.vm_id and vm["id"] == member.vm_id else None

    @staticmethod
    def _settle(member: Member, vm: dict[str, Any]) -> None:
        # The old VM of a member flagged for recreation still runs: that is not the new one.
        if member.replace:
            return
        if vm["status"] == "RUNNING" and member.action in ("CREATING", "RECREATING"):
            member.action = "NONE"

    def _reconcile_groups(self) -> None:
        for groups in self._groups.values():
            for group in groups.values():
                self._reconcile_group(group)

    def _reconcile_group(self, group: Group) -> None:
        zone = group.zone
        for member in list(group.members.values()):
            vm = self._vm_of(group, member)
            if member.action in ("DELETING", "ABANDONING"):
                if vm is not None:
                    self._drop_vm(zone, member.name)
                del group.members[member.name]
                continue
            if vm is not None and (member.replace or vm["status"] in _DOWN):
                # A spot VM stopped by preemption (or any VM stopped behind the group's back)
                # has failed: the real MIG repairs it by recreating it under the same name,
                # retrying until capacity lets it (instanceLifecyclePolicy
                # defaultActionOnFailure REPAIR, the default).
                self._drop_vm(zone, member.name)
                vm = None
                member.vm_id = ""
                if member.action == "NONE":
                    member.action = "RECREATING"
            elif vm is None and member.vm_id:
                # Deleted behind the group's back (a spot VM whose termination action is
                # DELETE, or instances.delete): recreated the same way.
                member.vm_id = ""
                if member.action == "NONE":
                    member.action = "RECREATING"
            member.replace = False
        excess = len(group.members) - group.body["targetSize"]
        if excess > 0:
            for victim in self._victims(group)[:excess]:
                if self._vm_of(group, victim) is not None:
                    self._drop_vm(zone, victim.name)
                del group.members[victim.name]
        while len(group.members) < group.body["targetSize"]:
            name = self._member_name(group)
            group.members[name] = Member(name)
        for member in group.members.values():
            if not member.vm_id:
                self._create_member_vm(group, member)
            vm = self._vm_of(group, member)
            if vm is not None:
                self._settle(member, vm)

    def _victims(self, group: Group) -> list[Member]:
        """The order a resize down removes members in. The API only says it weighs the VMs'
        status; the fake takes members without a VM first, then VMs not running, then the
        rest, by name from the last."""

        def tier(member: Member) -> int:
            vm = self._vm_of(group, member)
            return 0 if vm is None else 1 if vm["status"] != "RUNNING" else 2

        by_name = sorted(group.members.values(), key=lambda m: m.name, reverse=True)
        return sorted(by_name, key=tier)

    def _member_name(self, group: Group) -> str:
        """``BASE-xxxx``: the API appends a hyphen and four random characters (lowercase letters
        and digits) to the base instance name."""
        taken = set(self._instances.get(group.zone, {}))
        for other in self._groups.get(group.zone, {}).values():
            taken |= set(other.members)
        alphabet = string.ascii_lowercase + string.digits
        while True:
            suffix = "".join(self._rng.choice(alphabet) for _ in range(4))
            name = f"{group.body['baseInstanceName']}-{suffix}"
            if name not in taken:
                return name

    def _create_member_vm(self, group: Group, member: Member) -> None:
        """One attempt to create the member's VM from the group's template; a failure is kept
        as the member's lastAttempt and retried on the next reconcile."""
        zone = group.zone
        template_link = group.body["instanceTemplate"]
        template = self._template_at(template_link)
        if template is None:
            member.last_error = {
                "code": "RESOURCE_NOT_FOUND",
                "message": f"The resource '{template_link}' was not found",
            }
            return
        body = self._member_body(group, member.name, template)
        try:
            machine_type = self._validate_insert(zone, body)
            if member.name in self._instances.get(zone, {}):
                raise ApiError(
                    409,
                    f"The resource 'projects/{self.project}/zones/{zone}/instances/"
                    f"{member.name}' already exists",
                    "RESOURCE_ALREADY_EXISTS",
                )
        except ApiError as e:
            error = e.body["error"]
            member.last_error = {"code": error["errors"][0]["reason"], "message": error["message"]}
            return
        fault = self._quota_fault(zone) or self._stockout_fault(zone, machine_type)
        if fault is not None:
            member.last_error = fault[1]
            return
        vm_id = str(next(self._ids))
        link = f"{API}/projects/{self.project}/zones/{zone}/instances/{member.name}"
        self._instances.setdefault(zone, {})[member.name] = self._complete(zone, body, vm_id, link)
        self._stepped_at[(zone, member.name)] = time.monotonic()
        member.vm_id = vm_id
        member.template = template_link
        member.last_error = None

    def _member_body(self, group: Group, name: str, template: dict[str, Any]) -> dict[str, Any]:
        """The instance insert a template's properties make in the group's zone."""
        zone = group.zone
        body: dict[str, Any] = copy.deepcopy(template["properties"])
        body["name"] = name
        body["machineType"] = f"zones/{zone}/machineTypes/{body['machineType']}"
        for disk in body.get("disks", []):
            params = disk.get("initializeParams", {})
            if params.get("diskType") and "/" not in params["diskType"]:
                params["diskType"] = f"zones/{zone}/diskTypes/{params['diskType']}"
        for accelerator in body.get("guestAccelerators", []):
            kind = accelerator.get("acceleratorType", "")
            if kind and "/" not in kind:
                accelerator["acceleratorType"] = f"zones/{zone}/acceleratorTypes/{kind}"
        # The real MIG marks its VMs so: agents read created-by to find their group.
        items = body.setdefault("metadata", {}).setdefault("items", [])
        items.append(
            {
                "key": "created-by",
                "value": f"projects/{self.project}/zones/{zone}/instanceGroupManagers/"
                f"{group.body['name']}",
            }
        )
        items.append(
            {
                "key": "instance-template",
                "value": f"projects/{self.project}/global/instanceTemplates/{template['name']}",
            }
        )
        return body

    def _drop_vm(self, zone: str, name: str) -> None:
        self._instances.get(zone, {}).pop(name, None)
        self._stepped_at.pop((zone, name), None)
