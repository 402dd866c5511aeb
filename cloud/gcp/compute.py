"""The gcp provider: Compute Engine VMs behind the :class:`~spottrain.cloud.base.Provider`
contract (see the package's docstring for how the contract maps onto Compute Engine)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from spottrain.catalog import Catalog, bundled
from spottrain.cloud.base import (
    CONSOLE_TAIL_BYTES,
    TAG_JOB,
    TAG_NODE,
    TAG_REQUEST,
    BadRequestError,
    Instance,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    OfferQuery,
    ProviderError,
    TransientError,
    console_tail,
    region_of_zone,
)
from spottrain.cloud.gcp.api import (
    _is_not_found,
    _last,
    call_api,
    list_all,
    rest_client,
    wait_zone_operation,
)
from spottrain.cloud.gcp.errors import CallTarget, _http_code, _is_api_error, classify_error
from spottrain.cloud.gcp.launch import instance_body, instance_name
from spottrain.cloud.gcp.preemptions import Preemptions, interrupted, preempted_in
from spottrain.cloud.gcp.prices import catalog_offers
from spottrain.cloud.gcp.settings import (
    _LABEL_VALUE_RE,
    _MACHINE_TYPES_TTL_S,
    _NAME_RE,
    CLOUD,
    GcpSettings,
)
from spottrain.lazy_import import lazy_import

if TYPE_CHECKING:
    from google.auth.credentials import Credentials
    from google.cloud import compute_v1


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
        lazy_import(
            "google.cloud.compute_v1",
            needs="the gcp cloud needs google-cloud-compute",
            extra="gcp",
            show_cause=True,
        )
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
        zones_with = self._zones_with if self.settings.verify_zones else None
        return catalog_offers(self._catalog, self._regions, query, zones_with)

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
        body = instance_body(self.settings, self._catalog, name, request)
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
                inst = interrupted(inst, inst.state)
            self._remember(inst, found.id)
            result.append(inst)
        for known in vanished:
            inst = known.instance
            if preempted.names_vm(inst.zone, inst.id, known.instance_id):
                # Preempted with termination action DELETE: gone, but it was taken from us.
                result.append(interrupted(inst, InstanceState.TERMINATED))
            else:
                self._forget(inst.id)
        return sorted(result, key=lambda i: (i.zone, i.id))

    def _preempted(self, zones: Iterable[str]) -> Preemptions:
        """The VMs that preemption operations in these zones name."""
        return preempted_in(self.settings.project, zones, self._api().operations, self._all)

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

    # console

    def console_output(self, instance_id: str) -> str:
        """The end of the VM's serial port 1 output (``getSerialPortOutput`` with a
        negative ``start``: the newest :data:`CONSOLE_TAIL_BYTES`), or ``""`` while it has
        none and for a VM Compute Engine does not know.

        Raises:
            AuthError, TransientError: the API refused or failed the call.
        """
        if not _NAME_RE.match(instance_id):
            return ""  # not a Compute Engine name, so not a VM of ours
        zone = self._zone_of(instance_id)
        if zone is None:
            return ""
        from google.cloud import compute_v1

        target = CallTarget(zone=zone, region=region_of_zone(CLOUD, zone))
        request = compute_v1.GetSerialPortOutputInstanceRequest(
            project=self.settings.project,
            zone=zone,
            instance=instance_id,
            port=1,
            start=-CONSOLE_TAIL_BYTES,
        )
        try:
            found = self._call(
                target, self._api().instances.get_serial_port_output, request=request
            )
        except BadRequestError as e:
            if _is_not_found(e):
                self._forget(instance_id)
                return ""
            raise
        return console_tail(str(found.contents or "").encode())

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


def _timestamp(text: str) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
