"""Google Compute Engine: spot (and on-demand) GPU VMs through ``google-cloud-compute``.

How the :class:`~spottrain.cloud.base.Provider` contract maps onto Compute Engine:

- **Offers** come from the bundled catalog (GCP exposes no spot price API that this tool
  uses): every allowed region x zone x machine type x market. Not every zone of a region has
  every GPU type, so unless ``verify_zones`` is off, one ``machineTypes.aggregatedList`` per
  machine type (cached for an hour) keeps only the zones that really have it.
- **Launch** names the VM after the request id (:func:`instance_name`). Compute Engine refuses
  a second VM with the same name in a zone (409 ``alreadyExists``), so a repeated launch reads
  the existing VM back and returns it when its ``spottrain-request`` label matches. The insert
  is accepted asynchronously; a stockout is only known when its operation finishes, so launch
  waits for the operation (``zoneOperations.wait``) up to ``launch_wait_s`` and raises
  :class:`~spottrain.cloud.base.CapacityError` if it failed for capacity.
- **List** is one ``instances.aggregatedList`` filtered on the job label, plus, for zones with
  stopped VMs, one ``zoneOperations.list`` for ``compute.instances.preempted`` operations:
  Compute Engine marks a preempted VM only by that operation.
- **Terminate** deletes each VM and does not wait.

The client library is imported inside the functions that use it, so ``spottrain`` imports
without it; building a :class:`GcpProvider` without it raises ``ImportError`` naming the extra.

Two quirks of the library shape the calls here. The long-running ``insert``/``delete`` helpers
poll through a ``ZoneOperationsClient`` that the library builds with the default endpoint,
ignoring the client options (so a test endpoint would leak to the real API); this module
calls ``insert_unary``/``delete_unary`` and waits with its own operations client built with the
same options. And the read methods (get, list, aggregated list, operations get/list) retry 503
for up to ten minutes by default, which would freeze a reconcile pass; every call here passes
``retry=None`` and a timeout, and the reconcile loop is the retry.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from spottrain.catalog import Catalog, bundled

from .base import (
    TAG_JOB,
    TAG_NODE,
    TAG_REQUEST,
    AuthError,
    BadRequestError,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    OfferQuery,
    ProviderError,
    QuotaError,
    TransientError,
    region_of_zone,
    sort_offers,
)

if TYPE_CHECKING:
    from google.auth.credentials import Credentials
    from google.cloud import compute_v1

CLOUD = "gcp"

DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu124"
DEFAULT_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
PREEMPTED_OPERATION = "compute.instances.preempted"
INSTALL_HINT = "pip install 'spottrain[gcp]'"
AUTH_HINT = (
    "log in with `gcloud auth application-default login`, or point "
    "GOOGLE_APPLICATION_CREDENTIALS at a service-account key file; the account needs "
    "roles/compute.instanceAdmin.v1 on the project (and roles/iam.serviceAccountUser to "
    "attach a service account to the VMs)"
)

# Machine families whose GPUs come with the machine type: the API refuses guestAccelerators
# for them. Other types (N1) need their GPUs spelled out.
_BUILT_IN_GPU_FAMILIES = ("a2-", "a3-", "a4-", "g2-", "g4-")
# A3 machine types only boot with the gVNIC network interface.
_GVNIC_FAMILIES = ("a3-", "a4-")

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_PROJECT_RE = re.compile(r"^([a-z0-9.-]+:)?[a-z][a-z0-9-]{4,28}[a-z0-9]\Z")
_REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+\Z")
_IMAGE_RE = re.compile(
    r"^(https://(www|compute)\.googleapis\.com/compute/v1/)?"
    r"(projects/[a-z0-9.:-]+/)?global/images/(family/)?[a-z]([-a-z0-9]*[a-z0-9])?\Z"
)
_NETWORK_RE = re.compile(
    r"^(https://(www|compute)\.googleapis\.com/compute/v1/)?"
    r"((projects/[a-z0-9.:-]+/)?global/networks/)?[a-z]([-a-z0-9]*[a-z0-9])?\Z"
)
_SUBNET_PATH_RE = re.compile(
    r"^(https://(www|compute)\.googleapis\.com/compute/v1/)?"
    r"(projects/[a-z0-9.:-]+/)?regions/(?P<region>[a-z]+-[a-z]+[0-9]+)/subnetworks/"
    r"[a-z]([-a-z0-9]*[a-z0-9])?\Z"
)
_SUBNET_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_DISK_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*[a-z0-9]\Z")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{1,63}\Z")
_QUOTA_RE = re.compile(r"Quota '(?P<metric>[A-Za-z0-9_]+)' exceeded")
_IN_REGION_RE = re.compile(r"in region (?P<region>[a-z]+-[a-z]+[0-9]+)")

_MAX_RUN_DURATION_S = (30, 120 * 86400)  # what Compute Engine accepts
_MACHINE_TYPES_TTL_S = 3600.0

_STATES = {
    "PROVISIONING": InstanceState.PENDING,
    "STAGING": InstanceState.PENDING,
    "RUNNING": InstanceState.RUNNING,
    "STOPPING": InstanceState.STOPPING,
    "SUSPENDING": InstanceState.STOPPING,
    "SUSPENDED": InstanceState.STOPPING,
    "REPAIRING": InstanceState.STOPPING,
    "TERMINATED": InstanceState.TERMINATED,
}
# States in which a VM may have been preempted (STOPPING: the preemption is under way).
_MAYBE_PREEMPTED = ("STOPPING", "TERMINATED")


@dataclass(frozen=True)
class GcpSettings:
    """Where and how spottrain launches Compute Engine VMs.

    Attributes:
        project: the project id (``my-project``, or ``example.com:my-project``).
        regions: the regions spottrain may launch in; empty allows every region the catalog
            prices.
        source_image: the boot image, an image or image family path
            (``projects/P/global/images/family/F``).
        network: the VPC network (a name or a ``global/networks/NAME`` path); empty: the
            project's ``default`` network, unless ``subnetwork`` is set.
        subnetwork: a subnetwork name, taken as ``regions/REGION/subnetworks/NAME`` in whatever
            region a VM launches (the Terraform module creates the same name in each), or a
            full ``regions/R/subnetworks/NAME`` path, which pins ``regions`` to ``(R,)``.
        external_ip: give each VM an ephemeral public address. Off by default: a VM with one
            is reachable from the internet wherever the network's firewall allows (the
            ``default`` network opens SSH to all); without one it needs Cloud NAT to reach
            the internet and Private Google Access to reach Google APIs.
        service_account: the email of the service account the VMs run as; ``default`` is the
            project's Compute Engine default account (usually Editor on the project); empty,
            the default, attaches none (the VMs then cannot reach Cloud Storage).
        scopes: the OAuth scopes of that service account.
        boot_disk_gb: the boot disk's size.
        boot_disk_type: ``pd-balanced``, ``pd-ssd``, ...
        termination_action: what Compute Engine does to a preempted spot VM, ``STOP`` (the
            default) or ``DELETE``. With ``STOP`` the VM stays, stopped, with its labels, so
            ``list`` reports it as interrupted for as long as it exists, even to a controller
            that restarted meanwhile; the controller deletes it. A stopped VM costs only its
            boot disk. With ``DELETE`` the VM vanishes and only a zone operation records the
            preemption, which carries no labels: ``list`` can then report only the VMs this
            provider object launched or listed before they vanished.
        max_run_duration_s: stop (or delete) each VM after this many seconds, a backstop
            against VMs leaked by a dead controller; None: no limit.
        launch_wait_s: how long ``launch`` waits for the insert operation to finish, so that a
            stockout is raised as a CapacityError. 0: return as soon as the insert is accepted
            (a stockout then shows as a VM that never appears in ``list``).
        request_timeout_s: the timeout of each API call.
        verify_zones: ask the API which zones have each machine type before offering them.
    """

    project: str
    regions: tuple[str, ...] = ()
    source_image: str = DEFAULT_IMAGE
    network: str = ""
    subnetwork: str = ""
    external_ip: bool = False
    service_account: str = ""
    scopes: tuple[str, ...] = DEFAULT_SCOPES
    boot_disk_gb: int = 200
    boot_disk_type: str = "pd-balanced"
    termination_action: str = "STOP"
    max_run_duration_s: int | None = None
    launch_wait_s: float = 90.0
    request_timeout_s: float = 60.0
    verify_zones: bool = True

    def __post_init__(self) -> None:
        if not _PROJECT_RE.match(self.project):
            raise ValueError(
                f"gcp project {self.project!r} is not a project id: 6-30 lowercase letters, "
                "digits and '-', starting with a letter (see `gcloud projects list`)"
            )
        if isinstance(self.regions, str):
            raise ValueError(
                f"gcp regions must be a tuple of regions, got the string {self.regions!r}"
            )
        for region in self.regions:
            if not _REGION_RE.match(region):
                raise ValueError(
                    f"gcp region {region!r} is not a region name like 'us-central1' "
                    "(a zone like 'us-central1-a' is not a region)"
                )
        if len(set(self.regions)) != len(self.regions):
            raise ValueError(f"gcp regions {self.regions!r} name a region twice")
        if not _IMAGE_RE.match(self.source_image):
            raise ValueError(
                f"gcp source_image {self.source_image!r} is not an image path: use "
                "projects/PROJECT/global/images/NAME or projects/PROJECT/global/images/family/"
                "FAMILY"
            )
        if self.network and not _NETWORK_RE.match(self.network):
            raise ValueError(
                f"gcp network {self.network!r} is not a network name or a global/networks/NAME path"
            )
        if self.subnetwork:
            pinned = _SUBNET_PATH_RE.match(self.subnetwork)
            if pinned is None and not _SUBNET_NAME_RE.match(self.subnetwork):
                raise ValueError(
                    f"gcp subnetwork {self.subnetwork!r} is not a subnetwork name or a "
                    "regions/REGION/subnetworks/NAME path"
                )
            if pinned is not None and self.regions != (pinned["region"],):
                raise ValueError(
                    f"gcp subnetwork {self.subnetwork!r} lies in region {pinned['region']}, so "
                    f"regions must be ({pinned['region']!r},), got {self.regions!r}; or give the "
                    "subnetwork's bare name to use the same name in every region"
                )
        if self.service_account not in ("", "default") and not re.match(
            r"^[^@\s]+@[^@\s]+\Z", self.service_account
        ):
            raise ValueError(
                f"gcp service_account {self.service_account!r} is not an email, 'default' or empty"
            )
        for scope in self.scopes:
            if not scope.startswith("https://www.googleapis.com/auth/"):
                raise ValueError(
                    f"gcp scope {scope!r} is not an OAuth scope URL "
                    "(https://www.googleapis.com/auth/...)"
                )
        if not 10 <= self.boot_disk_gb <= 65536:
            raise ValueError(f"gcp boot_disk_gb must be in [10, 65536], got {self.boot_disk_gb}")
        if not _DISK_TYPE_RE.match(self.boot_disk_type):
            raise ValueError(
                f"gcp boot_disk_type {self.boot_disk_type!r} is not a disk type name like "
                "'pd-balanced'"
            )
        if self.termination_action not in ("STOP", "DELETE"):
            raise ValueError(
                f"gcp termination_action must be 'STOP' or 'DELETE', got "
                f"{self.termination_action!r}"
            )
        low, high = _MAX_RUN_DURATION_S
        if self.max_run_duration_s is not None and not low <= self.max_run_duration_s <= high:
            raise ValueError(
                f"gcp max_run_duration_s must be in [{low}, {high}] seconds (or None), got "
                f"{self.max_run_duration_s}"
            )
        if not self.launch_wait_s >= 0:
            raise ValueError(f"gcp launch_wait_s must be >= 0, got {self.launch_wait_s}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"gcp request_timeout_s must be > 0, got {self.request_timeout_s}")


def instance_name(request_id: str) -> str:
    """The VM name a launch request gets: ``st-`` and the request id where that is a valid
    Compute Engine name, else a shortened, sanitised form with a hash of the id.

    The name is a function of the request id alone, so a repeated launch collides with the
    first and the API refuses it (409), which is what makes launches idempotent.
    """
    if len(request_id) <= 60 and re.match(r"^[a-z0-9-]*[a-z0-9]\Z", request_id):
        return f"st-{request_id}"
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:8]
    base = re.sub(r"[^a-z0-9-]", "-", request_id)[:50].strip("-")
    return f"st-{base}-{digest}" if base else f"st-{digest}"


@dataclass(frozen=True)
class CallTarget:
    """What a call was aimed at, so that an error can carry the data a planner needs.

    Attributes:
        zone: the zone of the call, if it had one.
        region: the region of the call, if it had one.
        instance_type: the machine type being launched, if any.
        market: the market being launched in.
    """

    zone: str = ""
    region: str = ""
    instance_type: str = ""
    market: Market = Market.SPOT


@dataclass(frozen=True)
class _Facts:
    status: int | None
    codes: tuple[str, ...]
    message: str
    quota_region: str = ""


_STOCKOUT_CODES = frozenset(
    {
        "ZONE_RESOURCE_POOL_EXHAUSTED",
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
        "resourcePoolExhausted",
    }
)
_RATE_CODES = frozenset(
    {
        "rateLimitExceeded",
        "userRateLimitExceeded",
        "RATE_LIMIT_EXCEEDED",
        "RESOURCE_OPERATION_RATE_EXCEEDED",
        "resourceNotReady",
        "RESOURCE_NOT_READY",
    }
)
_QUOTA_CODES = frozenset({"QUOTA_EXCEEDED", "quotaExceeded"})
_AUTH_CODES = frozenset(
    {
        "authError",
        "required",
        "forbidden",
        "insufficientPermissions",
        "accessNotConfigured",
        "SERVICE_DISABLED",
        "PERMISSIONS_ERROR",
        "IAM_PERMISSION_DENIED",
    }
)
_NOT_FOUND_CODES = frozenset({"RESOURCE_NOT_FOUND", "notFound"})
_SERVER_CODES = frozenset({"INTERNAL_ERROR", "backendError", "SERVICE_UNAVAILABLE"})


def classify_error(error: object, target: CallTarget | None = None) -> ProviderError:
    """Turn a refusal from Compute Engine into the typed error the planner understands.

    This is the one place that knows Google's error vocabulary. ``error`` is what a call
    raised (a ``google.api_core`` exception, a ``google.auth`` credentials error, a
    ``requests`` connection error or timeout) or a finished ``compute_v1.Operation`` whose
    ``error.errors`` say why it failed (stockouts and some quota refusals arrive that way).

    Args:
        error: the exception or the failed operation.
        target: what the call was aimed at; a CapacityError takes its zone, machine type and
            market from it, a QuotaError its region unless the message names one.

    Returns:
        A CapacityError (stockout), QuotaError, AuthError (with how to fix the credentials),
        BadRequestError (invalid request, unknown image or machine type) or TransientError
        (throttling, 5xx, timeouts, connection errors, anything not recognised).
    """
    where = target or CallTarget()
    auth = _classify_credentials_error(error)
    if auth is not None:
        return auth
    facts = _facts_of(error)
    if facts is None:
        return TransientError(CLOUD, f"{type(error).__name__}: {error}")
    return _classify_facts(facts, where)


def _classify_credentials_error(error: object) -> ProviderError | None:
    try:
        from google.auth import exceptions as auth_exc
    except ImportError:  # pragma: no cover - google-auth comes with the client library
        return None
    if isinstance(error, auth_exc.DefaultCredentialsError):
        return AuthError(CLOUD, f"no Google credentials found ({error}); {AUTH_HINT}")
    if isinstance(error, auth_exc.RefreshError):
        if getattr(error, "retryable", False):
            return TransientError(CLOUD, f"refreshing the credentials failed for now: {error}")
        return AuthError(CLOUD, f"the Google credentials were rejected ({error}); {AUTH_HINT}")
    if isinstance(error, auth_exc.TransportError):
        return TransientError(CLOUD, f"could not reach Google's auth service: {error}")
    return None


def _facts_of(error: object) -> _Facts | None:
    """Status, error codes and message of an API exception or a failed operation; None for
    errors that never reached the API (timeouts, connection errors)."""
    from google.api_core import exceptions as api_exc

    if isinstance(error, api_exc.GoogleAPICallError):
        codes: list[str] = []
        for item in error.errors:
            if isinstance(item, dict):
                codes.extend(str(item[k]) for k in ("reason", "code") if item.get(k))
        if error.reason:
            codes.append(error.reason)
        status = error.code if isinstance(error.code, int) else None
        return _Facts(status, tuple(codes), str(error.message))
    if _is_operation(error):
        return _operation_facts(error)
    return None


def _is_operation(error: object) -> bool:
    try:
        from google.cloud import compute_v1
    except ImportError:  # pragma: no cover
        return False
    return isinstance(error, compute_v1.Operation)


def _operation_facts(op: Any) -> _Facts:
    codes: list[str] = []
    messages: list[str] = []
    region = ""
    for item in op.error.errors:
        codes.append(item.code)
        messages.append(item.message)
        for detail in item.error_details:
            if "quota_info" in detail:
                region = detail.quota_info.dimensions.get("region", region)
    status = op.http_error_status_code or None
    message = "; ".join(m for m in messages if m) or op.http_error_message or "operation failed"
    return _Facts(status, tuple(codes), message, region)


def _classify_facts(facts: _Facts, where: CallTarget) -> ProviderError:
    codes = set(facts.codes)
    text = facts.message
    lower = text.lower()
    status = facts.status
    shown = f"{status} {text}" if status else text
    if (
        codes & _STOCKOUT_CODES
        or "does not have enough resources available" in lower
        or "resource pool exhausted" in lower
    ):
        return _capacity(where, shown)
    if "UNSUPPORTED_OPERATION" in codes:
        # Compute Engine says this when a zone does not offer the type (or spot for it): an
        # offer to avoid for a while rather than a broken request.
        if where.instance_type and (where.instance_type in text or "zone" in lower):
            return _capacity(where, shown)
        return BadRequestError(CLOUD, shown)
    if codes & _RATE_CODES or status == 429 or "rate limit" in lower:
        return TransientError(CLOUD, f"throttled or not ready, retry later: {shown}")
    quota = _QUOTA_RE.search(text)
    if codes & _QUOTA_CODES or quota:
        found = _IN_REGION_RE.search(text)
        region = facts.quota_region or (found["region"] if found else "") or where.region
        return QuotaError(
            CLOUD,
            region or "the project",
            f"{shown} (ask for more in the console's IAM & Admin > Quotas page)",
        )
    if status in (401, 403) or codes & _AUTH_CODES:
        return AuthError(CLOUD, f"{shown}; {AUTH_HINT}")
    if status == 404 or codes & _NOT_FOUND_CODES:
        return BadRequestError(CLOUD, f"not found: {shown}")
    if (status is not None and status >= 500) or codes & _SERVER_CODES:
        return TransientError(CLOUD, shown)
    if (status is not None and 400 <= status < 500) or any(
        c.startswith(("INVALID", "BAD_REQUEST", "CONDITION_NOT_MET")) for c in codes
    ):
        return BadRequestError(CLOUD, shown)
    return TransientError(CLOUD, shown)


def _capacity(where: CallTarget, message: str) -> CapacityError:
    return CapacityError(
        CLOUD, where.zone or "unknown zone", where.instance_type or "?", where.market, message
    )


def _is_api_error(error: BaseException) -> bool:
    """Whether ``error`` came from talking to the API (so it is classified), as opposed to a
    bug in this module (which propagates)."""
    from google.api_core import exceptions as api_exc
    from google.auth import exceptions as auth_exc

    if isinstance(error, api_exc.GoogleAPIError | auth_exc.GoogleAuthError):
        return True
    try:
        import requests
    except ImportError:  # pragma: no cover - the REST transport needs it
        return isinstance(error, OSError)
    return isinstance(error, requests.RequestException | OSError)


def _http_code(error: BaseException) -> int | None:
    from google.api_core import exceptions as api_exc

    if isinstance(error, api_exc.GoogleAPICallError) and isinstance(error.code, int):
        return error.code
    return None


_Client = TypeVar("_Client")


def rest_client(
    kind: Callable[..., _Client], credentials: Credentials | None, api_endpoint: str | None
) -> _Client:
    """A ``compute_v1`` client of class ``kind`` on the REST transport, pointed at
    ``api_endpoint`` (None: Google's).

    Raises:
        AuthError: no credentials were given and none could be found.
        ProviderError: building it failed otherwise.
    """
    from google.api_core.client_options import ClientOptions

    options = ClientOptions(api_endpoint=api_endpoint) if api_endpoint else None
    try:
        return kind(credentials=credentials, client_options=options, transport="rest")
    except Exception as e:
        if _is_api_error(e):
            raise classify_error(e) from e
        raise


def call_api(target: CallTarget, timeout: float, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """One API call, without the library's retries, its errors classified."""
    try:
        return fn(retry=None, timeout=timeout, **kwargs)
    except Exception as e:
        if _is_api_error(e):
            raise classify_error(e, target) from e
        raise


def list_all(target: CallTarget, timeout: float, fn: Callable[..., Any], request: Any) -> list[Any]:
    """Every item of a paged list call (pairs of scope and items for aggregated lists);
    later pages are fetched while iterating, so their errors are classified here too."""
    try:
        return list(fn(request=request, retry=None, timeout=timeout))
    except Exception as e:
        if _is_api_error(e):
            raise classify_error(e, target) from e
        raise


def wait_zone_operation(
    operations: compute_v1.ZoneOperationsClient,
    op: compute_v1.Operation,
    *,
    project: str,
    target: CallTarget,
    budget_s: float,
    request_timeout_s: float,
    clock: Callable[[], float] = time.time,
) -> compute_v1.Operation:
    """Wait for a zonal operation to finish, at most ``budget_s``; the operation as last seen
    (not DONE when the budget ran out).

    Raises:
        ProviderError: a poll was refused (a timeout only ends the wait).
    """
    from google.cloud import compute_v1

    deadline = clock() + budget_s
    while op.status != compute_v1.Operation.Status.DONE:
        left = deadline - clock()
        if left <= 0:
            return op
        started = clock()
        try:
            # The real API holds a wait for up to two minutes; a budget shorter than that
            # ends in a client timeout, which only means "not done yet".
            op = operations.wait(
                project=project,
                zone=target.zone,
                operation=op.name,
                retry=None,
                timeout=min(left, request_timeout_s) + 1.0,
            )
        except Exception as e:
            if _is_timeout(e):
                return op
            if _is_api_error(e):
                raise classify_error(e, target) from e
            raise
        if op.status != compute_v1.Operation.Status.DONE and clock() - started < 0.5:
            # A server that answers a wait at once would make this a busy loop.
            time.sleep(min(0.5, max(0.0, deadline - clock())))
    return op


@dataclass
class _Clients:
    instances: compute_v1.InstancesClient
    operations: compute_v1.ZoneOperationsClient
    machine_types: compute_v1.MachineTypesClient


@dataclass
class _Known:
    """A VM this provider object launched or listed: what ``list`` reports once it vanished
    (preempted with termination action DELETE)."""

    instance: Instance
    instance_id: int = 0


@dataclass
class _ZoneCache:
    fetched_at: float
    zones: frozenset[str] = field(default_factory=frozenset)


@dataclass
class _Preemptions:
    """VMs named by ``compute.instances.preempted`` operations, by (zone, numeric id), or by
    (zone, name) for operations that carry no id."""

    ids: set[tuple[str, int]] = field(default_factory=set)
    names: set[tuple[str, str]] = field(default_factory=set)

    def names_vm(self, zone: str, name: str, instance_id: int) -> bool:
        # The numeric id tells a VM from an earlier one that had the same name.
        return (zone, instance_id) in self.ids or (zone, name) in self.names


class GcpProvider:
    """The :class:`~spottrain.cloud.base.Provider` for Google Compute Engine.

    Args:
        settings: the project, regions and VM settings.
        credentials: Google credentials; None uses Application Default Credentials (looked up
            on the first API call, so ``offers`` works without them when ``verify_zones`` is
            off).
        api_endpoint: another endpoint for the Compute API (``http://127.0.0.1:PORT`` for the
            test fake); None: Google's.
        catalog: the instance table; None: the bundled one.
        clock: unix seconds; drives the launch wait and the machine-type cache.

    Raises:
        ImportError: google-cloud-compute is not installed (install the ``gcp`` extra).
        ValueError: a region of ``settings`` has no zones or prices in the catalog.
    """

    cloud = CLOUD

    def __init__(
        self,
        settings: GcpSettings,
        *,
        credentials: Credentials | None = None,
        api_endpoint: str | None = None,
        catalog: Catalog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        try:
            from google.cloud import compute_v1  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"the gcp cloud needs google-cloud-compute: {INSTALL_HINT} ({e})"
            ) from e
        self.settings = settings
        self._credentials = credentials
        self._endpoint = api_endpoint
        self._catalog = catalog or bundled()
        self._clock = clock
        known_regions = self._catalog.regions(CLOUD)
        for region in settings.regions:
            if region not in known_regions:
                raise ValueError(
                    f"gcp region {region!r} has no prices in the catalog; priced regions: "
                    f"{', '.join(known_regions)}"
                )
        self._regions = settings.regions or tuple(known_regions)
        self._lock = threading.Lock()
        self._clients: _Clients | None = None
        self._zones: dict[str, str] = {}  # VM name -> zone, from launch and list
        self._known: dict[str, _Known] = {}  # VM name -> what we last saw of it
        self._type_zones: dict[str, _ZoneCache] = {}

    # clients

    def _api(self) -> _Clients:
        with self._lock:
            if self._clients is None:
                self._clients = self._make_clients()
            return self._clients

    def _make_clients(self) -> _Clients:
        from google.cloud import compute_v1

        return _Clients(
            instances=rest_client(compute_v1.InstancesClient, self._credentials, self._endpoint),
            operations=rest_client(
                compute_v1.ZoneOperationsClient, self._credentials, self._endpoint
            ),
            machine_types=rest_client(
                compute_v1.MachineTypesClient, self._credentials, self._endpoint
            ),
        )

    def _call(self, target: CallTarget, fn: Callable[..., Any], **kwargs: Any) -> Any:
        return call_api(target, self.settings.request_timeout_s, fn, **kwargs)

    def _all(self, target: CallTarget, fn: Callable[..., Any], request: Any) -> list[Any]:
        return list_all(target, self.settings.request_timeout_s, fn, request)

    # offers

    def offers(self, query: OfferQuery) -> list[Offer]:
        """Every region x zone x machine type x market of the catalog that the settings and
        ``query`` allow, cheapest first.

        Raises:
            AuthError, TransientError: checking which zones have a machine type failed (only
                with ``verify_zones``).
        """
        regions = [r for r in self._regions if not query.regions or r in query.regions]
        found: list[Offer] = []
        for name, itype in sorted(self._catalog.types(CLOUD).items()):
            if query.instance_types and name not in query.instance_types:
                continue
            if itype.gpus < query.min_gpus:
                continue
            type_regions = [r for r in regions if not itype.regions or r in itype.regions]
            if not type_regions:
                continue
            available = self._zones_with(name) if self.settings.verify_zones else None
            for region in type_regions:
                for zone in self._catalog.gcp_zones(region):
                    if available is not None and zone not in available:
                        continue
                    for market in query.markets:
                        offer = Offer(
                            cloud=CLOUD,
                            region=region,
                            zone=zone,
                            instance_type=name,
                            gpus=itype.gpus,
                            gpu_type=itype.gpu_type,
                            market=market,
                            price_per_hour=self._catalog.price(CLOUD, name, region, market),
                            interruption_risk=(
                                itype.interruption_risk if market is Market.SPOT else 0.0
                            ),
                            network=itype.network,
                        )
                        if query.allows(offer):
                            found.append(offer)
        return sort_offers(found)

    def _zones_with(self, machine_type: str) -> frozenset[str]:
        now = self._clock()
        with self._lock:
            cached = self._type_zones.get(machine_type)
        if cached is not None and now - cached.fetched_at < _MACHINE_TYPES_TTL_S:
            return cached.zones
        from google.cloud import compute_v1

        api = self._api()
        request = compute_v1.AggregatedListMachineTypesRequest(
            project=self.settings.project, filter=f'name = "{machine_type}"'
        )
        target = CallTarget(instance_type=machine_type)
        result = frozenset(
            _last(mt.zone) or _last(scope)
            for scope, scoped in self._all(target, api.machine_types.aggregated_list, request)
            for mt in scoped.machine_types
            if mt.name == machine_type
        )
        with self._lock:
            self._type_zones[machine_type] = _ZoneCache(now, result)
        return result

    # launch

    def launch(self, request: LaunchRequest) -> Instance:
        """Launch one VM for ``request``, or return the VM an earlier call with the same
        request id launched.

        Raises:
            ValueError: the offer is not a GCP offer.
            CapacityError: the zone has no capacity for the type in that market (a stockout,
                reported by the API at once or by the insert operation).
            QuotaError: the region's quota (GPUs, CPUs) is used up.
            AuthError: missing or rejected credentials, or no permission.
            BadRequestError: the API refused the request (unknown machine type or image, an
                invalid setting), or the VM name is taken by a VM of another request.
            TransientError: throttling, a server error, a timeout.
        """
        offer = request.offer
        if offer.cloud != CLOUD:
            raise ValueError(
                f"the gcp provider cannot launch an offer of cloud {offer.cloud!r} "
                f"({offer.instance_type} in {offer.zone})"
            )
        from google.cloud import compute_v1

        api = self._api()
        name = instance_name(request.request_id)
        target = CallTarget(
            zone=offer.zone,
            region=offer.region,
            instance_type=offer.instance_type,
            market=offer.market,
        )
        body = self._instance_body(name, request)
        try:
            op = api.instances.insert_unary(
                project=self.settings.project,
                zone=offer.zone,
                instance_resource=body,
                retry=None,
                timeout=self.settings.request_timeout_s,
            )
        except Exception as e:
            if _http_code(e) == 409:
                return self._adopt(name, request, target)
            if _is_api_error(e):
                raise classify_error(e, target) from e
            raise
        self._remember_zone(name, offer.zone)
        op = self._wait(op, target)
        if op.error.errors:
            if any(err.code == "RESOURCE_ALREADY_EXISTS" for err in op.error.errors):
                return self._adopt(name, request, target)
            self._forget(name)
            raise classify_error(op, target)
        done = op.status == compute_v1.Operation.Status.DONE
        try:
            found = self._call(
                target,
                api.instances.get,
                project=self.settings.project,
                zone=offer.zone,
                instance=name,
            )
        except BadRequestError:
            # Not created yet (the operation still runs) or already gone again: report what
            # was asked for; ``list`` will tell the truth.
            return self._pending(name, request, terminated=done)
        return self._adopt_instance(found, request, target)

    def _instance_body(self, name: str, request: LaunchRequest) -> compute_v1.Instance:
        from google.cloud import compute_v1

        s = self.settings
        offer = request.offer
        zone = offer.zone
        spot = offer.market is Market.SPOT
        scheduling = compute_v1.Scheduling(
            provisioning_model="SPOT" if spot else "STANDARD",
            # GPU VMs cannot live-migrate: a host maintenance stops them.
            on_host_maintenance="TERMINATE",
            # A spot VM must not restart itself; the controller decides where to backfill.
            automatic_restart=not spot,
        )
        if spot or s.max_run_duration_s is not None:
            scheduling.instance_termination_action = s.termination_action
        if s.max_run_duration_s is not None:
            scheduling.max_run_duration = compute_v1.Duration(seconds=s.max_run_duration_s)
        labels = request.all_tags()
        items = [
            compute_v1.Items(key=TAG_JOB, value=request.job),
            compute_v1.Items(key=TAG_NODE, value=request.node),
            compute_v1.Items(key=TAG_REQUEST, value=request.request_id),
        ]
        if request.user_data:
            items.insert(0, compute_v1.Items(key="startup-script", value=request.user_data))
        nic = compute_v1.NetworkInterface()
        network, subnetwork = self._network_for(offer.region)
        if network:
            nic.network = network
        if subnetwork:
            nic.subnetwork = subnetwork
        if s.external_ip:
            nic.access_configs = [
                compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")
            ]
        if offer.instance_type.startswith(_GVNIC_FAMILIES):
            nic.nic_type = "GVNIC"
        body = compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{offer.instance_type}",
            labels=labels,
            metadata=compute_v1.Metadata(items=items),
            scheduling=scheduling,
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=s.source_image,
                        disk_size_gb=s.boot_disk_gb,
                        disk_type=f"zones/{zone}/diskTypes/{s.boot_disk_type}",
                        labels=labels,
                    ),
                )
            ],
            network_interfaces=[nic],
        )
        accelerators = self._accelerators(zone, offer.instance_type)
        if accelerators:
            body.guest_accelerators = accelerators
        if s.service_account:
            body.service_accounts = [
                compute_v1.ServiceAccount(email=s.service_account, scopes=list(s.scopes))
            ]
        return body

    def _accelerators(self, zone: str, machine_type: str) -> list[compute_v1.AcceleratorConfig]:
        from google.cloud import compute_v1

        if machine_type.startswith(_BUILT_IN_GPU_FAMILIES):
            return []
        itype = self._catalog.types(CLOUD).get(machine_type)
        if itype is None or not itype.accelerator or not itype.gpus:
            return []
        return [
            compute_v1.AcceleratorConfig(
                accelerator_type=f"zones/{zone}/acceleratorTypes/{itype.accelerator}",
                accelerator_count=itype.gpus,
            )
        ]

    def _network_for(self, region: str) -> tuple[str, str]:
        s = self.settings
        network = s.network
        if network and "/" not in network:
            network = f"global/networks/{network}"
        subnetwork = s.subnetwork
        if subnetwork and "/" not in subnetwork:
            subnetwork = f"regions/{region}/subnetworks/{subnetwork}"
        if not network and not subnetwork:
            network = "global/networks/default"
        return network, subnetwork

    def _wait(self, op: compute_v1.Operation, target: CallTarget) -> compute_v1.Operation:
        """Wait for an insert operation to finish, at most ``launch_wait_s``."""
        return wait_zone_operation(
            self._api().operations,
            op,
            project=self.settings.project,
            target=target,
            budget_s=self.settings.launch_wait_s,
            request_timeout_s=self.settings.request_timeout_s,
            clock=self._clock,
        )

    def _adopt(self, name: str, request: LaunchRequest, target: CallTarget) -> Instance:
        """The name is taken: return that VM if this request launched it."""
        api = self._api()
        try:
            found = self._call(
                target,
                api.instances.get,
                project=self.settings.project,
                zone=target.zone,
                instance=name,
            )
        except BadRequestError:
            # Deleted between the insert's 409 and this read: the next pass launches again.
            raise TransientError(
                CLOUD, f"instance {name} in {target.zone} existed a moment ago and is gone"
            ) from None
        return self._adopt_instance(found, request, target)

    def _adopt_instance(
        self, found: compute_v1.Instance, request: LaunchRequest, target: CallTarget
    ) -> Instance:
        owner = found.labels.get(TAG_REQUEST, "")
        if owner != request.request_id:
            raise BadRequestError(
                CLOUD,
                f"instance name {found.name} in {target.zone} is taken by a VM of "
                f"{'request ' + repr(owner) if owner else 'no spottrain request'}, not of "
                f"request {request.request_id!r}; delete it or use another request id",
            )
        instance = self._to_instance(found)
        self._remember(instance, found.id)
        return instance

    def _pending(self, name: str, request: LaunchRequest, *, terminated: bool) -> Instance:
        offer = request.offer
        return Instance(
            id=name,
            cloud=CLOUD,
            region=offer.region,
            zone=offer.zone,
            instance_type=offer.instance_type,
            market=offer.market,
            state=InstanceState.TERMINATED if terminated else InstanceState.PENDING,
            job=request.job,
            node=request.node,
            request_id=request.request_id,
        )

    # list

    def list(self, job: str) -> list[Instance]:
        """Every VM labelled with ``job`` that Compute Engine still reports, stopped ones
        included; preempted ones are ``interrupted``.

        Raises:
            AuthError, TransientError: the API could not be asked.
        """
        if not _LABEL_VALUE_RE.match(job):
            return []  # not a label value, so no VM can carry it
        from google.cloud import compute_v1

        api = self._api()
        request = compute_v1.AggregatedListInstancesRequest(
            project=self.settings.project, filter=f'labels.{TAG_JOB} = "{job}"'
        )
        raw: list[compute_v1.Instance] = [
            found
            for _scope, scoped in self._all(CallTarget(), api.instances.aggregated_list, request)
            for found in scoped.instances
            # The filter is the server's; checking the label again costs nothing.
            if found.labels.get(TAG_JOB) == job
        ]
        seen = {i.name for i in raw}
        with self._lock:
            vanished = [
                k for n, k in self._known.items() if k.instance.job == job and n not in seen
            ]
        zones = {_last(i.zone) for i in raw if i.status in _MAYBE_PREEMPTED}
        zones |= {k.instance.zone for k in vanished}
        preempted = self._preempted(sorted(zones))
        result: list[Instance] = []
        for found in raw:
            inst = self._to_instance(found)
            if found.status in _MAYBE_PREEMPTED and preempted.names_vm(
                inst.zone, found.name, found.id
            ):
                inst = _interrupted(inst, inst.state)
            self._remember(inst, found.id)
            result.append(inst)
        for known in vanished:
            inst = known.instance
            if preempted.names_vm(inst.zone, inst.id, known.instance_id):
                # Preempted with termination action DELETE: gone, but it was taken from us.
                result.append(_interrupted(inst, InstanceState.TERMINATED))
            else:
                self._forget(inst.id)
        return sorted(result, key=lambda i: (i.zone, i.id))

    def _preempted(self, zones: Iterable[str]) -> _Preemptions:
        """The VMs that preemption operations in these zones name."""
        from google.cloud import compute_v1

        api = self._api()
        found = _Preemptions()
        for zone in zones:
            target = CallTarget(zone=zone)
            request = compute_v1.ListZoneOperationsRequest(
                project=self.settings.project,
                zone=zone,
                filter=f'operationType = "{PREEMPTED_OPERATION}"',
            )
            for op in self._all(target, api.operations.list, request):
                if op.operation_type != PREEMPTED_OPERATION:
                    continue
                if op.target_id:
                    found.ids.add((zone, op.target_id))
                elif op.target_link:
                    found.names.add((zone, _last(op.target_link)))
        return found

    def _to_instance(self, found: compute_v1.Instance) -> Instance:
        zone = _last(found.zone)
        spot = found.scheduling.provisioning_model == "SPOT" or found.scheduling.preemptible
        address = found.network_interfaces[0].network_i_p if found.network_interfaces else ""
        return Instance(
            id=found.name,
            cloud=CLOUD,
            region=region_of_zone(CLOUD, zone),
            zone=zone,
            instance_type=_last(found.machine_type),
            market=Market.SPOT if spot else Market.ON_DEMAND,
            state=_STATES.get(found.status, InstanceState.PENDING),
            job=found.labels.get(TAG_JOB, ""),
            node=found.labels.get(TAG_NODE, ""),
            request_id=found.labels.get(TAG_REQUEST, ""),
            state_reason=found.status_message,
            launched_at=_timestamp(found.creation_timestamp),
            address=address,
        )

    # terminate

    def terminate(self, instance_ids: Sequence[str]) -> None:
        """Delete these VMs without waiting. Unknown or already deleted ones are ignored.

        Every id is tried; the first refusal is raised after the others were asked.

        Raises:
            AuthError, TransientError: the API refused or failed a deletion.
        """
        api = self._api()
        first: ProviderError | None = None
        for name in instance_ids:
            if not _NAME_RE.match(name):
                continue  # not a Compute Engine name, so not a VM of ours
            try:
                zone = self._zone_of(name)
                if zone is None:
                    continue
                target = CallTarget(zone=zone, region=region_of_zone(CLOUD, zone))
                try:
                    self._call(
                        target,
                        api.instances.delete_unary,
                        project=self.settings.project,
                        zone=zone,
                        instance=name,
                    )
                except BadRequestError as e:
                    if not _is_not_found(e):
                        raise
                self._forget(name)
            except ProviderError as e:
                first = first or e
        if first is not None:
            raise first

    def _zone_of(self, name: str) -> str | None:
        with self._lock:
            zone = self._zones.get(name)
        if zone is not None:
            return zone
        from google.cloud import compute_v1

        api = self._api()
        request = compute_v1.AggregatedListInstancesRequest(
            project=self.settings.project, filter=f'name = "{name}"'
        )
        for _scope, scoped in self._all(CallTarget(), api.instances.aggregated_list, request):
            for found in scoped.instances:
                if found.name == name:
                    return _last(found.zone)
        return None

    # memory

    def _remember_zone(self, name: str, zone: str) -> None:
        with self._lock:
            self._zones[name] = zone

    def _remember(self, instance: Instance, instance_id: int) -> None:
        with self._lock:
            self._zones[instance.id] = instance.zone
            self._known[instance.id] = _Known(instance, instance_id)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._zones.pop(name, None)
            self._known.pop(name, None)


def _interrupted(inst: Instance, state: InstanceState) -> Instance:
    return replace(
        inst,
        state=state,
        interrupted=True,
        state_reason=f"preempted by Compute Engine ({PREEMPTED_OPERATION})",
    )


def _is_not_found(error: BadRequestError) -> bool:
    cause = error.__cause__
    return cause is not None and _http_code(cause) == 404


def _is_timeout(error: BaseException) -> bool:
    try:
        import requests
    except ImportError:  # pragma: no cover
        return isinstance(error, TimeoutError)
    return isinstance(error, requests.Timeout | TimeoutError)


def _last(link: str) -> str:
    """The last segment of a resource URL or path (``.../zones/us-central1-a`` ->
    ``us-central1-a``)."""
    return link.rstrip("/").rsplit("/", 1)[-1]


def _timestamp(text: str) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
