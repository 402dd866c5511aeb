"""A fake of the Compute Engine v1 REST API over real HTTP, for the real ``google-cloud-compute``
client.

It serves the subset spottrain uses, in the API's own JSON (camelCase field names, resource
URLs, RFC 3339 timestamps, ``{"error": {"code", "message", "errors": [...]}}`` bodies)::

    instances             insert, get, list, aggregatedList, delete, getSerialPortOutput
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
- ``getSerialPortOutput`` (``.../instances/NAME/serialPort?port=1&start=N``) serves the
  text :meth:`GceFake.set_console` gave the VM, else what the ``console_source`` callable
  returns for its name (a hypervisor that runs the VM's boot), else nothing; with the API's
  byte positions: the newest 1 MB is retained, a ``start`` before it is moved to the oldest
  byte kept, a negative ``start`` counts back from the end, ``next`` is the byte after the
  contents. Ports 2 to 4 are empty; a VM that does not exist is a 404.
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

The package holds one module per resource (``instances``, ``operations``, ``templates``,
``groups`` with its ``reconcile``, ``machine_types``), with ``validation`` (what an insert or
a template must satisfy), ``faults``, ``listing`` (filters and pages) and ``common``; this
module routes each call to the resource that serves it.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fakes.http_fake import DispatchingHandler, HTTPFake

from .common import DEFAULT_PROJECT, ApiError, name_in, not_found
from .faults import Faults, FaultsMixin
from .groups import GroupsMixin
from .instances import InstancesMixin
from .machine_types import MachineTypesMixin, catalog_zones
from .operations import OperationsMixin
from .reconcile import ReconcileMixin
from .templates import TemplatesMixin
from .validation import ValidationMixin

_PAGE_SIZE = 500

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
        ("GET", _ZONE + "/instances" + _NAMED + "/serialPort", "instances.getSerialPortOutput"),
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
    "instances.getSerialPortOutput": {"port", "start", "$alt"},
    "instanceTemplates.insert": {"requestId", "$alt"},
    "instanceGroupManagers.insert": {"requestId", "$alt"},
    "instanceGroupManagers.resize": {"size", "requestId", "$alt"},
    "instanceGroupManagers.deleteInstances": {"requestId", "$alt"},
    "instanceGroupManagers.recreateInstances": {"requestId", "$alt"},
    # orderBy is refused: the API says listManagedInstances does not support it.
    "instanceGroupManagers.listManagedInstances": _LIST_PARAMS,
}


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


class GceFake(
    FaultsMixin,
    InstancesMixin,
    TemplatesMixin,
    GroupsMixin,
    ReconcileMixin,
    OperationsMixin,
    MachineTypesMixin,
    ValidationMixin,
    HTTPFake,
):
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
            zone: set(types) for zone, types in (machine_types or catalog_zones()).items()
        }
        self._instances: dict[str, dict[str, dict[str, Any]]] = {}  # zone -> name -> body
        self._stepped_at: dict[tuple[str, str], float] = {}
        self._operations = {}  # zone -> name -> op
        self._faults = Faults()
        self._unknown_images: set[str] = set()
        self._calls: Counter[str] = Counter()
        self._hosts: Counter[str] = Counter()
        self._inserted: list[dict[str, Any]] = []
        self.internal_errors: list[str] = []
        self._ids = itertools.count(random.randrange(10**18, 2 * 10**18))
        self._templates: dict[str, dict[str, Any]] = {}  # name -> body
        self._groups = {}  # zone -> name -> group
        self._group_calls: dict[str, list[str]] = {}  # group name -> methods, in order
        self._rng = random.Random(seed)
        self._consoles: dict[str, str] = {}  # VM name -> its serial port 1 text
        self.console_source: Callable[[str], str | None] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, the ``api_endpoint`` to give the client."""
        return f"http://127.0.0.1:{self.port}"

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
            group = route[1].groupdict().get("n") or name_in(raw)
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
            raise not_found(f"projects/{args['p']}")
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
                raise not_found(f"projects/{self.project}/zones/{zone}")
            for serve in (
                self._serve_instances,
                self._serve_operations,
                self._serve_templates,
                self._serve_groups,
                self._serve_machine_types,
            ):
                answer = serve(call, zone or "", args.get("n") or "", query, raw)
                if answer is not None:
                    return answer
        raise AssertionError(f"unrouted call {call}")  # pragma: no cover
