"""A zonal Compute Engine managed instance group (MIG) as a
:class:`~spottrain.cloud.base.groups.Group`.

Terraform (``terraform/gcp``) creates the instance template and the MIG; this module only
reads and steers it, through ``google-cloud-compute`` over REST like :mod:`spottrain.cloud.gcp`,
whose client construction, call wrapper, operation wait and error classifier it uses.

How the :class:`~spottrain.cloud.base.groups.Group` contract maps onto a MIG:

- **describe** is ``instanceGroupManagers.get`` (the target size and the template) plus one
  ``listManagedInstances``. A member's state comes from the group's ``currentAction`` for it
  and its VM's ``instanceStatus`` (:func:`member_state`). ``listManagedInstances`` does not say
  what a VM is, so the machine type and market come from the member's instance template
  (read once per template: templates are immutable), or from the VM itself when that template
  is gone.
- **set_target** is ``resize``, skipped when the target is already that size.
- **remove** is ``deleteInstances`` (the API lowers the target by one per member it deletes)
  or, with ``replace``, ``recreateInstances`` (the target stays; the member keeps its name
  and gets a new VM). Members that are unknown, gone, or already leaving are dropped from the
  request first, and ``deleteInstances`` is sent with ``skipInstancesOnValidationError`` for
  the ones that leave in between.
- **release** does nothing: Compute Engine has no termination hook to complete.

Each mutating call waits for its operation (at most ``op_wait_s``). The API marks these
operations DONE once the group has scheduled the work, not when the VMs are created or
deleted; the next describe shows the progress.

A member keeps its name for life on GCP: a VM the group recreates (after a preemption, or
``remove(replace=True)``) comes back under the same name, so the controller sees the same
member id go GONE or PENDING and then RUNNING again, rather than a new id.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spottrain.cloud.base import BadRequestError, Market, region_of_zone
from spottrain.cloud.base.groups import GroupView, Member, MemberState
from spottrain.cloud.gcp.api import (
    _is_not_found,
    _last,
    call_api,
    list_all,
    rest_client,
    wait_zone_operation,
)
from spottrain.cloud.gcp.errors import CallTarget, classify_error
from spottrain.cloud.gcp.group_states import _NOT_TO_RECREATE, member_state
from spottrain.cloud.gcp.settings import _NAME_RE, _PROJECT_RE, CLOUD
from spottrain.lazy_import import lazy_import

if TYPE_CHECKING:
    from google.auth.credentials import Credentials
    from google.cloud import compute_v1

TERRAFORM_OUTPUT = "spottrain_fleet.group"

_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]\Z")
# terraform/gcp points the group at the template's self_link_unique, which ends in
# ?uniqueId=ID; the last segment may also be the numeric id, which the API takes as a name.
_TEMPLATE_RE = re.compile(
    r"(^|/)projects/(?P<project>[^/]+)/global/instanceTemplates/(?P<name>[^/?]+)(\?.*)?\Z"
)
# The most instances one deleteInstances or recreateInstances may name.
_BATCH = 1000


@dataclass(frozen=True)
class _Shape:
    instance_type: str
    market: Market


@dataclass
class _Clients:
    groups: compute_v1.InstanceGroupManagersClient
    templates: compute_v1.InstanceTemplatesClient
    instances: compute_v1.InstancesClient
    operations: compute_v1.ZoneOperationsClient


class GcpMigGroup:
    """One zonal managed instance group, as the controller adopts it.

    Args:
        project: the project id the group lives in.
        zone: its zone (``us-central1-a``); regional groups are not supported.
        name: the group's name (Terraform output ``spottrain_fleet.group``).
        api_endpoint: another endpoint for the Compute API (``http://127.0.0.1:PORT`` for the
            test fake); None: Google's.
        credentials: Google credentials; None uses Application Default Credentials, looked up
            on the first API call.
        request_timeout_s: the timeout of each API call.
        op_wait_s: how long a mutating call waits for its operation; past that it returns
            (the group has the request; describe shows the outcome).

    Raises:
        ImportError: google-cloud-compute is not installed (install the ``gcp`` extra).
        ValueError: the project, zone or name is malformed.
    """

    cloud = CLOUD

    def __init__(
        self,
        project: str,
        zone: str,
        name: str,
        *,
        api_endpoint: str | None = None,
        credentials: Credentials | None = None,
        request_timeout_s: float = 60.0,
        op_wait_s: float = 60.0,
    ) -> None:
        lazy_import(
            "google.cloud.compute_v1",
            needs="the gcp cloud needs google-cloud-compute",
            extra="gcp",
            show_cause=True,
        )
        if not _PROJECT_RE.match(project):
            raise ValueError(
                f"gcp project {project!r} is not a project id: 6-30 lowercase letters, digits "
                "and '-', starting with a letter (see `gcloud projects list`)"
            )
        if not _ZONE_RE.match(zone):
            raise ValueError(
                f"gcp zone {zone!r} is not a zone name like 'us-central1-a' (regional managed "
                "instance groups are not supported)"
            )
        if not _NAME_RE.match(name):
            raise ValueError(
                f"gcp group name {name!r} is not a managed instance group name (1-63 lowercase "
                f"letters, digits and '-'); take it from the Terraform output `{TERRAFORM_OUTPUT}`"
            )
        if not request_timeout_s > 0:
            raise ValueError(f"gcp request_timeout_s must be > 0, got {request_timeout_s}")
        if not op_wait_s >= 0:
            raise ValueError(f"gcp op_wait_s must be >= 0, got {op_wait_s}")
        self.project = project
        self.zone = zone
        self.name = name
        self._endpoint = api_endpoint
        self._credentials = credentials
        self._timeout = request_timeout_s
        self._op_wait_s = op_wait_s
        self._target = CallTarget(zone=zone, region=region_of_zone("gcp", zone))
        self._lock = threading.Lock()
        self._clients: _Clients | None = None
        # Instance templates cannot change once created, so what one says is cached for good;
        # None marks a template that no longer exists.
        self._templates: dict[str, _Shape | None] = {}
        self._vms: dict[tuple[str, int], _Shape] = {}  # (name, VM id) -> its shape

    def __repr__(self) -> str:
        return f"GcpMigGroup({self.project!r}, {self.zone!r}, {self.name!r})"

    # the Group protocol

    def describe(self) -> GroupView:
        """The group's target size and every member it reports, leaving ones included.

        Raises:
            BadRequestError: the group does not exist (the message says where to look).
            AuthError, TransientError: the API could not be asked.
        """
        group = self._get()
        default = group.instance_template or (
            group.versions[0].instance_template if group.versions else ""
        )
        members = [self._member(found, default) for found in self._managed()]
        names = {m.id for m in members}
        with self._lock:
            self._vms = {k: v for k, v in self._vms.items() if k[0] in names}
        return GroupView(
            name=self.name,
            target=group.target_size,
            members=tuple(sorted(members, key=lambda m: m.id)),
        )

    def set_target(self, size: int) -> None:
        """Make the group keep ``size`` VMs (no call when it already has that target).

        Raises:
            ValueError: ``size`` is negative.
            BadRequestError: the group does not exist, or the API refused the size.
            AuthError, QuotaError, TransientError: the API refused or failed the call.
        """
        if size < 0:
            raise ValueError(f"a group's target size must be >= 0, got {size}")
        if self._get().target_size == size:
            return
        api = self._api()
        op = self._group_call(
            api.groups.resize_unary,
            project=self.project,
            zone=self.zone,
            instance_group_manager=self.name,
            size=size,
        )
        self._finish(op)

    def remove(self, ids: Sequence[str], *, replace: bool) -> None:
        """Delete these members, lowering the target by one each (``replace=False``), or have
        the group recreate each under its name, keeping the target (``replace=True``).

        Members that are unknown, already gone or already leaving are skipped, and so, with
        ``replace``, are members the group is already creating or recreating.

        Raises:
            BadRequestError: the group does not exist, or the API refused the request.
            AuthError, TransientError: the API refused or failed a call.
        """
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return
        chosen = self._removable(wanted, replace=replace)
        for start in range(0, len(chosen), _BATCH):
            batch = chosen[start : start + _BATCH]
            if replace:
                self._recreate(batch)
            else:
                self._delete(batch)

    def release(self, member_id: str) -> None:
        """Nothing to do on GCP.

        Compute Engine has no termination lifecycle hook: a preempted spot VM gets its ACPI
        shutdown (about 30 seconds, in which the agent checkpoints) and then stops, whatever
        anyone does, and a deleted VM is shut down the same way. No VM is ever held waiting
        for someone to let it go.
        """

    # calls

    def _api(self) -> _Clients:
        with self._lock:
            if self._clients is None:
                from google.cloud import compute_v1

                self._clients = _Clients(
                    groups=self._client(compute_v1.InstanceGroupManagersClient),
                    templates=self._client(compute_v1.InstanceTemplatesClient),
                    instances=self._client(compute_v1.InstancesClient),
                    operations=self._client(compute_v1.ZoneOperationsClient),
                )
            return self._clients

    def _client(self, kind: Any) -> Any:
        return rest_client(kind, self._credentials, self._endpoint)

    def _group_call(self, fn: Any, **kwargs: Any) -> Any:
        """A call on the group; a 404 means the group (or its zone) does not exist."""
        try:
            return call_api(self._target, self._timeout, fn, **kwargs)
        except BadRequestError as e:
            if _is_not_found(e):
                raise self._missing(e) from e
            raise

    def _missing(self, error: BadRequestError) -> BadRequestError:
        return BadRequestError(
            CLOUD,
            f"managed instance group {self.name!r} not found in zone {self.zone} of project "
            f"{self.project}; check the Terraform output `{TERRAFORM_OUTPUT}` (and that the "
            f"zone and project match the ones Terraform used) ({error.message})",
        )

    def _get(self) -> compute_v1.InstanceGroupManager:
        api = self._api()
        group: compute_v1.InstanceGroupManager = self._group_call(
            api.groups.get,
            project=self.project,
            zone=self.zone,
            instance_group_manager=self.name,
        )
        return group

    def _managed(self) -> list[compute_v1.ManagedInstance]:
        from google.cloud import compute_v1

        api = self._api()
        request = compute_v1.ListManagedInstancesInstanceGroupManagersRequest(
            project=self.project, zone=self.zone, instance_group_manager=self.name
        )
        try:
            return list_all(self._target, self._timeout, api.groups.list_managed_instances, request)
        except BadRequestError as e:
            if _is_not_found(e):
                raise self._missing(e) from e
            raise

    def _finish(self, op: compute_v1.Operation) -> None:
        """Wait for a group operation; raise what it failed with."""
        done = wait_zone_operation(
            self._api().operations,
            op,
            project=self.project,
            target=self._target,
            budget_s=self._op_wait_s,
            request_timeout_s=self._timeout,
        )
        if done.error.errors:
            raise classify_error(done, self._target)

    # remove

    def _removable(self, ids: Iterable[str], *, replace: bool) -> list[str]:
        """The instance URLs of the members among ``ids`` that a delete (or a recreate)
        still applies to."""
        skip = _NOT_TO_RECREATE if replace else frozenset({"DELETING", "ABANDONING"})
        found = {m.name: m for m in self._managed()}
        urls: list[str] = []
        for member_id in ids:
            member = found.get(member_id)
            if member is None or member.current_action in skip:
                continue
            urls.append(member.instance or f"zones/{self.zone}/instances/{member_id}")
        return urls

    def _delete(self, urls: list[str]) -> None:
        from google.cloud import compute_v1

        api = self._api()
        op = self._group_call(
            api.groups.delete_instances_unary,
            project=self.project,
            zone=self.zone,
            instance_group_manager=self.name,
            instance_group_managers_delete_instances_request_resource=(
                compute_v1.InstanceGroupManagersDeleteInstancesRequest(
                    instances=urls,
                    # A member that left between our list and this call is not an error.
                    skip_instances_on_validation_error=True,
                )
            ),
        )
        self._finish(op)

    def _recreate(self, urls: list[str]) -> None:
        from google.cloud import compute_v1

        api = self._api()
        for attempt in range(2):
            try:
                op = self._group_call(
                    api.groups.recreate_instances_unary,
                    project=self.project,
                    zone=self.zone,
                    instance_group_manager=self.name,
                    instance_group_managers_recreate_instances_request_resource=(
                        compute_v1.InstanceGroupManagersRecreateInstancesRequest(instances=urls)
                    ),
                )
            except BadRequestError as e:
                # recreateInstances has no skip flag: a member that left since our list fails
                # the whole call. Ask again without the ones that left, once.
                if attempt or _is_not_found(e):
                    raise
                names = [_last(url) for url in urls]
                still = self._removable(names, replace=True)
                if still == urls:
                    raise
                if not still:
                    return
                urls = still
                continue
            self._finish(op)
            return

    # describe

    def _member(self, found: compute_v1.ManagedInstance, default_template: str) -> Member:
        action = found.current_action
        status = found.instance_status
        state = member_state(action, status)
        shape = self._shape(found, default_template)
        words = [w for w in (status, "" if action == "NONE" else action) if w]
        text = "/".join(words) or "UNKNOWN"
        errors = [e.code for e in found.last_attempt.errors.errors if e.code]
        if errors and state is not MemberState.RUNNING:
            # A stockout shows only here: the member stays CREATING while the group retries.
            text += f" (last attempt: {', '.join(errors)})"
        name = found.name or _last(found.instance)
        return Member(
            id=name,
            zone=self.zone,
            instance_type=shape.instance_type,
            state=state,
            status=text,
            market=shape.market,
        )

    def _shape(self, found: compute_v1.ManagedInstance, default_template: str) -> _Shape:
        """What the member is: from its own template, else (that template was deleted, after
        a Terraform apply replaced it) from its VM, else from the group's template."""
        shape = self._template_shape(found.version.instance_template or default_template)
        if shape is not None:
            return shape
        if found.id:
            shape = self._vm_shape(found.name, found.id)
            if shape is not None:
                return shape
        shape = self._template_shape(default_template)
        return shape if shape is not None else _Shape("", Market.SPOT)

    def _template_shape(self, url: str) -> _Shape | None:
        if not url:
            return None
        with self._lock:
            if url in self._templates:
                return self._templates[url]
        m = _TEMPLATE_RE.search(url)
        if m is None:
            raise BadRequestError(
                CLOUD,
                f"managed instance group {self.name!r} uses instance template {url}, which is not "
                "a global instance template; spottrain reads only global templates "
                "(google_compute_instance_template in Terraform)",
            )
        api = self._api()
        try:
            template = call_api(
                self._target,
                self._timeout,
                api.templates.get,
                project=m["project"],
                instance_template=m["name"],
            )
        except BadRequestError as e:
            if not _is_not_found(e):
                raise
            shape = None
        else:
            props = template.properties
            spot = props.scheduling.provisioning_model == "SPOT" or props.scheduling.preemptible
            shape = _Shape(_last(props.machine_type), Market.SPOT if spot else Market.ON_DEMAND)
        with self._lock:
            self._templates[url] = shape
        return shape

    def _vm_shape(self, name: str, vm_id: int) -> _Shape | None:
        with self._lock:
            if (name, vm_id) in self._vms:
                return self._vms[(name, vm_id)]
        api = self._api()
        try:
            vm = call_api(
                self._target,
                self._timeout,
                api.instances.get,
                project=self.project,
                zone=self.zone,
                instance=name,
            )
        except BadRequestError as e:
            if _is_not_found(e):
                return None
            raise
        spot = vm.scheduling.provisioning_model == "SPOT" or vm.scheduling.preemptible
        shape = _Shape(_last(vm.machine_type), Market.SPOT if spot else Market.ON_DEMAND)
        with self._lock:
            self._vms[(name, vm_id)] = shape
        return shape
