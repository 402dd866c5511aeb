"""Zonal managed instance groups (MIGs): insert, get, resize, deleteInstances,
recreateInstances, listManagedInstances, and how a group reconciles its members."""

from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from .common import API, ApiError, check_name, invalid, not_found, parse_body, timestamp
from .listing import matches, page_bounds, parse_filter
from .reconcile import Group, Member
from .state import GceState

_INSTANCE_URL_RE = re.compile(
    r"^(https?://[^/]+/compute/v1/)?(projects/(?P<p>[^/]+)/)?zones/(?P<z>[^/]+)/instances/"
    r"(?P<n>[^/]+)\Z"
)
_BASE_NAME_RE = re.compile(r"^[a-z][-a-z0-9]{0,57}\Z")
# The most instances one deleteInstances or recreateInstances may name.
_MAX_INSTANCES_PER_CALL = 1000
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


class GroupsMixin(GceState):
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

    def _serve_groups(
        self, call: str, zone: str, name: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, Any]] | None:
        if call == "instanceGroupManagers.insert":
            return 200, self._insert_group(zone, parse_body(raw))
        if call.startswith("instanceGroupManagers."):
            return 200, self._group_call(call, self._group(zone, name), query, raw)
        return None
