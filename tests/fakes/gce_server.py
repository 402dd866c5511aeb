"""A fake of the Compute Engine v1 REST API over real HTTP, for the real ``google-cloud-compute``
client.

It serves the subset spottrain uses, in the API's own JSON (camelCase field names, resource
URLs, RFC 3339 timestamps, ``{"error": {"code", "message", "errors": [...]}}`` bodies)::

    instances             insert, get, list, aggregatedList, delete
    zoneOperations        get, list, wait, delete
    machineTypes          get, list, aggregatedList
    instanceTemplates     insert, get (global)
    globalOperations      get, wait
    instanceGroupManagers insert, get, resize, deleteInstances, recreateInstances,
                          listManagedInstances (zonal managed instance groups, MIGs)

and refuses what the real API refuses on insert: a bad name (400), an unknown zone, machine
type or image (404), a duplicate name in the zone (409 ``alreadyExists``), a GPU machine type
that may live-migrate (400), a spot VM that may migrate or restart itself (400), GPUs spelled
out for a type that has them built in (400), an A3 without gVNIC (400), bad labels and
metadata (400). List filters support ``field = "value"``, ``field != "value"`` and a
conjunction of those (``(a = "x") (b = "y")`` or ``AND``) over dotted camelCase fields such as
``labels.spottrain-job`` or ``operationType``; any other syntax is answered 400, so a client
filter the fake does not understand fails loudly instead of matching everything.

Lifecycle, documented so that tests can rely on it:

- ``insert`` creates the VM at once, status ``PROVISIONING``, and answers an operation that
  is ``RUNNING``; the operation is ``DONE`` once polled (``get`` or ``wait``)
  ``op_polls_until_done`` times (default 1). A failed insert (a stockout or quota fault
  raised through the operation) creates no VM.
- Each read of a VM (get, list, aggregatedList) moves it one step along PROVISIONING ->
  STAGING -> RUNNING, once ``boot_delay`` seconds (default 0) have passed since its last step.
- ``delete`` removes the VM at once and answers a ``RUNNING`` operation.
- :meth:`GceFake.preempt` stops the VM (``TERMINATED``) or, for a spot VM whose termination
  action is ``DELETE``, removes it, and records a ``compute.instances.preempted`` operation
  in its zone, as Compute Engine does; :meth:`GceFake.stop` stops a VM with no such record.

Managed instance groups, as the API documents them:

- An instance template's properties pass the same checks as an instance insert (spot
  scheduling, GPUs, labels, metadata, disks); its ``machineType`` must be a bare name (a URL
  is answered 500 ``INTERNAL_ERROR``, as ``InstanceProperties.machineType`` warns).
- A group acts in :meth:`GceFake.reconcile_groups`, and before every call is answered unless
  ``auto_reconcile`` is off (then a test sees each intermediate state, e.g. a preempted
  member before the group recreates it). One pass does all it can: deletes the members
  marked ``DELETING``; recreates, under the same name, a member whose VM was stopped or
  deleted behind the group's back (a preempted spot VM: the MIG repairs failed VMs); removes
  members past ``targetSize`` or adds ``CREATING`` members named ``BASE-xxxx`` (four random
  lowercase letters or digits); and creates every missing VM from the template. A stockout or
  quota fault leaves the member ``CREATING`` with no VM and the error in ``lastAttempt``,
  retried on every pass. A member's action returns to ``NONE`` once its VM is ``RUNNING``;
  ``listManagedInstances`` reads the VMs, so it moves them along like any read.
- ``resize``, ``deleteInstances`` and ``recreateInstances`` answer an operation at once and
  only schedule the work. ``deleteInstances`` lowers ``targetSize`` by the members it marks;
  a VM that is not a member, or already leaving, is a 400 unless
  ``skipInstancesOnValidationError``; a malformed URL or one in another zone is always 400.
  ``listManagedInstances`` pages only for groups with ``listManagedInstancesResults``
  ``PAGINATED`` (others ignore ``maxResults`` and ``pageToken``) and refuses ``orderBy``.
- A template may be named by URL, by numeric id, or with Terraform's ``?uniqueId=ID``.

Faults (see the methods): stockouts per (zone, machine type), through the operation or as an
HTTP 503 on insert; quota refusals per region; 401/403 on every call; an HTTP status on the
next N calls. Every call is counted by method name (``instances.insert``,
``zoneOperations.wait``, ...) with the Host header it arrived with, so tests can assert
idempotency and that nothing went elsewhere; :meth:`GceFake.group_calls` lists, in order, the
``instanceGroupManagers`` methods called on one group. An exception inside the fake is
answered 500 and kept in ``internal_errors``, for the test to assert empty::

    with GceFake() as gce:
        client = compute_v1.InstancesClient(
            credentials=AnonymousCredentials(),
            client_options=ClientOptions(api_endpoint=gce.url),
            transport="rest",
        )
        gce.inject_stockout("us-central1-a", "a2-highgpu-8g")
        gce.count("instances.insert")
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import re
import string
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fakes.http_fake import DispatchingHandler, HTTPFake
from spottrain.catalog import bundled

DEFAULT_PROJECT = "spottrain-test"
API = "https://www.googleapis.com/compute/v1"
PREEMPTED = "compute.instances.preempted"

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}\Z")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}\Z")
_METADATA_KEY_RE = re.compile(r"^[a-zA-Z0-9_-]{1,128}\Z")
_IMAGE_RE = re.compile(
    r"^(https://www\.googleapis\.com/compute/v1/)?(projects/[a-z0-9.:-]+/)?global/images/"
    r"(family/)?[a-z]([-a-z0-9]*[a-z0-9])?\Z"
)
_MACHINE_TYPE_RE = re.compile(
    r"^(https://www\.googleapis\.com/compute/v1/)?(projects/[^/]+/)?"
    r"(zones/(?P<zone>[^/]+)/machineTypes/)?(?P<type>[^/]+)\Z"
)
# Terraform's self_link_unique adds ?uniqueId=ID; the last segment may be the id itself.
_TEMPLATE_URL_RE = re.compile(
    r"^(https?://[^/]+/compute/v1/)?(projects/(?P<p>[^/]+)/)?global/instanceTemplates/"
    r"(?P<n>[^/?]+)(\?uniqueId=(?P<uid>[0-9]+))?\Z"
)
_INSTANCE_URL_RE = re.compile(
    r"^(https?://[^/]+/compute/v1/)?(projects/(?P<p>[^/]+)/)?zones/(?P<z>[^/]+)/instances/"
    r"(?P<n>[^/]+)\Z"
)
_BASE_NAME_RE = re.compile(r"^[a-z][-a-z0-9]{0,57}\Z")
_GPU_FAMILIES = ("a2-", "a3-", "a4-", "g2-")
_PAGE_SIZE = 500
_METADATA_LIMIT = 512 * 1024

# The GPU machine types the fake knows, beyond those in the catalog: (vCPUs, memory MB).
_SHAPES = {
    "a3-highgpu-8g": (208, 1_872_000),
    "a2-ultragpu-8g": (96, 1_384_448),
    "a2-highgpu-8g": (96, 696_320),
    "g2-standard-96": (96, 393_216),
}

_PROJECT = r"^/compute/v1/projects/(?P<p>[^/]+)"
_GLOBAL = _PROJECT + "/global"
_ZONE = _PROJECT + r"/zones/(?P<z>[^/]+)"
_NAMED = r"/(?P<n>[^/]+)"
_IGM = _ZONE + "/instanceGroupManagers"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    (verb, re.compile(pattern + "$"), name)
    for verb, pattern, name in [
        ("POST", _ZONE + "/instances", "instances.insert"),
        ("GET", _ZONE + "/instances", "instances.list"),
        ("GET", _ZONE + "/instances" + _NAMED, "instances.get"),
        ("DELETE", _ZONE + "/instances" + _NAMED, "instances.delete"),
        ("GET", _PROJECT + "/aggregated/instances", "instances.aggregatedList"),
        ("GET", _ZONE + "/operations", "zoneOperations.list"),
        ("GET", _ZONE + "/operations" + _NAMED, "zoneOperations.get"),
        ("DELETE", _ZONE + "/operations" + _NAMED, "zoneOperations.delete"),
        ("POST", _ZONE + "/operations" + _NAMED + "/wait", "zoneOperations.wait"),
        ("GET", _PROJECT + "/aggregated/machineTypes", "machineTypes.aggregatedList"),
        ("GET", _ZONE + "/machineTypes", "machineTypes.list"),
        ("GET", _ZONE + "/machineTypes" + _NAMED, "machineTypes.get"),
        ("POST", _GLOBAL + "/instanceTemplates", "instanceTemplates.insert"),
        ("GET", _GLOBAL + "/instanceTemplates" + _NAMED, "instanceTemplates.get"),
        ("GET", _GLOBAL + "/operations" + _NAMED, "globalOperations.get"),
        ("POST", _GLOBAL + "/operations" + _NAMED + "/wait", "globalOperations.wait"),
        ("POST", _IGM, "instanceGroupManagers.insert"),
        ("GET", _IGM + _NAMED, "instanceGroupManagers.get"),
        ("POST", _IGM + _NAMED + "/resize", "instanceGroupManagers.resize"),
        ("POST", _IGM + _NAMED + "/deleteInstances", "instanceGroupManagers.deleteInstances"),
        (
            "POST",
            _IGM + _NAMED + "/recreateInstances",
            "instanceGroupManagers.recreateInstances",
        ),
        (
            "POST",
            _IGM + _NAMED + "/listManagedInstances",
            "instanceGroupManagers.listManagedInstances",
        ),
    ]
]

# Query parameters each kind of call may carry; anything else is refused like the real API.
_LIST_PARAMS = {"filter", "maxResults", "pageToken", "returnPartialSuccess", "$alt"}
_PARAMS = {
    "instances.list": _LIST_PARAMS,
    "instances.aggregatedList": _LIST_PARAMS | {"includeAllScopes", "serviceProjectNumber"},
    "zoneOperations.list": _LIST_PARAMS,
    "machineTypes.list": _LIST_PARAMS,
    "machineTypes.aggregatedList": _LIST_PARAMS | {"includeAllScopes", "serviceProjectNumber"},
    "instances.insert": {"requestId", "sourceInstanceTemplate", "sourceMachineImage", "$alt"},
    "instances.delete": {"requestId", "$alt"},
    "instanceTemplates.insert": {"requestId", "$alt"},
    "instanceGroupManagers.insert": {"requestId", "$alt"},
    "instanceGroupManagers.resize": {"size", "requestId", "$alt"},
    "instanceGroupManagers.deleteInstances": {"requestId", "$alt"},
    "instanceGroupManagers.recreateInstances": {"requestId", "$alt"},
    # orderBy is refused: the API says listManagedInstances does not support it.
    "instanceGroupManagers.listManagedInstances": _LIST_PARAMS,
}
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


class ApiError(Exception):
    """An answer of the fake API in the real error format."""

    def __init__(
        self, code: int, message: str, reason: str, domain: str = "global", **extra: Any
    ) -> None:
        super().__init__(message)
        self.status = code
        self.body: dict[str, Any] = {
            "error": {
                "code": code,
                "message": message,
                "errors": [{"message": message, "domain": domain, "reason": reason}],
                **extra,
            }
        }


def _not_found(what: str) -> ApiError:
    return ApiError(404, f"The resource '{what}' was not found", "notFound")


def _invalid(field_name: str, value: Any, why: str) -> ApiError:
    return ApiError(400, f"Invalid value for field '{field_name}': '{value}'. {why}", "invalid")


def _now() -> str:
    return datetime.now(UTC).astimezone().isoformat(timespec="milliseconds")


@dataclass
class _Operation:
    body: dict[str, Any]
    polls_left: int
    error: dict[str, Any] | None = None
    http_status: int = 0
    http_message: str = ""


@dataclass
class _Member:
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
class _Group:
    zone: str
    body: dict[str, Any]  # the stored resource, without the computed fields
    members: dict[str, _Member] = field(default_factory=dict)


@dataclass
class _Faults:
    stockouts: dict[tuple[str, str], str] = field(default_factory=dict)  # -> "operation"/"http"
    quotas: dict[str, tuple[str, str]] = field(default_factory=dict)  # region -> (metric, via)
    auth_status: int | None = None
    fail_next: list[tuple[int, str | None]] = field(default_factory=list)


class _Handler(DispatchingHandler, methods=("GET", "POST", "DELETE")):
    def reply(self, status: int, body: dict[str, Any]) -> None:
        data = b"" if status == 204 else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True


class GceFake(HTTPFake):
    """The fake Compute Engine API; use it as a context manager (or ``start()``/``close()``).

    Args:
        project: the one project it serves; calls for another get 404.
        machine_types: zone -> the machine types it has; None: every GCP type of the bundled
            catalog in every zone the catalog lists for the type's regions.
        boot_delay: seconds between the steps PROVISIONING -> STAGING -> RUNNING.
        op_polls_until_done: polls (get or wait) before an operation is DONE.
        page_size: the most items a list page holds when the client asks for no fewer.
        auto_reconcile: the managed instance groups act before every call is answered; off,
            they act only in :meth:`reconcile_groups`.
        seed: seeds the random suffixes of the groups' VM names.
    """

    def __init__(
        self,
        project: str = DEFAULT_PROJECT,
        *,
        machine_types: Mapping[str, Iterable[str]] | None = None,
        boot_delay: float = 0.0,
        op_polls_until_done: int = 1,
        page_size: int = _PAGE_SIZE,
        auto_reconcile: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(_Handler, thread_name="fake-gce")
        self.project = project
        self.boot_delay = boot_delay
        self.op_polls_until_done = op_polls_until_done
        self.page_size = page_size
        self.auto_reconcile = auto_reconcile
        self._lock = threading.Lock()
        self._machine_types = {
            zone: set(types) for zone, types in (machine_types or _catalog_zones()).items()
        }
        self._instances: dict[str, dict[str, dict[str, Any]]] = {}  # zone -> name -> body
        self._stepped_at: dict[tuple[str, str], float] = {}
        self._operations: dict[str, dict[str, _Operation]] = {}  # zone -> name -> op
        self._faults = _Faults()
        self._unknown_images: set[str] = set()
        self._calls: Counter[str] = Counter()
        self._hosts: Counter[str] = Counter()
        self._inserted: list[dict[str, Any]] = []
        self.internal_errors: list[str] = []
        self._ids = itertools.count(random.randrange(10**18, 2 * 10**18))
        self._templates: dict[str, dict[str, Any]] = {}  # name -> body
        self._groups: dict[str, dict[str, _Group]] = {}  # zone -> name -> group
        self._group_calls: dict[str, list[str]] = {}  # group name -> methods, in order
        self._rng = random.Random(seed)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, the ``api_endpoint`` to give the client."""
        return f"http://127.0.0.1:{self.port}"

    # faults

    def inject_stockout(self, zone: str, machine_type: str, *, via: str = "operation") -> None:
        """Inserts of ``machine_type`` in ``zone`` fail for capacity: ``via="operation"``, the
        way Compute Engine usually reports it (the insert is accepted and its operation
        finishes with ``ZONE_RESOURCE_POOL_EXHAUSTED``), or ``via="http"`` (the insert itself
        answers 503)."""
        if via not in ("operation", "http"):
            raise ValueError(f"via must be 'operation' or 'http', got {via!r}")
        with self._lock:
            self._faults.stockouts[(zone, machine_type)] = via

    def inject_quota_error(
        self, region: str, metric: str = "NVIDIA_A100_GPUS", *, via: str = "http"
    ) -> None:
        """Inserts in ``region`` exceed quota ``metric``: ``via="http"`` answers 403
        ``quotaExceeded``; ``via="operation"`` fails the operation with ``QUOTA_EXCEEDED``."""
        if via not in ("operation", "http"):
            raise ValueError(f"via must be 'operation' or 'http', got {via!r}")
        with self._lock:
            self._faults.quotas[region] = (metric, via)

    def inject_auth_error(self, status: int = 401) -> None:
        """Every call fails: 401 (no or revoked credentials) or 403 (no permission)."""
        if status not in (401, 403):
            raise ValueError(f"status must be 401 or 403, got {status}")
        with self._lock:
            self._faults.auth_status = status

    def fail_next(self, n: int, status: int = 503, *, method: str | None = None) -> None:
        """The next ``n`` calls (of ``method`` only, if given) answer ``status``."""
        with self._lock:
            self._faults.fail_next.extend([(status, method)] * n)

    def forget_image(self, image: str) -> None:
        """Inserts booting from ``image`` (as written in the request) get 404."""
        with self._lock:
            self._unknown_images.add(image)

    def remove_machine_type(self, zone: str, machine_type: str) -> None:
        """``zone`` no longer has ``machine_type`` (inserts get 404, lists omit it)."""
        with self._lock:
            self._machine_types.get(zone, set()).discard(machine_type)

    def clear_faults(self) -> None:
        """Undo every injected fault (not removed machine types or forgotten images)."""
        with self._lock:
            self._faults = _Faults()

    def preempt(self, name: str) -> None:
        """Take the VM back as Compute Engine preempts a spot VM: it is stopped
        (``TERMINATED``), or deleted if its termination action is ``DELETE``, and a
        ``compute.instances.preempted`` operation records it.

        Raises:
            KeyError: no VM of that name.
        """
        with self._lock:
            zone, body = self._find(name)
            scheduling = body.get("scheduling", {})
            if scheduling.get("instanceTerminationAction") == "DELETE":
                del self._instances[zone][name]
            else:
                body["status"] = "TERMINATED"
                body["statusMessage"] = "Instance was preempted."
                body["lastStopTimestamp"] = _now()
            self._new_operation(zone, PREEMPTED, body, polls=0, user="system")

    def stop(self, name: str) -> None:
        """Stop the VM without a preemption (as ``gcloud compute instances stop`` or a max
        run duration does): ``TERMINATED``, no ``compute.instances.preempted`` operation.

        Raises:
            KeyError: no VM of that name.
        """
        with self._lock:
            zone, body = self._find(name)
            body["status"] = "TERMINATED"
            body["lastStopTimestamp"] = _now()
            self._new_operation(zone, "stop", body, polls=0)

    # inspection

    def count(self, method: str | None = None) -> int:
        """Calls received, of one method (``instances.insert``) or of all."""
        with self._lock:
            return self._calls[method] if method else sum(self._calls.values())

    @property
    def calls(self) -> dict[str, int]:
        with self._lock:
            return dict(self._calls)

    @property
    def hosts(self) -> dict[str, int]:
        """Calls by the Host header they carried."""
        with self._lock:
            return dict(self._hosts)

    @property
    def inserted(self) -> list[dict[str, Any]]:
        """Every insert body received, as sent (accepted or not)."""
        with self._lock:
            return copy.deepcopy(self._inserted)

    def instance(self, name: str) -> dict[str, Any] | None:
        """The VM's resource as the API would show it (without moving its status), or None."""
        with self._lock:
            try:
                return copy.deepcopy(self._find(name)[1])
            except KeyError:
                return None

    def instances(self) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(b) for zone in self._instances.values() for b in zone.values()]

    def operations(self, zone: str) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(op.body) for op in self._operations.get(zone, {}).values()]

    # managed instance groups

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
                raise _not_found(f"projects/{self.project}/zones/{zone}")
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

    def forget_template(self, name: str) -> None:
        """Delete the instance template, as a later ``terraform apply`` that replaced it does;
        groups and members that still name it keep its URL, and a group whose own template it
        was can no longer create VMs (their members stay ``CREATING``).

        Raises:
            KeyError: no template of that name.
        """
        with self._lock:
            del self._templates[name]

    def template(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._templates.get(name)
            return None if found is None else copy.deepcopy(found)

    # serving

    def _handle(self, handler: _Handler, method: str) -> None:
        parts = urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        route: tuple[str, re.Match[str]] | None = None
        for verb, pattern, name in _ROUTES:
            m = pattern.match(parts.path)
            if verb == method and m is not None:
                route = (name, m)
                break
        call = route[0] if route else f"unknown {method} {parts.path}"
        group = None
        if route is not None and call.startswith("instanceGroupManagers."):
            group = route[1].groupdict().get("n") or _name_in(raw)
        with self._lock:
            self._calls[call] += 1
            if group:
                self._group_calls.setdefault(group, []).append(call)
            self._hosts[handler.headers.get("Host", "")] += 1
        try:
            status, body = self._dispatch(call, route, parts.query, raw)
        except ApiError as e:
            status, body = e.status, e.body
        except Exception as e:
            # A bug in the fake: answer it, and keep it for the test to see.
            with self._lock:
                self.internal_errors.append(f"{call}: {type(e).__name__}: {e}")
            bug = ApiError(500, f"fake bug: {type(e).__name__}: {e}", "backendError")
            status, body = bug.status, bug.body
        handler.reply(status, body)

    def _dispatch(
        self, call: str, route: tuple[str, re.Match[str]] | None, query_string: str, raw: bytes
    ) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if self.auto_reconcile:
                # Time passes between calls: the groups act first, as fast as they can.
                self._reconcile_groups()
            self._check_faults(call)
        if route is None:
            raise ApiError(404, f"The fake Compute API has no method for {call}", "notFound")
        args = route[1].groupdict()
        if args["p"] != self.project:
            raise _not_found(f"projects/{args['p']}")
        query = {k: v[-1] for k, v in parse_qs(query_string, keep_blank_values=True).items()}
        allowed = _PARAMS.get(call, {"$alt"})
        unknown = sorted(set(query) - allowed)
        if unknown:
            raise ApiError(
                400, f'Invalid JSON payload received. Unknown name "{unknown[0]}"', "invalid"
            )
        zone = args.get("z")
        with self._lock:
            if zone is not None and zone not in self._machine_types:
                raise _not_found(f"projects/{self.project}/zones/{zone}")
            if call == "instances.insert":
                return 200, self._insert(zone or "", _parse_body(raw))
            if call == "instances.get":
                return 200, self._get_instance(zone or "", args["n"])
            if call == "instances.delete":
                return 200, self._delete(zone or "", args["n"])
            if call == "instances.list":
                stored = self._instances.get(zone or "", {})
                items = [stored[n] for n in sorted(stored)]
                return 200, _page(
                    f"projects/{self.project}/zones/{zone}/instances",
                    "compute#instanceList",
                    items,
                    query,
                    self.page_size,
                    self._read_listed,
                )
            if call == "instances.aggregatedList":
                scoped = {
                    z: [b for _, b in sorted(self._instances.get(z, {}).items())]
                    for z in sorted(self._machine_types)
                }
                return 200, _aggregated(
                    f"projects/{self.project}/aggregated/instances",
                    "compute#instanceAggregatedList",
                    "instances",
                    scoped,
                    query,
                    self.page_size,
                    self._read_listed,
                )
            if call == "zoneOperations.list":
                ops = [op.body for op in self._operations.get(zone or "", {}).values()]
                return 200, _page(
                    f"projects/{self.project}/zones/{zone}/operations",
                    "compute#operationList",
                    ops,
                    query,
                    self.page_size,
                )
            if call in ("zoneOperations.get", "zoneOperations.wait"):
                return 200, self._poll(zone or "", args["n"])
            if call in ("globalOperations.get", "globalOperations.wait"):
                return 200, self._poll("", args["n"])
            if call == "instanceTemplates.insert":
                return 200, self._insert_template(_parse_body(raw))
            if call == "instanceTemplates.get":
                template = self._template_by(args["n"])
                if template is None:
                    raise _not_found(
                        f"projects/{self.project}/global/instanceTemplates/{args['n']}"
                    )
                return 200, copy.deepcopy(template)
            if call == "instanceGroupManagers.insert":
                return 200, self._insert_group(zone or "", _parse_body(raw))
            if call.startswith("instanceGroupManagers."):
                return 200, self._group_call(call, self._group(zone or "", args["n"]), query, raw)
            if call == "zoneOperations.delete":
                if self._operations.get(zone or "", {}).pop(args["n"], None) is None:
                    raise _not_found(f"projects/{self.project}/zones/{zone}/operations/{args['n']}")
                return 204, {}
            if call == "machineTypes.get":
                if args["n"] not in self._machine_types[zone or ""]:
                    raise _not_found(
                        f"projects/{self.project}/zones/{zone}/machineTypes/{args['n']}"
                    )
                return 200, self._machine_type(zone or "", args["n"])
            if call == "machineTypes.list":
                items = [
                    self._machine_type(zone or "", t)
                    for t in sorted(self._machine_types[zone or ""])
                ]
                return 200, _page(
                    f"projects/{self.project}/zones/{zone}/machineTypes",
                    "compute#machineTypeList",
                    items,
                    query,
                    self.page_size,
                )
            if call == "machineTypes.aggregatedList":
                scoped = {
                    z: [self._machine_type(z, t) for t in sorted(ts)]
                    for z, ts in sorted(self._machine_types.items())
                }
                return 200, _aggregated(
                    f"projects/{self.project}/aggregated/machineTypes",
                    "compute#machineTypeAggregatedList",
                    "machineTypes",
                    scoped,
                    query,
                    self.page_size,
                )
        raise AssertionError(f"unrouted call {call}")  # pragma: no cover

    def _check_faults(self, call: str) -> None:
        if self._faults.auth_status == 401:
            raise ApiError(
                401,
                "Request had invalid authentication credentials. Expected OAuth 2 access "
                "token, login cookie or other valid authentication credential.",
                "authError",
                status="UNAUTHENTICATED",
            )
        if self._faults.auth_status == 403:
            raise ApiError(
                403,
                f"Required '{call.split('.')[0].rstrip('s')}' permission for "
                f"'projects/{self.project}'",
                "forbidden",
            )
        for i, (status, method) in enumerate(self._faults.fail_next):
            if method in (None, call):
                del self._faults.fail_next[i]
                reason = "rateLimitExceeded" if status == 429 else "backendError"
                raise ApiError(status, f"Injected failure: HTTP {status}", reason)

    # instances

    def _insert(self, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        self._inserted.append(copy.deepcopy(body))
        machine_type = self._validate_insert(zone, body)
        name = body["name"]
        if name in self._instances.get(zone, {}):
            raise ApiError(
                409,
                f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                "already exists",
                "alreadyExists",
            )
        quota = self._quota_fault(zone)
        if quota is not None and quota[0] == "http":
            raise ApiError(403, quota[1]["message"], "quotaExceeded", domain="usageLimits")
        stockout = self._stockout_fault(zone, machine_type)
        if stockout is not None and stockout[0] == "http":
            raise ApiError(503, stockout[1]["message"], "ZONE_RESOURCE_POOL_EXHAUSTED")
        instance_id = str(next(self._ids))
        link = f"{API}/projects/{self.project}/zones/{zone}/instances/{name}"
        if quota is not None:
            return self._new_operation(
                zone,
                "insert",
                {"name": name, "id": instance_id, "selfLink": link},
                error=quota[1],
                http_status=403,
                http_message="FORBIDDEN",
            )
        if stockout is not None:
            return self._new_operation(
                zone,
                "insert",
                {"name": name, "id": instance_id, "selfLink": link},
                error=stockout[1],
                http_status=503,
                http_message="SERVICE UNAVAILABLE",
            )
        created = self._complete(zone, body, instance_id, link)
        self._instances.setdefault(zone, {})[name] = created
        self._stepped_at[(zone, name)] = time.monotonic()
        return self._new_operation(zone, "insert", created)

    def _quota_fault(self, zone: str) -> tuple[str, dict[str, Any]] | None:
        """How an injected quota fault of the zone's region is raised, and the operation error
        that carries it."""
        region = zone.rsplit("-", 1)[0]
        quota = self._faults.quotas.get(region)
        if quota is None:
            return None
        metric, via = quota
        return via, {
            "code": "QUOTA_EXCEEDED",
            "message": f"Quota '{metric}' exceeded.  Limit: 0.0 in region {region}.",
            "errorDetails": [
                {
                    "quotaInfo": {
                        "metricName": f"compute.googleapis.com/{metric.lower()}",
                        "limitName": f"{metric}-per-project-region",
                        "dimensions": {"region": region},
                        "limit": 0,
                    }
                }
            ],
        }

    def _stockout_fault(self, zone: str, machine_type: str) -> tuple[str, dict[str, Any]] | None:
        """How an injected stockout is raised, and the operation error that carries it."""
        via = self._faults.stockouts.get((zone, machine_type))
        if via is None:
            return None
        return via, {
            "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
            "message": (
                f"The zone 'projects/{self.project}/zones/{zone}' does not have enough "
                "resources available to fulfill the request.  Try a different zone, or try "
                "again later."
            ),
        }

    def _validate_insert(self, zone: str, body: dict[str, Any]) -> str:
        _check_name(body.get("name", ""))
        return self._validate_properties(body, zone, "resource")

    def _validate_properties(self, body: dict[str, Any], zone: str | None, at: str) -> str:
        """What an instance insert (in ``zone``) and an instance template's properties (``zone``
        None, fields under ``resource.properties``) must both satisfy; the machine type."""
        mt = _MACHINE_TYPE_RE.match(body.get("machineType", ""))
        if mt is None or not body.get("machineType"):
            raise ApiError(400, f"Invalid value for field '{at}.machineType': ''.", "invalid")
        machine_type = mt["type"]
        if zone is None:
            if machine_type != body["machineType"]:
                # As InstanceProperties.machineType documents it: a URL there is answered
                # INTERNAL_ERROR, which a client takes for a transient fault.
                raise ApiError(
                    500,
                    f"Internal error. Invalid value for field '{at}.machineType': "
                    f"'{body['machineType']}'. Instance templates take a machine type name.",
                    "INTERNAL_ERROR",
                )
            if not any(machine_type in types for types in self._machine_types.values()):
                raise _invalid(
                    f"{at}.machineType",
                    machine_type,
                    f"Machine type with name '{machine_type}' does not exist.",
                )
        else:
            if mt["zone"] not in (None, zone):
                raise _invalid(
                    f"{at}.machineType",
                    body["machineType"],
                    f"Machine type must be in zone {zone}.",
                )
            if machine_type not in self._machine_types[zone]:
                raise _not_found(
                    f"projects/{self.project}/zones/{zone}/machineTypes/{machine_type}"
                )
        scheduling = body.get("scheduling", {})
        maintenance = scheduling.get("onHostMaintenance", "MIGRATE")
        gpus = machine_type.startswith(_GPU_FAMILIES) or bool(body.get("guestAccelerators"))
        if gpus and maintenance != "TERMINATE":
            raise ApiError(
                400,
                "Instances with guest accelerators do not support live migration.",
                "badRequest",
            )
        if machine_type.startswith(_GPU_FAMILIES) and body.get("guestAccelerators"):
            raise _invalid(
                f"{at}.guestAccelerators",
                body["guestAccelerators"],
                f"Machine type {machine_type} comes with its accelerators attached; "
                "guestAccelerators must be empty.",
            )
        model = scheduling.get("provisioningModel", "STANDARD")
        if model not in ("STANDARD", "SPOT"):
            raise _invalid(f"{at}.scheduling.provisioningModel", model, "")
        action = scheduling.get("instanceTerminationAction")
        if action not in (None, "STOP", "DELETE"):
            raise _invalid(f"{at}.scheduling.instanceTerminationAction", action, "")
        if model == "SPOT":
            if maintenance != "TERMINATE":
                raise _invalid(
                    f"{at}.scheduling.onHostMaintenance",
                    maintenance,
                    "Spot VMs must have onHostMaintenance set to TERMINATE.",
                )
            if scheduling.get("automaticRestart", True):
                raise _invalid(
                    f"{at}.scheduling.automaticRestart",
                    "true",
                    "Spot VMs must have automaticRestart set to false.",
                )
        if "maxRunDuration" in scheduling and action is None:
            raise _invalid(
                f"{at}.scheduling.instanceTerminationAction",
                "",
                "maxRunDuration requires an instanceTerminationAction.",
            )
        nics = body.get("networkInterfaces") or []
        if not nics:
            raise ApiError(400, "At least one network interface is required.", "required")
        if machine_type.startswith("a3-") and nics[0].get("nicType") != "GVNIC":
            raise _invalid(
                f"{at}.networkInterfaces[0].nicType",
                nics[0].get("nicType", ""),
                f"Machine type {machine_type} requires the GVNIC network interface.",
            )
        labels = body.get("labels", {})
        if len(labels) > 64:
            raise _invalid(f"{at}.labels", len(labels), "At most 64 labels.")
        for key, value in labels.items():
            if not _LABEL_KEY_RE.match(key):
                raise _invalid(
                    f"{at}.labels.{key}", key, "Label keys must match [a-z][a-z0-9_-]{0,62}."
                )
            if not isinstance(value, str) or not _LABEL_VALUE_RE.match(value):
                raise _invalid(
                    f"{at}.labels.{key}", value, "Label values must match [a-z0-9_-]{0,63}."
                )
        items = body.get("metadata", {}).get("items", [])
        if sum(len(i.get("key", "")) + len(i.get("value", "")) for i in items) > _METADATA_LIMIT:
            raise ApiError(400, "Metadata exceeds the 512 KB limit.", "invalid")
        for item in items:
            if not _METADATA_KEY_RE.match(item.get("key", "")):
                raise _invalid(f"{at}.metadata.items.key", item.get("key", ""), "")
        boot = [d for d in body.get("disks", []) if d.get("boot")]
        if len(boot) != 1:
            raise ApiError(400, "Exactly one boot disk is required.", "invalid")
        params = boot[0].get("initializeParams", {})
        image = params.get("sourceImage", "")
        if not image and not boot[0].get("source"):
            raise ApiError(400, "The boot disk needs a sourceImage or a source.", "required")
        if image and not _IMAGE_RE.match(image):
            raise _invalid(f"{at}.disks[0].initializeParams.sourceImage", image, "")
        if image in self._unknown_images:
            raise _not_found(image.removeprefix(API + "/"))
        if "diskSizeGb" in params and int(params["diskSizeGb"]) < 10:
            raise _invalid(f"{at}.disks[0].initializeParams.diskSizeGb", params["diskSizeGb"], "")
        return machine_type

    def _complete(
        self, zone: str, body: dict[str, Any], instance_id: str, link: str
    ) -> dict[str, Any]:
        """The stored resource: the request plus what the server fills in."""
        out = copy.deepcopy(body)
        machine_type = _MACHINE_TYPE_RE.match(body["machineType"])["type"]  # type: ignore[index]
        scheduling = out.setdefault("scheduling", {})
        scheduling.setdefault("onHostMaintenance", "MIGRATE")
        scheduling.setdefault("automaticRestart", True)
        scheduling.setdefault("provisioningModel", "STANDARD")
        scheduling.setdefault("preemptible", False)
        if scheduling["provisioningModel"] == "SPOT":
            scheduling.setdefault("instanceTerminationAction", "STOP")
        for i, nic in enumerate(out.get("networkInterfaces", [])):
            nic["name"] = f"nic{i}"
            nic["networkIP"] = f"10.128.{int(instance_id) % 250}.{2 + i}"
            nic.setdefault("network", f"{API}/projects/{self.project}/global/networks/default")
            nic["kind"] = "compute#networkInterface"
        for i, disk in enumerate(out.get("disks", [])):
            disk["deviceName"] = f"persistent-disk-{i}"
            disk["source"] = f"{API}/projects/{self.project}/zones/{zone}/disks/{out['name']}"
            disk["kind"] = "compute#attachedDisk"
            disk.pop("initializeParams", None)
        out.setdefault("metadata", {})["fingerprint"] = "fake-fingerprint="
        out["metadata"]["kind"] = "compute#metadata"
        out.update(
            kind="compute#instance",
            id=instance_id,
            creationTimestamp=_now(),
            zone=f"{API}/projects/{self.project}/zones/{zone}",
            machineType=f"{API}/projects/{self.project}/zones/{zone}/machineTypes/{machine_type}",
            status="PROVISIONING",
            selfLink=link,
            labelFingerprint="fake-label-fingerprint=",
            cpuPlatform="Unknown CPU Platform",
        )
        return out

    def _find(self, name: str) -> tuple[str, dict[str, Any]]:
        for zone, instances in self._instances.items():
            if name in instances:
                return zone, instances[name]
        raise KeyError(name)

    def _read(self, zone: str, name: str) -> dict[str, Any]:
        """A read of the VM, which moves it one step towards RUNNING once it is due."""
        body = self._instances[zone][name]
        following = {"PROVISIONING": "STAGING", "STAGING": "RUNNING"}.get(body["status"])
        now = time.monotonic()
        if following and now - self._stepped_at.get((zone, name), now) >= self.boot_delay:
            body["status"] = following
            self._stepped_at[(zone, name)] = now
            if following == "RUNNING":
                body["lastStartTimestamp"] = _now()
        return copy.deepcopy(body)

    def _read_listed(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._read(body["zone"].rsplit("/", 1)[-1], body["name"])

    def _get_instance(self, zone: str, name: str) -> dict[str, Any]:
        if name not in self._instances.get(zone, {}):
            raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
        return self._read(zone, name)

    def _delete(self, zone: str, name: str) -> dict[str, Any]:
        body = self._instances.get(zone, {}).pop(name, None)
        if body is None:
            raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
        self._stepped_at.pop((zone, name), None)
        return self._new_operation(zone, "delete", body)

    # instance templates

    def _insert_template(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name", "")
        _check_name(name)
        if name in self._templates:
            raise ApiError(
                409,
                f"The resource 'projects/{self.project}/global/instanceTemplates/{name}' "
                "already exists",
                "alreadyExists",
            )
        properties = body.get("properties")
        if not isinstance(properties, dict) or not properties:
            raise ApiError(400, "Invalid value for field 'resource.properties': ''.", "required")
        self._validate_properties(properties, None, "resource.properties")
        stored = copy.deepcopy(body)
        stored.update(
            kind="compute#instanceTemplate",
            id=str(next(self._ids)),
            creationTimestamp=_now(),
            selfLink=f"{API}/projects/{self.project}/global/instanceTemplates/{name}",
        )
        self._templates[name] = stored
        return self._new_operation(None, "insert", stored)

    def _template_by(self, name_or_id: str) -> dict[str, Any] | None:
        """A template by its name or, as the API allows for any resource, its numeric id."""
        if name_or_id.isdigit():
            return next((t for t in self._templates.values() if t["id"] == name_or_id), None)
        return self._templates.get(name_or_id)

    def _template_at(self, url: str) -> dict[str, Any] | None:
        """The template a reference names (None if it does not exist, or no longer has the
        ``uniqueId`` the reference pins)."""
        m = _TEMPLATE_URL_RE.match(url)
        if m is None:
            return None
        template = self._template_by(m["n"])
        if template is None or m["uid"] not in (None, template["id"]):
            return None
        return template

    def _template_link(self, url: str, field_name: str) -> str:
        """The full URL of the template a request names, as the group keeps it.

        Whether the real API keeps a ``?uniqueId=`` suffix in what it answers is not
        documented; the fake keeps it, the harder case for a client that parses the URL.
        """
        m = _TEMPLATE_URL_RE.match(url)
        if m is None or m["p"] not in (None, self.project):
            raise _invalid(field_name, url, "Expected a global instance template URL.")
        if self._template_at(url) is None:
            raise _not_found(f"projects/{self.project}/global/instanceTemplates/{m['n']}")
        return f"{API}/projects/{self.project}/global/instanceTemplates/{url.rsplit('/', 1)[-1]}"

    # managed instance groups (zonal)

    def _insert_group(self, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name", "")
        _check_name(name)
        base = body.get("baseInstanceName", "")
        if "#" in base:
            raise ApiError(
                400,
                "The fake Compute API names members only with random suffixes, not with "
                f"the sequential numbers that baseInstanceName '{base}' asks for.",
                "invalid",
            )
        if not _BASE_NAME_RE.match(base):
            raise _invalid(
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
                raise _invalid(
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
            raise _invalid("resource.targetSize", size, "Must be a non-negative integer.")
        results = body.get("listManagedInstancesResults", "PAGELESS")
        if results not in ("PAGELESS", "PAGINATED"):
            raise _invalid("resource.listManagedInstancesResults", results, "")
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
            creationTimestamp=_now(),
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
        self._groups.setdefault(zone, {})[name] = _Group(zone, stored)
        return self._new_operation(zone, "compute.instanceGroupManagers.insert", stored)

    def _group(self, zone: str, name: str) -> _Group:
        found = self._groups.get(zone, {}).get(name)
        if found is None:
            raise _not_found(f"projects/{self.project}/zones/{zone}/instanceGroupManagers/{name}")
        return found

    def _find_group(self, name: str) -> _Group | None:
        for groups in self._groups.values():
            if name in groups:
                return groups[name]
        return None

    def _group_call(
        self, call: str, group: _Group, query: dict[str, str], raw: bytes
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
                raise _invalid("size", size, "Must be greater than or equal to 0.")
            group.body["targetSize"] = size
            return self._new_operation(
                group.zone, "compute.instanceGroupManagers.resize", group.body
            )
        body = _parse_body(raw)
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

    def _members_named(self, group: _Group, body: dict[str, Any], *, skip: bool) -> list[str]:
        """The members a deleteInstances or recreateInstances body names, checked as the API
        checks them: a malformed URL or one in another zone always fails the call; a VM that
        is not a member, or is already being deleted or abandoned, fails it unless ``skip``
        (``skipInstancesOnValidationError``, which only deleteInstances has)."""
        refs = body.get("instances") or []
        if not refs:
            raise ApiError(400, "Invalid value for field 'resource.instances': ''.", "required")
        if len(refs) > _MAX_INSTANCES_PER_CALL:
            raise _invalid(
                "resource.instances",
                len(refs),
                f"At most {_MAX_INSTANCES_PER_CALL} instances per request.",
            )
        names: list[str] = []
        for ref in refs:
            m = _INSTANCE_URL_RE.match(ref) if isinstance(ref, str) else None
            if m is None or m["p"] not in (None, self.project):
                raise _invalid("resource.instances", ref, "Expected an instance URL.")
            if m["z"] != group.zone:
                raise _invalid(
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

    def _group_resource(self, group: _Group) -> dict[str, Any]:
        body = copy.deepcopy(group.body)
        actions = Counter(m.action for m in group.members.values())
        body["currentActions"] = {key: actions[value] for key, value in _ACTIONS.items()}
        stable = len(group.members) == body["targetSize"] and set(actions) <= {"NONE"}
        body["status"] = {"isStable": stable, "versionTarget": {"isReached": True}}
        return body

    def _list_managed(self, group: _Group, query: dict[str, str]) -> dict[str, Any]:
        # A PAGELESS group (the default) ignores maxResults and pageToken and answers all.
        paginated = group.body["listManagedInstancesResults"] == "PAGINATED"
        terms = parse_filter(query.get("filter", ""))
        items = [
            item
            for _, member in sorted(group.members.items())
            if _matches(item := self._managed(group, member, read=True), terms)
        ]
        body: dict[str, Any] = {}
        if paginated:
            start, end = _page_bounds(query, len(items), self.page_size)
            if end < len(items):
                body["nextPageToken"] = str(end)
            items = items[start:end]
        if items:
            body["managedInstances"] = items
        return body

    def _managed(self, group: _Group, member: _Member, *, read: bool) -> dict[str, Any]:
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

    def _vm_of(self, group: _Group, member: _Member) -> dict[str, Any] | None:
        vm = self._instances.get(group.zone, {}).get(member.name)
        # A VM of the same name that the group did not create is not its member's.
        return vm if vm is not None and member.vm_id and vm["id"] == member.vm_id else None

    @staticmethod
    def _settle(member: _Member, vm: dict[str, Any]) -> None:
        # The old VM of a member flagged for recreation still runs: that is not the new one.
        if member.replace:
            return
        if vm["status"] == "RUNNING" and member.action in ("CREATING", "RECREATING"):
            member.action = "NONE"

    def _reconcile_groups(self) -> None:
        for groups in self._groups.values():
            for group in groups.values():
                self._reconcile_group(group)

    def _reconcile_group(self, group: _Group) -> None:
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
            group.members[name] = _Member(name)
        for member in group.members.values():
            if not member.vm_id:
                self._create_member_vm(group, member)
            vm = self._vm_of(group, member)
            if vm is not None:
                self._settle(member, vm)

    def _victims(self, group: _Group) -> list[_Member]:
        """The order a resize down removes members in. The API only says it weighs the VMs'
        status; the fake takes members without a VM first, then VMs not running, then the
        rest, by name from the last."""

        def tier(member: _Member) -> int:
            vm = self._vm_of(group, member)
            return 0 if vm is None else 1 if vm["status"] != "RUNNING" else 2

        by_name = sorted(group.members.values(), key=lambda m: m.name, reverse=True)
        return sorted(by_name, key=tier)

    def _member_name(self, group: _Group) -> str:
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

    def _create_member_vm(self, group: _Group, member: _Member) -> None:
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

    def _member_body(self, group: _Group, name: str, template: dict[str, Any]) -> dict[str, Any]:
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

    # operations

    def _new_operation(
        self,
        zone: str | None,
        op_type: str,
        target: dict[str, Any],
        *,
        polls: int | None = None,
        error: dict[str, Any] | None = None,
        http_status: int = 0,
        http_message: str = "",
        user: str = "spottrain@example.com",
    ) -> dict[str, Any]:
        op_id = next(self._ids)
        name = f"operation-{int(time.time() * 1000)}-{op_id:x}"[:63]
        scope = f"zones/{zone}" if zone else "global"
        body = {
            "kind": "compute#operation",
            "id": str(op_id),
            "name": name,
            "operationType": op_type,
            "targetLink": target.get("selfLink", ""),
            "targetId": target.get("id", ""),
            "status": "RUNNING",
            "user": user,
            "progress": 0,
            "insertTime": _now(),
            "startTime": _now(),
            "selfLink": f"{API}/projects/{self.project}/{scope}/operations/{name}",
        }
        if zone:
            body["zone"] = f"{API}/projects/{self.project}/zones/{zone}"
        if op_type == PREEMPTED:
            body["statusMessage"] = "Instance was preempted."
        op = _Operation(
            body,
            self.op_polls_until_done if polls is None else polls,
            error,
            http_status,
            http_message,
        )
        # Global operations are kept under the zone "" (no zone has that name).
        self._operations.setdefault(zone or "", {})[name] = op
        if op.polls_left <= 0:
            self._finish(op)
        return copy.deepcopy(body)

    def _finish(self, op: _Operation) -> None:
        op.body.update(status="DONE", progress=100, endTime=_now())
        if op.error is not None:
            op.body["error"] = {"errors": [op.error]}
            op.body["httpErrorStatusCode"] = op.http_status
            op.body["httpErrorMessage"] = op.http_message

    def _poll(self, zone: str, name: str) -> dict[str, Any]:
        """A get or wait of the operation (``zone`` "" for a global one)."""
        op = self._operations.get(zone, {}).get(name)
        if op is None:
            scope = f"zones/{zone}" if zone else "global"
            raise _not_found(f"projects/{self.project}/{scope}/operations/{name}")
        if op.body["status"] != "DONE":
            op.polls_left -= 1
            if op.polls_left <= 0:
                self._finish(op)
        return copy.deepcopy(op.body)

    # machine types

    def _machine_type(self, zone: str, name: str) -> dict[str, Any]:
        cpus, memory = _SHAPES.get(name, (8, 32_768))
        body: dict[str, Any] = {
            "kind": "compute#machineType",
            "id": str(abs(hash(name)) % 10**12),
            "name": name,
            "description": f"{cpus} vCPUs, {memory // 1024} GB RAM",
            "guestCpus": cpus,
            "memoryMb": memory,
            "zone": zone,
            "selfLink": f"{API}/projects/{self.project}/zones/{zone}/machineTypes/{name}",
            "isSharedCpu": False,
        }
        itype = bundled().types("gcp").get(name)
        if itype is not None and itype.accelerator:
            body["accelerators"] = [
                {"guestAcceleratorType": itype.accelerator, "guestAcceleratorCount": itype.gpus}
            ]
        return body


def _catalog_zones() -> dict[str, set[str]]:
    catalog = bundled()
    zones: dict[str, set[str]] = {}
    for region in catalog.regions("gcp"):
        for zone in catalog.gcp_zones(region):
            zones.setdefault(zone, set())
    for name, itype in catalog.types("gcp").items():
        for region in itype.regions or catalog.regions("gcp"):
            for zone in catalog.gcp_zones(region):
                zones[zone].add(name)
    return zones


def _name_in(raw: bytes) -> str | None:
    try:
        name = json.loads(raw or b"{}").get("name")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _check_name(name: str, field_name: str = "resource.name") -> None:
    if not _NAME_RE.match(name):
        raise _invalid(
            field_name,
            name,
            "Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?|[1-9][0-9]{0,19})'",
        )


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise ApiError(400, f"Invalid JSON payload received. {e}", "parseError") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid JSON payload received: not an object.", "parseError")
    return body


# filters

_Read = Callable[[dict[str, Any]], dict[str, Any]]

_TERM_RE = re.compile(
    r"""\s*(?P<open>\()?\s*
    (?P<field>[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z0-9_-]+)*)\s*
    (?P<op>!=|=)\s*
    ("(?P<quoted>[^"\\]*)"|(?P<bare>[A-Za-z0-9_.:/-]+))\s*
    (?(open)\))\s*""",
    re.VERBOSE,
)


def parse_filter(text: str) -> list[tuple[str, str, str]]:
    """``(field, op, value)`` terms of a filter that all must hold.

    Raises:
        ApiError: 400 for any syntax beyond ``field = value``, ``field != value`` and their
            conjunction (by juxtaposition of parenthesised terms or ``AND``).
    """
    terms: list[tuple[str, str, str]] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TERM_RE.match(text, pos)
        if m is None:
            raise ApiError(
                400,
                f"Invalid value for field 'filter': '{text}'. The fake Compute API understands "
                'only field = "value", field != "value" and their conjunction.',
                "invalid",
            )
        value = m["quoted"] if m["quoted"] is not None else m["bare"]
        terms.append((m["field"], m["op"], value))
        pos = m.end()
        conj = re.compile(r"AND\s+").match(text, pos)
        if conj is not None:
            pos = conj.end()
            if pos >= len(text):
                raise ApiError(400, f"Invalid value for field 'filter': '{text}'.", "invalid")
    return terms


def _field(resource: dict[str, Any], path: str) -> Any:
    value: Any = resource
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _matches(resource: dict[str, Any], terms: list[tuple[str, str, str]]) -> bool:
    for path, op, expected in terms:
        value = _field(resource, path)
        text = (
            json.dumps(value) if isinstance(value, bool) else None if value is None else str(value)
        )
        if (text == expected) != (op == "="):
            return False
    return True


def _filtered(
    items: list[dict[str, Any]], query: dict[str, str], read: _Read | None
) -> list[dict[str, Any]]:
    """The items the filter matches, each read (a read may move a VM's status on)."""
    terms = parse_filter(query.get("filter", ""))
    return [read(i) if read else copy.deepcopy(i) for i in items if _matches(i, terms)]


def _page_bounds(query: dict[str, str], total: int, page_size: int) -> tuple[int, int]:
    try:
        start = int(query.get("pageToken") or 0)
        size = int(query.get("maxResults") or page_size)
    except ValueError:
        raise ApiError(400, "Invalid value for pageToken or maxResults.", "invalid") from None
    if not 0 <= start <= total or not 0 < size <= 500:
        raise ApiError(400, "Invalid value for pageToken or maxResults.", "invalid")
    return start, min(start + min(size, page_size), total)


def _page(
    link: str,
    kind: str,
    items: list[dict[str, Any]],
    query: dict[str, str],
    page_size: int,
    read: _Read | None = None,
) -> dict[str, Any]:
    chosen = _filtered(items, query, read)
    start, end = _page_bounds(query, len(chosen), page_size)
    body: dict[str, Any] = {
        "kind": kind,
        "id": link,
        "items": chosen[start:end],
        "selfLink": f"{API}/{link}",
    }
    if end < len(chosen):
        body["nextPageToken"] = str(end)
    return body


def _aggregated(
    link: str,
    kind: str,
    key: str,
    scoped: dict[str, list[dict[str, Any]]],
    query: dict[str, str],
    page_size: int,
    read: _Read | None = None,
) -> dict[str, Any]:
    """An aggregated list page: items keyed ``zones/ZONE``; zones without matches carry the
    API's ``NO_RESULTS_ON_PAGE`` warning. Pages cut across zones in zone order."""
    flat = [
        (zone, item) for zone, items in scoped.items() for item in _filtered(items, query, read)
    ]
    start, end = _page_bounds(query, len(flat), page_size)
    page: dict[str, Any] = {}
    for zone in scoped:
        mine = [item for z, item in flat[start:end] if z == zone]
        if mine:
            page[f"zones/{zone}"] = {key: mine}
        else:
            page[f"zones/{zone}"] = {
                "warning": {
                    "code": "NO_RESULTS_ON_PAGE",
                    "message": f"There are no results for scope 'zones/{zone}' on this page.",
                    "data": [{"key": "scope", "value": f"zones/{zone}"}],
                }
            }
    body: dict[str, Any] = {"kind": kind, "id": link, "items": page, "selfLink": f"{API}/{link}"}
    if end < len(flat):
        body["nextPageToken"] = str(end)
    return body
