"""Zonal managed instance groups (MIGs): insert, get, resize, deleteInstances,
recreateInstances, listManagedInstances, and how a group reconciles its members."""

from __future__ import annotations

import copy
import re
import string
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .common import API, ApiError, check_name, invalid, not_found, parse_body, timestamp
from .listing import matches, page_bounds, parse_filter
from .state import GceState

_INSTANCE_URL_RE = re.compile(
    r"^(https?://[^/]+/compute/v1/)?(projects/(?P<p>[^/]+)/)?zones/(?P<z>[^/]+)/instances/"
    r"(?P<n>[^/]+)\Z"
)
_BASE_NAME_RE = re.compile(r"^[a-z][-a-z0-9]{0,57}\Z")
# The most instances one deleteInstances or recreateInstances may name.
_MAX_INSTANCES_PER_CALL = 1000
# A member whose VM is in one of these has failed, and the MIG repairs it by recreating it.
_DOWN = ("TERMINATED", "STOPPED", "SUSPENDED")
_ACTIONS = {
    "none": "NONE",
    "creating": "CREATING",
    "creatingWithoutRetries": "CREATING_WITHOUT_RETRIES",
    "recreating": "RECREATING",
    "deleting": "DELETING",
    "abandoning": "ABANDONING",
    "restarting": "RESTARTING",
    "refreshing": "REFRESHING",
    "verifying": "VERIFYING",
}


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


class GroupsMixin(GceState):
    def reconcile_groups(self) -> None:
        """Let every managed instance group act now, as it would between two calls: delete the
        members marked for deletion, repair failed ones (a VM stopped or deleted by
        preemption), add or remove members to reach the target size, and try to create every
        missing VM (a stockout or quota fault leaves the member ``CREATING``, retried on the
        next pass)."""
        with self._lock:
            self._reconcile_groups()

    def create_group(
        self,
        name: str,
        zone: str,
        *,
        machine_type: str,
        target_size: int = 0,
        base_instance_name: str | None = None,
        spot: bool = True,
        termination_action: str = "STOP",
        labels: Mapping[str, str] | None = None,
        startup_script: str = "",
    ) -> dict[str, Any]:
        """Provision an instance template ``NAME-template`` and a zonal MIG, as ``terraform
        apply`` would through the API and validated the same way; the MIG's resource. Its
        members appear on the next reconcile.

        Raises:
            ApiError: the API would refuse the template or the group.
        """
        scheduling: dict[str, Any] = {
            "provisioningModel": "SPOT" if spot else "STANDARD",
            "onHostMaintenance": "TERMINATE",
            "automaticRestart": not spot,
        }
        if spot:
            scheduling["instanceTerminationAction"] = termination_action
        nic: dict[str, Any] = {"network": "global/networks/default"}
        if machine_type.startswith(("a3-", "a4-")):
            nic["nicType"] = "GVNIC"
        items = [{"key": "startup-script", "value": startup_script}] if startup_script else []
        template = {
            "name": f"{name}-template",
            "properties": {
                "machineType": machine_type,
                "scheduling": scheduling,
                "labels": dict(labels or {}),
                "metadata": {"items": items},
                "disks": [
                    {
                        "boot": True,
                        "autoDelete": True,
                        "initializeParams": {
                            "sourceImage": "projects/debian-cloud/global/images/family/debian-12",
                            "diskSizeGb": "200",
                            "diskType": "pd-balanced",
                        },
                    }
                ],
                "networkInterfaces": [nic],
            },
        }
        with self._lock:
            if zone not in self._machine_types:
                raise not_found(f"projects/{self.project}/zones/{zone}")
            self._insert_template(template)
            stored = self._templates[f"{name}-template"]
            self._insert_group(
                zone,
                {
                    "name": name,
                    "baseInstanceName": base_instance_name or name,
                    # How terraform/gcp names it: self_link_unique.
                    "versions": [
                        {"instanceTemplate": f"{stored['selfLink']}?uniqueId={stored['id']}"}
                    ],
                    "targetSize": target_size,
                },
            )
            return self._group_resource(self._groups[zone][name])

    def group(self, name: str) -> dict[str, Any] | None:
        """The MIG as ``instanceGroupManagers.get`` shows it (without letting it act), or None."""
        with self._lock:
            found = self._find_group(name)
            return None if found is None else self._group_resource(found)

    def managed_instances(self, name: str) -> list[dict[str, Any]]:
        """The MIG's members as ``listManagedInstances`` shows them, without letting the group
        act or moving any VM's status.

        Raises:
            KeyError: no group of that name.
        """
        with self._lock:
            found = self._find_group(name)
            if found is None:
                raise KeyError(name)
            return [self._managed(found, m, read=False) for _, m in sorted(found.members.items())]

    def group_calls(self, name: str) -> list[str]:
        """The ``instanceGroupManagers`` methods called on the group ``name``, in order (failed
        calls included)."""
        with self._lock:
            return list(self._group_calls.get(name, []))

    def _insert_group(self, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name", "")
        check_name(name)
        base = body.get("baseInstanceName", "")
        if "#" in base:
            raise ApiError(
                400,
                "The fake Compute API names members only with random suffixes, not with "
                f"the sequential numbers that baseInstanceName '{base}' asks for.",
                "invalid",
            )
        if not _BASE_NAME_RE.match(base):
            raise invalid(
                "resource.baseInstanceName",
                base,
                "Must be a match of regex '[a-z](([-a-z0-9]{0,57})|"
                "([-a-z0-9]{0,51}-#{1,10}(\\[[0-9]{1,10}\\])?))'",
            )
        versions = body.get("versions") or []
        template = body.get("instanceTemplate", "")
        if len(versions) > 1 or (versions and "targetSize" in versions[0]):
            raise ApiError(
                400, "The fake Compute API supports one version per group (no canary).", "invalid"
            )
        if versions:
            if template and versions[0].get("instanceTemplate") != template:
                raise invalid(
                    "resource.instanceTemplate",
                    template,
                    "It differs from versions[0].instanceTemplate.",
                )
            template = versions[0].get("instanceTemplate", "")
        if not template:
            raise ApiError(
                400, "Invalid value for field 'resource.instanceTemplate': ''.", "required"
            )
        template_link = self._template_link(template, "resource.instanceTemplate")
        size = body.get("targetSize", 0)
        if not isinstance(size, int) or size < 0:
            raise invalid("resource.targetSize", size, "Must be a non-negative integer.")
        results = body.get("listManagedInstancesResults", "PAGELESS")
        if results not in ("PAGELESS", "PAGINATED"):
            raise invalid("resource.listManagedInstancesResults", results, "")
        if name in self._groups.get(zone, {}):
            raise ApiError(
                409,
                f"The resource 'projects/{self.project}/zones/{zone}/instanceGroupManagers/"
                f"{name}' already exists",
                "alreadyExists",
            )
        where = f"{API}/projects/{self.project}/zones/{zone}"
        stored = copy.deepcopy(body)
        stored.update(
            kind="compute#instanceGroupManager",
            id=str(next(self._ids)),
            creationTimestamp=timestamp(),
            zone=where,
            selfLink=f"{where}/instanceGroupManagers/{name}",
            instanceGroup=f"{where}/instanceGroups/{name}",
            instanceTemplate=template_link,
            versions=[
                {"name": (versions or [{}])[0].get("name", ""), "instanceTemplate": template_link}
            ],
            targetSize=size,
            listManagedInstancesResults=results,
            fingerprint="fake-fingerprint=",
        )
        self._groups.setdefault(zone, {})[name] = Group(zone, stored)
        return self._new_operation(zone, "compute.instanceGroupManagers.insert", stored)

    def _group(self, zone: str, name: str) -> Group:
        found = self._groups.get(zone, {}).get(name)
        if found is None:
            raise not_found(f"projects/{self.project}/zones/{zone}/instanceGroupManagers/{name}")
        return found

    def _find_group(self, name: str) -> Group | None:
        for groups in self._groups.values():
            if name in groups:
                return groups[name]
        return None

    def _group_call(
        self, call: str, group: Group, query: dict[str, str], raw: bytes
    ) -> dict[str, Any]:
        if call == "instanceGroupManagers.get":
            return self._group_resource(group)
        if call == "instanceGroupManagers.listManagedInstances":
            return self._list_managed(group, query)
        if call == "instanceGroupManagers.resize":
            try:
                size = int(query["size"])
            except (KeyError, ValueError):
                raise ApiError(
                    400, "Invalid value for field 'size': ''. A size is required.", "required"
                ) from None
            if size < 0:
                raise invalid("size", size, "Must be greater than or equal to 0.")
            group.body["targetSize"] = size
            return self._new_operation(
                group.zone, "compute.instanceGroupManagers.resize", group.body
            )
        body = parse_body(raw)
        if call == "instanceGroupManagers.deleteInstances":
            skip = body.get("skipInstancesOnValidationError", False) is True
            names = self._members_named(group, body, skip=skip)
            for name in names:
                group.members[name].action = "DELETING"
            # The API lowers the target by the members it deletes, so the group does not
            # create others in their place.
            group.body["targetSize"] = max(0, group.body["targetSize"] - len(names))
            return self._new_operation(
                group.zone, "compute.instanceGroupManagers.deleteInstances", group.body
            )
        if call == "instanceGroupManagers.recreateInstances":
            for name in self._members_named(group, body, skip=False):
                member = group.members[name]
                if member.vm_id:
                    member.action = "RECREATING"
                    member.replace = True
            return self._new_operation(
                group.zone, "compute.instanceGroupManagers.recreateInstances", group.body
            )
        raise AssertionError(f"unrouted call {call}")  # pragma: no cover

    def _members_named(self, group: Group, body: dict[str, Any], *, skip: bool) -> list[str]:
        """The members a deleteInstances or recreateInstances body names, checked as the API
        checks them: a malformed URL or one in another zone always fails the call; a VM that
        is not a member, or is already being deleted or abandoned, fails it unless ``skip``
        (``skipInstancesOnValidationError``, which only deleteInstances has)."""
        refs = body.get("instances") or []
        if not refs:
            raise ApiError(400, "Invalid value for field 'resource.instances': ''.", "required")
        if len(refs) > _MAX_INSTANCES_PER_CALL:
            raise invalid(
                "resource.instances",
                len(refs),
                f"At most {_MAX_INSTANCES_PER_CALL} instances per request.",
            )
        names: list[str] = []
        for ref in refs:
            m = _INSTANCE_URL_RE.match(ref) if isinstance(ref, str) else None
            if m is None or m["p"] not in (None, self.project):
                raise invalid("resource.instances", ref, "Expected an instance URL.")
            if m["z"] != group.zone:
                raise invalid(
                    "resource.instances",
                    ref,
                    f"The instance is not in zone '{group.zone}' of the instance group.",
                )
            member = group.members.get(m["n"])
            if member is None or member.action in ("DELETING", "ABANDONING"):
                if skip:
                    continue
                raise ApiError(
                    400,
                    f"Instance '{ref}' is not a member of instance group manager "
                    f"'{group.body['name']}', or is already being deleted or abandoned.",
                    "invalid",
                )
            if m["n"] not in names:
                names.append(m["n"])
        return names

    def _group_resource(self, group: Group) -> dict[str, Any]:
        body = copy.deepcopy(group.body)
        actions = Counter(m.action for m in group.members.values())
        body["currentActions"] = {key: actions[value] for key, value in _ACTIONS.items()}
        stable = len(group.members) == body["targetSize"] and set(actions) <= {"NONE"}
        body["status"] = {"isStable": stable, "versionTarget": {"isReached": True}}
        return body

    def _list_managed(self, group: Group, query: dict[str, str]) -> dict[str, Any]:
        # A PAGELESS group (the default) ignores maxResults and pageToken and answers all.
        paginated = group.body["listManagedInstancesResults"] == "PAGINATED"
        terms = parse_filter(query.get("filter", ""))
        items = [
            item
            for _, member in sorted(group.members.items())
            if matches(item := self._managed(group, member, read=True), terms)
        ]
        body: dict[str, Any] = {}
        if paginated:
            start, end = page_bounds(query, len(items), self.page_size)
            if end < len(items):
                body["nextPageToken"] = str(end)
            items = items[start:end]
        if items:
            body["managedInstances"] = items
        return body

    def _managed(self, group: Group, member: Member, *, read: bool) -> dict[str, Any]:
        """A member as listManagedInstances shows it; ``read`` reads its VM, which moves the VM
        one step towards RUNNING as any read does."""
        zone = group.zone
        item: dict[str, Any] = {
            "name": member.name,
            # The API gives the URL even before the VM exists.
            "instance": f"{API}/projects/{self.project}/zones/{zone}/instances/{member.name}",
            "currentAction": member.action,
            "version": {"instanceTemplate": member.template or group.body["instanceTemplate"]},
        }
        vm = self._vm_of(group, member)
        if vm is not None:
            shown = self._read(zone, member.name) if read else copy.deepcopy(vm)
            self._settle(member, shown)
            item.update(id=shown["id"], instanceStatus=shown["status"], currentAction=member.action)
        if member.last_error is not None:
            item["lastAttempt"] = {"errors": {"errors": [copy.deepcopy(member.last_error)]}}
        return item

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

    def _serve_groups(
        self, call: str, zone: str, name: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, Any]] | None:
        if call == "instanceGroupManagers.insert":
            return 200, self._insert_group(zone, parse_body(raw))
        if call.startswith("instanceGroupManagers."):
            return 200, self._group_call(call, self._group(zone, name), query, raw)
        return None
